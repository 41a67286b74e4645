"""Forwarding one completion to the leased slot's server and the answer back to the client.

- A server that fails before any byte of the answer reached the client raises
  ``NotStarted``: the caller may retry the request elsewhere.
- A stream that breaks after it started ends with an SSE error event in the OpenAI shape and
  a clean end of stream, never a second HTTP response inside the first.
- The answer is read from the server as fast as it comes, into a bounded buffer, so a client
  that reads slowly does not hold the slot: ``on_upstream_done`` runs as soon as the server
  is done (the slot is saved and released then). A client that falls more than
  ``buffer_bytes`` behind is cut.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.errors import BackendError
from proxy.server.coordinator import Lease
from proxy.server.dataplane.wire import LineSplitter
from proxy.server.http.answer import AnswerShape

CLIENT_WRITE_TIMEOUT_S = 120.0  # a client that takes no byte for this long is gone: cut it
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}


class NotStarted(Exception):
    """The server failed before any byte of the answer reached the client. ``delivered``: the
    request reached the server (it did not fail to connect), so it may be what broke it."""

    def __init__(self, message: str, *, delivered: bool) -> None:
        super().__init__(message)
        self.delivered = delivered


# Failures before the request was sent: it cannot have harmed the server.
_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


class AnswerTooLarge(BackendError):
    """The server's answer is larger than the proxy holds for a client (--max-answer)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"llama-server's answer is larger than {limit} bytes, the most the proxy holds for one "
            "answer (--max-answer): ask for fewer tokens or log-probabilities"
        )


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body of an answer, refused past ``limit`` bytes (the connection is then closed
    before the rest is read, and the server stops)."""
    if resp.content_length is not None and resp.content_length > limit:
        raise AnswerTooLarge(limit)
    buf = bytearray()
    async for chunk in resp.content.iter_any():
        buf += chunk
        if len(buf) > limit:
            raise AnswerTooLarge(limit)
    return bytes(buf)


class NoRoom(Exception):
    """The server ran out of free KV cells for this request (it clears the slots it was
    computing); nothing reached the client, so the request can be tried once more."""


NO_ROOM_MARK = b"Context size has been exceeded"  # llama-server's error when a decode finds no cells


@dataclass
class Outcome:
    """What the answer said, filled in as it streams so that a disconnect keeps what was seen."""

    status: int = 0
    ttft_s: float | None = None
    timings: dict[str, Any] | None = None
    broken: str = ""  # why the stream ended early (server gone, client too slow)
    _lines: LineSplitter = field(default_factory=LineSplitter)

    longest_line: int = 0  # of the last chunk fed, the line not ended yet included

    def feed_sse(self, chunk: bytes) -> None:
        lines = self._lines.feed(chunk)
        self.longest_line = max([self._lines.pending, *map(len, lines)])
        for line in lines:
            if line.startswith(b"data: ") and b'"timings"' in line:
                self.timings = timings_of(line[6:]) or self.timings


def timings_of(raw: bytes) -> dict[str, Any] | None:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    timings = data.get("timings") if isinstance(data, dict) else None
    return timings if isinstance(timings, dict) else None


def forward_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}


def radix_headers(lease: Lease, show: bool) -> dict[str, str]:
    if not show:
        return {"X-Request-Id": lease.request_id}
    return {
        "X-Radix-Route": lease.route,
        "X-Radix-Server": lease.server.name,
        "X-Radix-Slot": str(lease.slot.slot_id),
        "X-Radix-Prompt-Tokens": str(len(lease.tokens)),
        "X-Radix-Predicted-Cached-Tokens": str(0 if lease.fallback else lease.plan.predicted_cached),
        # Where the time before the forward went (docs/observability.md): all known by now.
        "X-Radix-Waits-Ms": wait_header(lease),
        "X-Request-Id": lease.request_id,
        # The prompt tokens (and ms) the server computed for this request before it, in a
        # prefix step for its wave: prompt_n of the answer does not count them.
        **(
            {"X-Radix-Prefix-Step": f"tokens={lease.prefix_step_tokens},ms={round(lease.prefix_step_ms)}"}
            if lease.split_to > 0
            else {}
        ),
    }


def wait_header(lease: Lease) -> str:
    """``queued=..,prefix=..,lock=..,restore=..`` in whole milliseconds: the wait for a slot, for
    a request in flight with the prompt's prefix, for the server's move lock (within the
    restore), and the whole restore."""
    parts = (
        ("queued", lease.queued_s),
        ("prefix", lease.prefix_wait_s),
        ("lock", lease.lock_wait_s),
        ("restore", lease.restore_s),
    )
    return ",".join(f"{k}={round(v * 1000)}" for k, v in parts)


def sse_error(message: str, code: int = 502) -> bytes:
    body = {"error": {"code": code, "message": message, "type": "server_error"}}
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def forward_completion(
    request: web.Request,
    body: dict[str, Any],
    lease: Lease,
    arrived: float,
    outcome: Outcome,
    *,
    show: bool,
    retry_no_room: bool = False,
    buffer_bytes: int,
    max_answer_bytes: int,
    on_upstream_done: Callable[[], None],
    path: str | None = None,
    shape: AnswerShape | None = None,
) -> web.StreamResponse:
    """``body`` to the server's ``path`` (the request's own by default); the answer back in
    ``shape`` (the server's own by default)."""
    backend = lease.server.client
    shape = shape if shape is not None else AnswerShape(show)
    headers = {**forward_headers(request), "Content-Type": "application/json"}
    started = False
    try:
        async with backend.post_stream(path or request.path, orjson.dumps(body), headers) as up:
            outcome.status = up.status
            extra = radix_headers(lease, show)
            if "text/event-stream" not in up.headers.get("Content-Type", ""):
                try:
                    raw = await read_capped(up, max_answer_bytes)
                except AnswerTooLarge:
                    outcome.status = 502
                    raise
                if retry_no_room and up.status >= 500 and NO_ROOM_MARK in raw:
                    raise NoRoom(raw[:200].decode(errors="replace"))
                outcome.ttft_s = time.monotonic() - arrived
                outcome.timings = shape.timings(raw)
                on_upstream_done()
                if outcome.timings is not None and show:
                    extra["X-Radix-Cached-Tokens"] = str(outcome.timings.get("cache_n", 0))
                return web.Response(
                    body=shape.answer(raw, up.status),
                    status=up.status,
                    headers=extra,
                    content_type=up.content_type or "application/json",
                )
            stream = web.StreamResponse(
                status=up.status,
                headers={**extra, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            )
            await stream.prepare(request)
            started = True
            limits = (buffer_bytes, max_answer_bytes)
            await _relay(request, up, stream, lease, arrived, outcome, shape, limits, on_upstream_done)
            return stream
    except (aiohttp.ClientError, TimeoutError) as exc:
        if not started:
            delivered = not isinstance(exc, _NOT_SENT)
            raise NotStarted(f"{type(exc).__name__}: {exc}", delivered=delivered) from exc
        raise


async def _relay(
    request: web.Request,
    up: aiohttp.ClientResponse,
    stream: web.StreamResponse,
    lease: Lease,
    arrived: float,
    outcome: Outcome,
    shape: AnswerShape,
    limits: tuple[int, int],
    on_upstream_done: Callable[[], None],
) -> None:
    """Server -> bounded buffer -> client, the two sides at their own pace. ``limits``: the
    bytes a client may fall behind, and the longest SSE line held before its end comes."""
    buffer_bytes, max_line = limits
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    buffered = 0

    async def pump() -> None:
        nonlocal buffered
        try:
            async for chunk in up.content.iter_any():
                if outcome.ttft_s is None:
                    outcome.ttft_s = time.monotonic() - arrived
                    lease.prompt_computed()
                outcome.feed_sse(chunk)
                if outcome.longest_line > max_line:
                    outcome.broken = f"an event of the answer is larger than {max_line} bytes (--max-answer)"
                    queue.put_nowait(b"\n" + sse_error(outcome.broken))  # ends the cut line first
                    return
                buffered += len(chunk)
                if buffered > buffer_bytes:
                    outcome.broken = f"the client fell more than {buffer_bytes} bytes behind and was cut"
                    if request.transport is not None:
                        request.transport.abort()  # the writer's pending write fails
                    return
                queue.put_nowait(chunk)
            # A short answer arrives in one read: let the writer send it before the slot's
            # release and the decision record run (they are not on the client's first token).
            await asyncio.sleep(0)
            on_upstream_done()
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome.broken = f"llama-server stopped answering mid-stream ({type(exc).__name__})"
            queue.put_nowait(sse_error(outcome.broken))
        finally:
            queue.put_nowait(None)

    stripper = shape.stream()
    reader = asyncio.get_running_loop().create_task(pump())
    try:
        while (chunk := await queue.get()) is not None:
            buffered -= len(chunk)
            # A client that went away raises here; leaving the caller's block closes the
            # upstream connection, and llama-server cancels the task when it sees that.
            await _write(request, stream, chunk if stripper is None else stripper.feed(chunk))
        if stripper is not None:
            await _write(request, stream, stripper.flush())
        async with asyncio.timeout(CLIENT_WRITE_TIMEOUT_S):
            await stream.write_eof()
    finally:
        if not reader.done():
            reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def _write(request: web.Request, stream: web.StreamResponse, data: bytes) -> None:
    """One write to the client, bounded: a client that stopped reading is cut."""
    try:
        async with asyncio.timeout(CLIENT_WRITE_TIMEOUT_S):
            await stream.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise
