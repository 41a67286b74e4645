"""Replay a workload (or a recorded manifest) against an OpenAI-compatible URL.

Every request is streamed: TTFT is the time to the first chunk carrying answer content
(the end of the answer when it has none), end-to-end the time to the last byte, and the
final chunk's ``timings`` (llama-server's own) give ``cache_n``, ``prompt_n`` and
``predicted_n``. Each run writes a manifest, JSON lines, one request per line in the
order sent:

    {"t": 0.0123, "id": "...", "session": "...", "group": "...", "via": "front",
     "path": "/v1/chat/completions", "body": {...}}

``t`` is the send time in seconds from the start of the run and ``body`` the exact body
sent (arm overrides such as ``cache_prompt: false`` included). ``replay_manifest`` sends
each line at its ``t`` (open loop), so a run's timing can be reproduced against any
OpenAI URL.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp
import orjson

from proxy.traffic.spec import BenchRequest, Workload

CHAT_PATH = "/v1/chat/completions"


@dataclass
class RequestResult:
    id: str
    session: str
    group: str
    via: str
    sent_s: float  # from the start of the run
    status: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None
    cache_n: int | None = None
    prompt_n: int | None = None
    predicted_n: int | None = None
    prompt_ms: float | None = None  # the server's own prefill time (timings.prompt_ms)
    route: str | None = None  # X-Radix-Route, when the answer came through the proxy
    meta: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None  # of the last choice that gave one ("stop", "length", ...)
    # X-Radix-Waits-Ms: the proxy's waits before the forward, in ms (queued, prefix, lock, restore)
    waits_ms: dict[str, float] | None = None
    # X-Radix-Prefix-Step's tokens: computed before the answer for its wave, counted in prompt_n
    prefix_step_n: int | None = None
    # speculative decoding (a server with a draft model): tokens drafted and accepted (timings)
    draft_n: int | None = None
    draft_n_accepted: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestResult:
        return cls(**data)


@dataclass(frozen=True)
class ManifestEntry:
    t: float
    id: str
    session: str
    group: str
    via: str
    body: dict[str, Any]
    path: str = CHAT_PATH

    def to_line(self) -> str:
        return orjson.dumps(
            {
                "t": round(self.t, 6),
                "id": self.id,
                "session": self.session,
                "group": self.group,
                "via": self.via,
                "path": self.path,
                "body": self.body,
            }
        ).decode()

    @classmethod
    def from_line(cls, line: str) -> ManifestEntry:
        d = json.loads(line)
        return cls(
            float(d["t"]),
            str(d["id"]),
            str(d.get("session", "")),
            str(d.get("group", "")),
            str(d.get("via", "front")),
            dict(d["body"]),
            str(d.get("path", CHAT_PATH)),
        )


def write_manifest(path: Path, entries: Iterable[ManifestEntry]) -> None:
    with open(path, "w") as handle:
        for entry in entries:
            handle.write(entry.to_line() + "\n")


def read_manifest(path: Path) -> list[ManifestEntry]:
    with open(path) as handle:
        entries = [ManifestEntry.from_line(line) for line in handle if line.strip()]
    return sorted(entries, key=lambda e: e.t)


def base_url(url: str) -> str:
    """``http://host:port`` from an OpenAI base URL with or without ``/v1``."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class Progress:
    """One status line on stderr (rewritten in place on a terminal, every 10 % otherwise)."""

    def __init__(self, label: str, total: int, stream: IO[str] | None = None) -> None:
        self.label, self.total, self.done, self.errors = label, total, 0, 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self._last_pct = -10

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.errors += 0 if result.ok else 1
        pct = 100 * self.done // max(1, self.total)
        ttft = f"{result.ttft_s:.2f}s" if result.ttft_s is not None else "-"
        line = (
            f"[bench {self.label}] {self.done}/{self.total} done, {self.errors} errors, "
            f"{time.monotonic() - self.started:.0f}s, last {result.id} ttft {ttft}"
        )
        if self.tty:
            self.stream.write("\r" + line.ljust(100))
            if self.done == self.total:
                self.stream.write("\n")
        elif pct >= self._last_pct + 10 or self.done == self.total:
            self.stream.write(line + "\n")
            self._last_pct = pct
        if not result.ok and result.error:
            self.stream.write(
                ("\n" if self.tty else "") + f"[bench {self.label}] {result.id}: {result.error}\n"
            )
        self.stream.flush()


def parse_waits(header: str | None) -> dict[str, float] | None:
    """``queued=12,prefix=0,...`` as a dict; None when absent or not that shape."""
    if not header:
        return None
    out: dict[str, float] = {}
    for part in header.split(","):
        key, _, value = part.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            return None
    return out


def _has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or choice.get("text"):
            return True
    return False


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any], result: RequestResult) -> None:
    """POST one streamed request and fill ``result`` in (never raises for a failed request)."""
    started = time.perf_counter()
    timings: dict[str, Any] | None = None
    step: dict[str, float] | None = None
    try:
        async with session.post(
            url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as resp:
            result.status = resp.status
            result.route = resp.headers.get("X-Radix-Route")
            result.waits_ms = parse_waits(resp.headers.get("X-Radix-Waits-Ms"))
            step = parse_waits(resp.headers.get("X-Radix-Prefix-Step"))  # tokens=..,ms=..
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if line.startswith(b"error:"):
                    # llama-server reports a failure after the stream started (e.g. the KV pool
                    # ran out: "Context size has been exceeded.") as an `error:` event.
                    result.error = _event_error(line[6:].strip())
                    continue
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(chunk, dict):
                    continue
                if "type" in chunk:  # an Anthropic Messages event
                    if read_anthropic_event(chunk, result, started):
                        break
                    continue
                for choice in chunk.get("choices") or []:
                    if isinstance(choice, dict) and choice.get("finish_reason"):
                        result.finish_reason = str(choice["finish_reason"])
                if result.ttft_s is None and _has_content(chunk):
                    result.ttft_s = time.perf_counter() - started
                if isinstance(chunk.get("timings"), dict):
                    timings = chunk["timings"]
                if isinstance(chunk.get("error"), dict):
                    result.error = str(chunk["error"].get("message", chunk["error"]))
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.e2e_s = time.perf_counter() - started
    if result.ttft_s is None and result.ok:
        result.ttft_s = result.e2e_s
    if timings:
        result.cache_n = _int(timings.get("cache_n"))
        result.prompt_n = _int(timings.get("prompt_n"))
        result.predicted_n = _int(timings.get("predicted_n"))
        result.draft_n = _int(timings.get("draft_n"))
        result.draft_n_accepted = _int(timings.get("draft_n_accepted"))
        prompt_ms = timings.get("prompt_ms")
        result.prompt_ms = float(prompt_ms) if isinstance(prompt_ms, int | float) else None
    add_prefix_step(result, step)


def add_prefix_step(result: RequestResult, step: dict[str, float] | None) -> None:
    """Count what the server computed for this request in a prefix step before its answer
    (``X-Radix-Prefix-Step``) in its ``prompt_n`` and ``prompt_ms``, not in ``cache_n``: the
    answer's own timings count it as reused, and a prefill count without it would flatter the
    proxy."""
    if not step:
        return
    result.prefix_step_n = int(step.get("tokens", 0))
    if result.prompt_n is not None:
        result.prompt_n += result.prefix_step_n
    if result.cache_n is not None:  # the server counts them as reused by the answer
        result.cache_n = max(0, result.cache_n - result.prefix_step_n)
    if result.prompt_ms is not None:
        result.prompt_ms += step.get("ms", 0.0)


def read_anthropic_event(event: dict[str, Any], result: RequestResult, started: float) -> bool:
    """One event of a ``/v1/messages`` stream into ``result``; True at ``message_stop``. The
    prompt's usage comes in ``message_start`` (cached and computed tokens), the stop reason and
    the answer's length in ``message_delta``."""
    kind = event.get("type")
    if kind == "message_start":
        usage = (event.get("message") or {}).get("usage") or {}
        result.cache_n = _int(usage.get("cache_read_input_tokens"))
        result.prompt_n = _int(usage.get("input_tokens"))
    elif kind == "content_block_delta" and result.ttft_s is None:
        delta = event.get("delta") or {}
        if delta.get("text") or delta.get("thinking") or delta.get("partial_json"):
            result.ttft_s = time.perf_counter() - started
    elif kind == "message_delta":
        stop = (event.get("delta") or {}).get("stop_reason")
        result.finish_reason = str(stop) if stop else result.finish_reason
        result.predicted_n = _int((event.get("usage") or {}).get("output_tokens"))
    elif kind == "error":
        err = event.get("error") or {}
        result.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
    return kind == "message_stop"


def _event_error(data: bytes) -> str:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data.decode(errors="replace")[:300] or "error event"
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message", err))[:300]
    return str(err)[:300]


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def _session(timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=10),
        connector=aiohttp.TCPConnector(limit=0),
    )


async def run_workload(
    workload: Workload,
    front_url: str,
    server_url: str | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    manifest: Path | None = None,
    label: str = "",
    timeout_s: float = 900.0,
) -> list[RequestResult]:
    """Send every request once its dependencies finished, at most ``workload.concurrency`` at once.

    ``via == "server"`` requests go to ``server_url`` (the arm's llama-server), the others to
    ``front_url``. Results come back in workload order.
    """
    front, server = base_url(front_url), base_url(server_url or front_url)
    done = {r.id: asyncio.Event() for r in workload.requests}
    limit = asyncio.Semaphore(workload.concurrency)
    progress = Progress(label or workload.name, len(workload.requests))
    entries: list[ManifestEntry] = []
    t0 = time.perf_counter()

    async def one(req: BenchRequest, session: aiohttp.ClientSession) -> RequestResult:
        try:
            for dep in req.after:
                await done[dep].wait()
            if req.delay_s:
                await asyncio.sleep(req.delay_s)
            async with limit:
                body = {**req.body, **(overrides or {}), "stream": True}
                sent = time.perf_counter() - t0
                entries.append(ManifestEntry(sent, req.id, req.session, req.group, req.via, body, req.path))
                result = RequestResult(req.id, req.session, req.group, req.via, sent, meta=dict(req.meta))
                await send(session, (server if req.via == "server" else front) + req.path, body, result)
                progress.update(result)
                return result
        finally:
            done[req.id].set()

    async with _session(timeout_s) as session:
        results = await asyncio.gather(*(one(r, session) for r in workload.requests))
    if manifest is not None:
        write_manifest(manifest, sorted(entries, key=lambda e: e.t))
    return list(results)


async def replay_manifest(
    entries: list[ManifestEntry],
    url: str,
    *,
    speed: float = 1.0,
    label: str = "replay",
    timeout_s: float = 900.0,
) -> list[RequestResult]:
    """Send each entry at its recorded time (divided by ``speed``) to ``url``, whatever its ``via``."""
    front = base_url(url)
    progress = Progress(label, len(entries))
    t0 = time.perf_counter()

    async def one(entry: ManifestEntry, session: aiohttp.ClientSession) -> RequestResult:
        wait = entry.t / speed - (time.perf_counter() - t0)
        if wait > 0:
            await asyncio.sleep(wait)
        result = RequestResult(entry.id, entry.session, entry.group, entry.via, time.perf_counter() - t0)
        await send(session, front + entry.path, entry.body, result)
        progress.update(result)
        return result

    async with _session(timeout_s) as session:
        return list(await asyncio.gather(*(one(e, session) for e in entries)))


def write_results(path: Path, results: Iterable[RequestResult]) -> None:
    with open(path, "w") as handle:
        for result in results:
            handle.write(orjson.dumps(result.to_json()).decode() + "\n")


def read_results(path: Path) -> list[RequestResult]:
    with open(path) as handle:
        return [RequestResult.from_json(json.loads(line)) for line in handle if line.strip()]
