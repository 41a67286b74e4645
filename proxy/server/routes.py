"""The OpenAI-compatible routes: tokenize, lease a slot, restore, forward, stream back."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import orjson
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from proxy.errors import BadRequest, NotFound, RadixError
from proxy.server.coordinator import Lease
from proxy.server.front import (
    SseStripper,
    cache_namespace,
    check_one_answer,
    parse_json,
    prompt_token_ids,
    refusal,
    strip_cache_info_raw,
)
from proxy.server.observe import refresh_metrics
from proxy.server.runtime import RUNTIME

log = logging.getLogger("radix")

_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}
_ids = itertools.count(1)


def add_routes(app: web.Application) -> None:
    for path in ("/v1/chat/completions", "/chat/completions"):
        app.router.add_post(path, chat)
    for path in ("/v1/completions", "/completions", "/completion"):
        app.router.add_post(path, completion)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)


def add_catch_all(app: web.Application) -> None:
    """Last: the read-only allowlist goes to the first server unchanged; the rest is 404."""
    app.router.add_route("*", "/{tail:.*}", forward_plain)


async def _read_json(request: web.Request) -> dict[str, Any]:
    body = await parse_json(await request.read())
    recorder = request.app[RUNTIME].recorder
    if recorder is not None:
        recorder.record(request.path, orjson.loads(orjson.dumps(body)), request.headers.get("X-Session-Id", ""))
    check_one_answer(body)
    return body


def _forward_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}


async def chat(request: web.Request) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    body = await _read_json(request)
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise BadRequest("'messages' must be a non-empty array")
    prompt = await runtime.primary.apply_template(body, _forward_headers(request))
    tokens = await runtime.tokenize(prompt)
    return await _steered(request, body, tokens)


async def completion(request: web.Request) -> web.StreamResponse:
    """/v1/completions (OpenAI) and /completion, /completions (llama.cpp's own): one prompt,
    a string or token ids. Several prompts would run on slots the proxy did not lease."""
    runtime = request.app[RUNTIME]
    body = await _read_json(request)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = await runtime.tokenize(prompt)
    elif isinstance(prompt, list) and prompt and not isinstance(prompt[0], str | list | dict):
        server = runtime.coordinator.servers[0]
        tokens = prompt_token_ids(prompt, runtime.n_vocab, server.n_ctx_slot)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("several prompts in one request are not supported through the proxy: send one per request")
    else:
        raise BadRequest("'prompt' must be a string or an array of token ids")
    return await _steered(request, body, tokens)


@dataclass
class _Outcome:
    """What the answer said, filled in as it streams so that a disconnect keeps what was seen."""

    status: int = 0
    ttft_s: float | None = None
    timings: dict[str, Any] | None = None
    _partial: bytes = b""

    def feed_sse(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line.startswith(b"data: ") and b'"timings"' in line:
                self.timings = _timings_of(line[6:]) or self.timings


async def _steered(request: web.Request, body: dict[str, Any], tokens: np.ndarray) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    coord = runtime.coordinator
    request_id = f"r{next(_ids)}"
    arrived = time.monotonic()
    ns = cache_namespace(runtime.config, body, request.headers)
    lease = await coord.acquire(request_id, tokens, ns)
    outcome = _Outcome()
    try:
        await coord.restore(lease, _n_predict(body))
        if lease.no_cache:
            body["cache_prompt"] = False
        elif body.get("cache_prompt") is not False:
            body["cache_prompt"] = True
        body["id_slot"] = lease.slot.slot_id
        return await _forward_completion(request, body, lease, arrived, outcome)
    finally:
        coord.record(lease, outcome.timings, outcome.ttft_s, outcome.status)
        runtime.spawn(coord.finish(lease))


def _n_predict(body: dict[str, Any]) -> int:
    """Tokens the answer may add to the slot (for the free-cell headroom)."""
    for key in ("max_completion_tokens", "max_tokens", "n_predict"):
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 256


def _radix_headers(lease: Lease, show: bool) -> dict[str, str]:
    if not show:
        return {"X-Request-Id": lease.request_id}
    return {
        "X-Radix-Route": lease.route,
        "X-Radix-Server": lease.server.name,
        "X-Radix-Slot": str(lease.slot.slot_id),
        "X-Radix-Prompt-Tokens": str(len(lease.tokens)),
        "X-Radix-Predicted-Cached-Tokens": str(0 if lease.fallback else lease.plan.predicted_cached),
        "X-Request-Id": lease.request_id,
    }


async def _forward_completion(request: web.Request, body: dict[str, Any], lease: Lease, arrived: float,
                              outcome: _Outcome) -> web.StreamResponse:
    backend = lease.server.backend
    show = request.app[RUNTIME].config.cache_info
    headers = {**_forward_headers(request), "Content-Type": "application/json"}
    async with backend.post_stream(request.path, orjson.dumps(body), headers) as up:
        outcome.status = up.status
        extra = _radix_headers(lease, show)
        if "text/event-stream" not in up.headers.get("Content-Type", ""):
            raw = await up.read()
            outcome.ttft_s = time.monotonic() - arrived
            outcome.timings = _timings_of(raw)
            if outcome.timings is not None and show:
                extra["X-Radix-Cached-Tokens"] = str(outcome.timings.get("cache_n", 0))
            return web.Response(body=raw if show else strip_cache_info_raw(raw), status=up.status, headers=extra,
                                content_type=up.content_type or "application/json")
        stream = web.StreamResponse(status=up.status, headers={**extra, "Content-Type": "text/event-stream",
                                                                "Cache-Control": "no-cache"})
        await stream.prepare(request)
        stripper = None if show else SseStripper()
        async for chunk in up.content.iter_any():
            if outcome.ttft_s is None:
                outcome.ttft_s = time.monotonic() - arrived
            outcome.feed_sse(chunk)
            # A client that went away raises here; leaving the block closes the upstream
            # connection, and llama-server cancels the task when it sees that.
            await stream.write(chunk if stripper is None else stripper.feed(chunk))
        if stripper is not None:
            await stream.write(stripper.flush())
        await stream.write_eof()
        return stream


def _timings_of(raw: bytes) -> dict[str, Any] | None:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    timings = data.get("timings") if isinstance(data, dict) else None
    return timings if isinstance(timings, dict) else None


async def health(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    bad = []
    for server in runtime.coordinator.servers:
        try:
            await server.backend.get_json("/health")
        except (RadixError, aiohttp.ClientError) as exc:
            bad.append(f"{server.name}: {exc}")
    if bad:
        return web.json_response({"status": "error", "servers": bad}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    await refresh_metrics(runtime)
    return web.Response(body=generate_latest(runtime.metrics.registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def forward_plain(request: web.Request) -> web.StreamResponse:
    """The read-only allowlist goes to the first server unchanged; anything else is 404."""
    why = refusal(request.method, request.path)
    if why is not None:
        raise NotFound(why)
    runtime = request.app[RUNTIME]
    backend = runtime.primary
    async with backend.session.request(request.method, backend.url + request.path_qs, data=await request.read(),
                                       headers=_forward_headers(request)) as up:
        raw = await up.read()
        headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS | {"content-encoding"}}
        return web.Response(body=raw, status=up.status, headers=headers)
