"""The OpenAI-compatible routes: tokenize, lease a slot, restore, forward, stream back."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from proxy.config import Config
from proxy.core.adapters import request_adapters, server_scales, with_adapters
from proxy.errors import BackendError, BadRequest, NotFound, RequestTimeout, TooLarge
from proxy.server.api.media import chat_tokens
from proxy.server.api.shapes import check_prompt_count
from proxy.server.coordinator import Lease, RestoreAbandoned
from proxy.server.dataplane.backend import ServerClient
from proxy.server.dataplane.kvctl import Tokenized
from proxy.server.http.answer import AnswerShape
from proxy.server.http.forward import (
    HOP_HEADERS,
    NoRoom,
    NotStarted,
    Outcome,
    forward_completion,
    forward_headers,
    read_capped,
)
from proxy.server.http.front import (
    cache_namespace,
    check_one_answer,
    hide_cache_info_request,
    parse_json,
    prompt_token_ids,
    refusal,
)
from proxy.server.http.limits import check_request
from proxy.server.ops.admin import refuse_admin
from proxy.server.ops.models import ModelEntry, models_listing, pick_model, with_model
from proxy.server.ops.observe import refresh_metrics
from proxy.server.ops.runtime import RUNTIME, Runtime

log = logging.getLogger("radix")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SESSION_HEADER = "X-Session-Id"  # the session-affinity key (a routing tie-break only)


def add_routes(app: web.Application) -> None:
    for path in ("/v1/chat/completions", "/chat/completions"):
        app.router.add_post(path, chat)
    for path in ("/v1/completions", "/completions", "/completion"):
        app.router.add_post(path, completion)
    for path in ("/v1/models", "/models"):
        app.router.add_get(path, list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)


def on_metrics_port(request: web.Request, config: Config) -> bool:
    """Whether the request came in on ``--metrics-port`` (the socket it arrived on says)."""
    if not config.metrics_port or request.transport is None:
        return False
    sockname = request.transport.get_extra_info("sockname")
    return isinstance(sockname, tuple) and len(sockname) >= 2 and sockname[1] == config.metrics_port


_NOT_PLAIN = re.compile(r"%|//|(^|/)\.\.?(/|$)")


@web.middleware
async def plain_paths_only(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A path with percent-encoding, ``//`` or dot segments is refused before any route matches:
    aiohttp matches the decoded path, so ``/%72adix/routes`` was the admin API to the proxy but
    not to a balancer in front that blocks ``/radix/`` by its raw text."""
    if _NOT_PLAIN.search(request.raw_path.split("?", 1)[0]):
        raise NotFound("no such path (paths must be plain: no percent-encoding, '//' or dot segments)")
    return await handler(request)


@web.middleware
async def metrics_port_only(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The metrics port serves /metrics and nothing else."""
    if request.path != "/metrics" and on_metrics_port(request, request.app[RUNTIME].config):
        raise NotFound(f"{request.path} is not served on the metrics port")
    return await handler(request)


def add_catch_all(app: web.Application) -> None:
    """Last: the read-only allowlist goes to the first server unchanged; the rest is 404."""
    app.router.add_route("*", "/{tail:.*}", forward_plain)


async def read_body(request: web.Request) -> bytes:
    """The request body, within --body-timeout (a client sending a byte now and then would hold
    its connection and its buffer for ever)."""
    limit = request.app[RUNTIME].config.body_timeout_s
    try:
        async with asyncio.timeout(limit):
            return await request.read()
    except TimeoutError as exc:
        raise RequestTimeout(f"the request body did not arrive within {limit:g} s (--body-timeout)") from exc


async def _read_json(request: web.Request) -> dict[str, Any]:
    body = await parse_json(await read_body(request))
    recorder = request.app[RUNTIME].recorder
    if recorder is not None:
        recorder.append(
            request.path, orjson.loads(orjson.dumps(body)), request.headers.get("X-Session-Id", "")
        )
    check_one_answer(body)
    check_request(request.app[RUNTIME].config, body)
    return body


async def chat(request: web.Request) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    body = await _read_json(request)
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise BadRequest("'messages' must be a non-empty array")
    model = pick_model(runtime.models, body)
    tokens, media = await chat_tokens(runtime, body, forward_headers(request), model)
    return await _steered(request, body, tokens, model, media=media)


async def completion(request: web.Request) -> web.StreamResponse:
    """/v1/completions (OpenAI) and /completion, /completions (llama.cpp's own): one prompt,
    a string or token ids. Several prompts would run on slots the proxy did not lease."""
    runtime = request.app[RUNTIME]
    body = await _read_json(request)
    model = pick_model(runtime.models, body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = await runtime.tokenize(prompt, model)
    elif isinstance(prompt, list) and prompt and not isinstance(prompt[0], str | list | dict):
        n_ctx = min(s.n_ctx_slot for s in runtime.coordinator.servers if s.model == model.name)
        tokens = prompt_token_ids(prompt, model.n_vocab, n_ctx)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest(
            "several prompts in one request are not supported through the proxy: send one per request"
        )
    elif isinstance(prompt, dict) and "multimodal_data" in prompt:
        raise BadRequest(
            "a prompt with multimodal_data is not served through the proxy (each server marks "
            "media with its own random marker): send the media as content parts to /v1/chat/completions"
        )
    else:
        raise BadRequest("'prompt' must be a string or an array of token ids")
    return await _steered(request, body, tokens, model)


async def _steered(
    request: web.Request,
    body: dict[str, Any],
    tokens: np.ndarray,
    model: ModelEntry,
    *,
    path: str | None = None,
    shape: AnswerShape | None = None,
    api: str = "",
    media: Tokenized | None = None,
) -> web.StreamResponse:
    """Lease, restore, forward; once more elsewhere (or after a restart) when the server failed
    before the client saw a byte of the answer. ``path`` and ``shape``: where the body goes on
    the server and how its answer reaches the client (``forward_completion``); ``api`` labels
    ``radix_api_requests`` (chat or completions by default); ``media``: a request with media, as
    a server with a projector tokenized it (api/media.py)."""
    runtime = request.app[RUNTIME]
    coord, config = runtime.coordinator, runtime.config
    api = api or ("chat" if "chat" in request.path else "completions")
    runtime.metrics.api_requests.labels(api).inc()
    arrived = time.monotonic()
    adapters = request_adapters(body, server_scales(model.compat))
    ns = with_adapters(with_model(model.ns, cache_namespace(config, body, request.headers)), adapters)
    session = request.headers.get(SESSION_HEADER, "")
    if not config.cache_info:
        hide_cache_info_request(body)
    original = body
    for attempt in (1, 2):
        body = dict(original)  # each attempt sets its own slot and cache_prompt
        lease = await coord.acquire(
            _request_id(),
            tokens,
            ns,
            model=model.name,
            session=session,
            n_predict=_n_predict(body),
            adapters=adapters,
            media=media,
        )
        outcome = Outcome()
        instance = lease.server.client.instance  # the process this attempt is sent to
        done = _once(functools.partial(_finish, runtime, lease, outcome, api))
        if body.get("cache_prompt") is False:
            lease.splittable = False  # its forward reuses nothing: a prefix step would be computed twice
        try:
            await coord.restore(lease, _n_predict(body))
            if lease.no_cache:
                body["cache_prompt"] = False
            elif body.get("cache_prompt") is not False:
                body["cache_prompt"] = True
            body["id_slot"] = lease.slot.slot_id
            return await forward_completion(
                request,
                body,
                lease,
                arrived,
                outcome,
                show=config.cache_info,
                buffer_bytes=config.stream_buffer_bytes,
                max_answer_bytes=config.max_answer_bytes,
                on_upstream_done=done,
                retry_no_room=attempt == 1,
                path=path,
                shape=shape,
            )
        except NoRoom as exc:
            outcome.status = 500
            log.warning(
                "request %s: %s had no free KV cells (%s); retrying once",
                lease.request_id,
                lease.server.name,
                exc,
            )
        except (NotStarted, RestoreAbandoned) as exc:
            outcome.status = 502
            coord.server_down(lease.server, str(exc))
            if isinstance(exc, NotStarted) and await _killed_by(lease, instance, exc):
                runtime.metrics.poison_requests.labels(lease.server.name).inc()
                log.error(
                    "request %s: %s died while it ran the request (%s); suspected poison request, "
                    "not retried",
                    lease.request_id,
                    lease.server.name,
                    exc,
                )
                raise BackendError(
                    "llama-server died while running this request; it is not retried (a request "
                    "that kills its server would kill the next one too)"
                ) from exc
            if attempt == 2:
                raise BackendError(f"llama-server failed before answering, twice: {exc}") from exc
            log.warning(
                "request %s: %s failed before answering (%s); retrying once",
                lease.request_id,
                lease.server.name,
                exc,
            )
        finally:
            done()
    raise AssertionError("unreachable")


async def _killed_by(lease: Lease, instance: str | None, exc: NotStarted) -> bool:
    """Whether the server died (or was replaced) after it took this request: then the request
    may be what killed it. A request that never reached it (connection refused) is not."""
    return exc.delivered and not await lease.server.client.survived(instance)


def _finish(runtime: Runtime, lease: Lease, outcome: Outcome, api: str) -> None:
    # With media, against the whole tokenization (the keyed part may end at an image).
    n_prompt = len(lease.media.tokens) if lease.media is not None else len(lease.tokens)
    check_prompt_count(runtime.metrics, api, n_prompt, outcome.timings, lease.request_id)
    try:
        runtime.coordinator.record_decision(lease, outcome.timings, outcome.ttft_s, outcome.status)
    finally:  # the slot is saved and released whatever the record made of the answer
        runtime.spawn(runtime.coordinator.finish(lease, _answer_tokens(outcome.timings)))


def _answer_tokens(timings: dict[str, Any] | None) -> int | None:
    """The answer's length as the server reported it (timings.predicted_n); None if it did not."""
    n = (timings or {}).get("predicted_n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` on the first call only: the server may be done before the client is."""
    called = False

    def call() -> None:
        nonlocal called
        if not called:
            called = True
            fn()

    return call


def _request_id() -> str:
    """Random, not a counter: a counter tells every client how many requests others sent
    between two of its own (timing, load), even with --cache-info off."""
    return f"r{secrets.token_hex(8)}"


def _n_predict(body: dict[str, Any]) -> int:
    """Tokens the answer may add to the slot (for the free-cell headroom)."""
    for key in ("max_completion_tokens", "max_tokens", "n_predict"):
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 256


async def health(request: web.Request) -> web.Response:
    """200 while at least one server serves (the body names the others), 503 when none does;
    from the health monitor's last round (a client cannot make the proxy probe its servers).
    Servers by name only: their URLs are inside the trust boundary (the admin API has them)."""
    runtime = request.app[RUNTIME]
    servers = [
        {
            "name": s.name,
            "status": "ok" if s.healthy else "down",
            **({"reason": s.down_reason} if not s.healthy else {}),
            # Served, but with routes A and prefill only: say which moves are off and why;
            # "on" only for a connected server whose layout check passed.
            **(
                {"kv_moves": "off", "kv_moves_off": list(s.moves_off), "kv_checkpoints": "on"}
                if s.moves_off and s.checkpoints
                else {"kv_moves": "off", "kv_moves_off": list(s.moves_off)}
                if s.moves_off
                else {"kv_moves": "on"}
                if s.healthy
                else {}
            ),
            # Where its KV lives (caps memory.buffers); a server whose caps cannot say has moves
            # off, and kv_moves_off says so.
            **(s.kv.as_json() if s.kv.unknown is None else {}),
        }
        for s in runtime.coordinator.servers
    ]
    up = sum(s["status"] == "ok" for s in servers)
    status = "ok" if up == len(servers) else ("degraded" if up else "error")
    return web.json_response({"status": status, "servers": servers}, status=200 if up else 503)


async def list_models(request: web.Request) -> web.Response:
    """Every model the proxy can serve, under the operator's names (``proxy/server/ops/models.py``)."""
    return web.json_response(models_listing(request.app[RUNTIME].models))


async def metrics(request: web.Request) -> web.Response:
    """Under the admin rule (loopback, or --admin-key) on the client port: a cache-hit counter
    moved by a client's own request tells it what others had cached, --cache-info off or not.
    On --metrics-port it needs nothing (that port serves only this)."""
    runtime = request.app[RUNTIME]
    if not on_metrics_port(request, runtime.config):
        refused = refuse_admin(request, runtime.config.admin_key)
        if refused is not None:
            return web.json_response(refused.to_body(), status=refused.status)
    await refresh_metrics(runtime)
    return web.Response(
        body=generate_latest(runtime.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def forward_plain(request: web.Request) -> web.StreamResponse:
    """The read-only allowlist goes to a healthy server unchanged; anything else is 404."""
    why = refusal(request.method, request.path)
    if why is not None:
        raise NotFound(why)
    runtime = request.app[RUNTIME]
    data, headers = await read_body(request), forward_headers(request)
    limit = runtime.config.max_passthrough_body_bytes
    if len(data) > limit:
        raise TooLarge(
            f"the body is {len(data)} bytes; read-only requests take at most {limit} (--max-passthrough-body)"
        )

    async def call(backend: ServerClient) -> web.Response:
        async with (
            runtime.passthrough.turn(backend.url),
            backend.request(request.method, request.path_qs, data=data, headers=headers) as up,
        ):
            raw = await read_capped(up, runtime.config.max_answer_bytes)
            # llama-server's permissive CORS headers are not passed on: the proxy grants no origin.
            kept = {
                k: v
                for k, v in up.headers.items()
                if k.lower() not in HOP_HEADERS | {"content-encoding"}
                and not k.lower().startswith("access-control-")
            }
            return web.Response(body=raw, status=up.status, headers=kept)

    return await runtime.on_any_server(call)
