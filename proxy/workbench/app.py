"""The workbench's HTTP app: the page, its JSON API, streamed turns (SSE) and ``/health``.

Everything model-related goes to the configured OpenAI base URL (the proxy); the page's
cache figures come from the proxy's answer headers and ``timings``, and ``/api/proxy`` reads
the proxy's ``/health`` and ``/metrics``. Needs the ``workbench`` extra (LangGraph).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.traffic.runner import ManifestEntry, base_url, replay_manifest
from proxy.workbench.graph import RunContext, build_graph, run_turn
from proxy.workbench.guard import JSON_TYPE, MANIFEST_TYPE, REPLAY_PATHS, check_content_type, host_guard
from proxy.workbench.llm import OpenAIModel
from proxy.workbench.protocol import AgentSettings, build_request, step_kind
from proxy.workbench.scenarios import SCENARIOS
from proxy.workbench.store import NotFound, Store
from proxy.workbench.tools import ToolContext

STATIC = Path(__file__).parent / "static"
MAX_MESSAGE = 8000
METRIC_PREFIXES = (
    "radix_requests_total",
    "radix_route_tokens_total",
    "radix_cached_tokens_total",
    "radix_prefilled_tokens_total",
    "radix_prompt_tokens_total",
    "radix_fallbacks_total",
)


@dataclass(frozen=True)
class WorkbenchConfig:
    llm_base_url: str  # the proxy's OpenAI base, ending in /v1
    incident_url: str
    db_path: str = "workbench.sqlite3"
    api_key: str = ""
    settings: AgentSettings = field(default_factory=AgentSettings)
    # Host names the page is served for besides loopback ones (guard.py: DNS rebinding).
    allowed_hosts: tuple[str, ...] = ()


@dataclass
class State:
    config: WorkbenchConfig
    store: Store
    graph: Any
    http: aiohttp.ClientSession | None = None
    hints: dict[str, bool] = field(default_factory=dict)  # see graph.RunContext


STATE = web.AppKey("workbench", State)


def _error(status: int, message: str) -> web.Response:
    kind = {404: "not_found_error"}.get(status, "invalid_request_error")
    return web.json_response({"error": {"code": status, "message": message, "type": kind}}, status=status)


def _bad(message: str) -> web.HTTPBadRequest:
    """A 400 in llama-server's error shape, raised from helpers."""
    body = {"error": {"code": 400, "message": message, "type": "invalid_request_error"}}
    return web.HTTPBadRequest(text=json.dumps(body), content_type="application/json")


async def _body(request: web.Request) -> dict[str, Any]:
    check_content_type(request, JSON_TYPE)
    try:
        body = await request.json()
    except ValueError as exc:
        raise _bad("body must be JSON") from exc
    if not isinstance(body, dict):
        raise _bad("body must be a JSON object")
    return body


@web.middleware
async def not_found_shape(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except NotFound as exc:
        return _error(404, str(exc))


async def index(_request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    incident = "unreachable"
    try:
        assert st.http is not None
        async with st.http.get(
            st.config.incident_url + "/health", timeout=aiohttp.ClientTimeout(total=3)
        ) as r:
            incident = "ok" if r.status == 200 else f"status {r.status}"
    except (aiohttp.ClientError, TimeoutError):
        pass
    return web.json_response(
        {
            "status": "ok",
            "llm_base_url": st.config.llm_base_url,
            "model": st.config.settings.model,
            "incident": incident,
        }
    )


async def scenarios(_request: web.Request) -> web.Response:
    return web.json_response([s.summary() for s in SCENARIOS.values()])


async def list_sessions(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].store.sessions())


async def create_session(request: web.Request) -> web.Response:
    body = await _body(request)
    scenario = SCENARIOS.get(str(body.get("scenario")))
    if scenario is None:
        return _error(400, f"scenario must be one of {', '.join(SCENARIOS)}")
    title = str(body.get("title") or scenario.title)[:120]
    return web.json_response(
        request.app[STATE].store.create_session(scenario.name, title, scenario.system), status=201
    )


async def get_session(request: web.Request) -> web.Response:
    store, sid = request.app[STATE].store, request.match_info["sid"]
    return web.json_response({"session": store.session(sid), "turns": store.turns(sid)})


def _turn_args(store: Store, sid: str, body: dict[str, Any]) -> tuple[str, str | None]:
    message, parent = body.get("message"), body.get("parent")
    if not isinstance(message, str) or not message.strip() or len(message) > MAX_MESSAGE:
        raise _bad(f"message must be text of 1 to {MAX_MESSAGE} characters")
    if parent is not None:
        store.turn(sid, str(parent))
    store.session(sid)
    return message, None if parent is None else str(parent)


async def preview(request: web.Request) -> web.Response:
    """The exact first request the next turn would send (later steps add tool results)."""
    st, sid = request.app[STATE], request.match_info["sid"]
    message, parent = _turn_args(st.store, sid, await _body(request))
    scenario = SCENARIOS[st.store.session(sid)["scenario"]]
    history = st.store.history(sid, parent)
    kind = step_kind(st.config.settings, 1, not any(m["role"] == "user" for m in history))
    body = build_request(scenario, st.config.settings, [*history, {"role": "user", "content": message}], kind)
    return web.json_response({"url": st.config.llm_base_url.rstrip("/") + "/chat/completions", "body": body})


async def send_turn(request: web.Request) -> web.StreamResponse:
    st, sid = request.app[STATE], request.match_info["sid"]
    message, parent = _turn_args(st.store, sid, await _body(request))
    scenario = SCENARIOS[st.store.session(sid)["scenario"]]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    gone = False

    async def emit(event: dict[str, Any]) -> None:
        nonlocal gone
        if gone:
            return
        try:
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        except (ConnectionError, RuntimeError):
            gone = True  # the page left: the turn still runs to its end and is saved

    assert st.http is not None
    model = OpenAIModel(st.config.llm_base_url, st.http, st.config.api_key)
    run = RunContext(
        scenario, st.config.settings, model, ToolContext(st.config.incident_url, st.http), emit, st.hints
    )
    result = await run_turn(st.graph, run, st.store.history(sid, parent), message)
    turn = st.store.add_turn(
        sid, parent, message, result.messages, result.final, result.calls, result.tools, result.error
    )
    await emit({"type": "done", "turn": turn})
    return resp


def manifest_lines(store: Store, sid: str, tid: str | None) -> list[str]:
    """The session's model calls (or those on the path to ``tid``) as a ``radixctl bench replay`` manifest."""
    session = store.session(sid)
    turns = store.path(sid, tid) if tid else store.turns(sid)
    calls = [(turn, call) for turn in turns for call in turn["calls"]]
    t0 = min((c["sent_at"] for _, c in calls), default=0.0)
    entries = [
        ManifestEntry(
            max(0.0, call["sent_at"] - t0),
            f"{turn['id']}-s{call['step']}-{i}",
            f"{sid}-{turn['id']}" if tid is None else sid,
            session["scenario"],
            "front",
            call["request"],
        )
        for i, (turn, call) in enumerate(calls)
    ]
    return [e.to_line() for e in sorted(entries, key=lambda e: e.t)]


async def manifest(request: web.Request) -> web.Response:
    store, sid = request.app[STATE].store, request.match_info["sid"]
    lines = manifest_lines(store, sid, request.query.get("turn") or None)
    return web.Response(
        text="".join(line + "\n" for line in lines),
        content_type="application/x-ndjson",
        headers={"Content-Disposition": f'attachment; filename="manifest-{sid}.jsonl"'},
    )


async def replay(request: web.Request) -> web.Response:
    """Replay a manifest (JSON lines in the body) against the proxy with its timing."""
    st = request.app[STATE]
    check_content_type(request, MANIFEST_TYPE)
    try:
        speed = float(request.query.get("speed", "1"))
        entries = sorted(
            (ManifestEntry.from_line(x) for x in (await request.text()).splitlines() if x.strip()),
            key=lambda e: e.t,
        )
    except (ValueError, KeyError, TypeError) as exc:
        return _error(400, f"not a manifest (JSON lines with t, id and body): {exc}")
    elsewhere = sorted({e.path for e in entries} - REPLAY_PATHS)
    if elsewhere:
        return _error(400, f"a replay only goes to the proxy's completion paths, not {elsewhere[0]!r}")
    if not entries or speed <= 0:
        return _error(400, "the manifest holds no requests" if not entries else "speed must be positive")
    started = time.monotonic()
    results = await replay_manifest(
        entries, base_url(st.config.llm_base_url), speed=speed, label="workbench replay"
    )
    return web.json_response(
        {"seconds": round(time.monotonic() - started, 3), "results": [r.to_json() for r in results]}
    )


async def proxy_info(request: web.Request) -> web.Response:
    """The proxy's health and its cache counters from /metrics."""
    st, base = request.app[STATE], base_url(request.app[STATE].config.llm_base_url)
    out: dict[str, Any] = {"url": base}
    assert st.http is not None
    timeout = aiohttp.ClientTimeout(total=5)
    try:
        async with st.http.get(base + "/health", timeout=timeout) as r:
            out["health"] = await r.json(content_type=None)
        async with st.http.get(base + "/metrics", timeout=timeout) as r:
            text = await r.text()
        out["metrics"] = [line for line in text.splitlines() if line.startswith(METRIC_PREFIXES)][:40]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return web.json_response(out)


async def _open(app: web.Application) -> None:
    app[STATE].http = aiohttp.ClientSession()


async def _close(app: web.Application) -> None:
    st = app[STATE]
    if st.http is not None:
        await st.http.close()
    st.store.close()


def build_workbench_app(config: WorkbenchConfig) -> web.Application:
    app = web.Application(
        middlewares=[host_guard(config.allowed_hosts), not_found_shape], client_max_size=16 << 20
    )
    app[STATE] = State(config, Store(config.db_path), build_graph())
    app.on_startup.append(_open)
    app.on_cleanup.append(_close)
    r = app.router
    r.add_get("/", index)
    r.add_static("/static", STATIC)
    r.add_get("/health", health)
    r.add_get("/api/scenarios", scenarios)
    r.add_get("/api/proxy", proxy_info)
    r.add_get("/api/sessions", list_sessions)
    r.add_post("/api/sessions", create_session)
    r.add_get("/api/sessions/{sid}", get_session)
    r.add_post("/api/sessions/{sid}/preview", preview)
    r.add_post("/api/sessions/{sid}/turns", send_turn)
    r.add_get("/api/sessions/{sid}/manifest", manifest)
    r.add_post("/api/replay", replay)
    return app
