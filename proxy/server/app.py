"""The composition root: one function builds the whole proxy app from a config.

``build_app`` is what ``radixctl serve``, ``radixctl up`` and the tests run. The
application's ``cleanup_ctx`` owns every long-lived resource, in order: the HTTP client
session, the request recorder, the runtime (servers connected and checked, coordinator,
tokenizer) and the periodic summary line. aiohttp opens them on startup and closes them
in reverse order on cleanup, on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.config import Config
from proxy.errors import BackendError, ConfigError, RadixError, RequestTimeout, TooLarge
from proxy.server.api.agents import add_api_routes
from proxy.server.api.embeddings import add_embedding_routes
from proxy.server.api.infill import add_infill_routes
from proxy.server.api.routes import add_catch_all, add_routes, metrics_port_only, plain_paths_only
from proxy.server.http.connections import ConnectionLimits, GuardedSite, raise_file_limit
from proxy.server.http.recorder import Recorder
from proxy.server.ops.admin import add_admin_routes
from proxy.server.ops.health import HealthMonitor
from proxy.server.ops.observe import summary_loop
from proxy.server.ops.runtime import RUNTIME, Runtime
from proxy.server.ops.startup import connect_pending, create_runtime

log = logging.getLogger("radix")

CONFIG: web.AppKey[Config] = web.AppKey("config", Config)
REGISTRY: web.AppKey[CollectorRegistry] = web.AppKey("registry", CollectorRegistry)
SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)
RECORDER: web.AppKey[Recorder | None] = web.AppKey("recorder")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(exc: RadixError) -> web.Response:
    """The one renderer: llama-server's error shape."""
    headers = {"Retry-After": f"{exc.retry_after_s:.0f}"} if exc.retry_after_s is not None else None
    return web.Response(
        body=orjson.dumps(exc.to_body()), status=exc.status, content_type="application/json", headers=headers
    )


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RadixError as exc:
        runtime: Runtime | None = request.app.get(RUNTIME)
        if runtime is not None:
            runtime.metrics.request_errors.labels("4xx" if exc.status < 500 else "5xx").inc()
        response = error_response(exc)
        if isinstance(exc, RequestTimeout):
            # Sent now and the connection closed: aiohttp would otherwise keep reading the rest of
            # a body that comes too slowly (its lingering close) before it lets go.
            response.force_close()
            await response.prepare(request)
            await response.write_eof()
            if request.transport is not None:
                request.transport.close()
        return response
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(TooLarge(f"request body too large: {exc.text}"))
    except web.HTTPException:
        raise
    except aiohttp.ClientError as exc:
        return error_response(BackendError(f"llama-server unreachable: {exc}"))


def build_app(config: Config, registry: CollectorRegistry | None = None) -> web.Application:
    """The proxy as an aiohttp application; its resources open when a runner sets it up."""
    app = web.Application(
        middlewares=[errors_middleware, plain_paths_only, metrics_port_only],
        client_max_size=config.max_body_mib * 1024 * 1024,
    )
    app[CONFIG] = config
    app[REGISTRY] = registry if registry is not None else CollectorRegistry()
    app.cleanup_ctx.extend([_session_ctx, _recorder_ctx, _runtime_ctx, _health_ctx, _summary_ctx])
    add_routes(app)
    add_api_routes(app)
    add_infill_routes(app)
    add_embedding_routes(app)
    add_admin_routes(app)
    add_catch_all(app)
    return app


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
    )
    app[SESSION] = session
    try:
        yield
    finally:
        await session.close()


async def _recorder_ctx(app: web.Application) -> AsyncIterator[None]:
    path = app[CONFIG].record_path
    recorder = Recorder(path) if path is not None else None
    app[RECORDER] = recorder
    try:
        yield
    finally:
        if recorder is not None:
            recorder.close()


async def _runtime_ctx(app: web.Application) -> AsyncIterator[None]:
    runtime = await create_runtime(app[CONFIG], app[SESSION], app[REGISTRY], app[RECORDER])
    app[RUNTIME] = runtime
    try:
        yield
    finally:
        # Saves end by themselves (each under finish_timeout_s); this bounds the wait for all.
        if not await runtime.drain(app[CONFIG].finish_timeout_s + 5):
            log.warning("shutdown: background saves still running after the deadline were abandoned")
        for server in runtime.coordinator.servers:
            server.mover.close()  # the idle import payload file
        disk = runtime.coordinator.disk
        written = True
        if disk is not None:  # what RAM holds goes to disk too, so a restart is warm
            written = await disk.close(runtime.coordinator.tree, app[CONFIG].cache_disk_timeout_s)
        remote = runtime.coordinator.remote
        if remote is not None:  # its queue holds copies: bounded by its deadline, then dropped
            await remote.close(app[CONFIG].cache_remote_timeout_s)
        if runtime.arena is not None:  # after the disk tier wrote what the tree held from it
            runtime.coordinator.tree.clear()  # its segments view the arena: let them go first
            runtime.arena.close(give_back=written)  # a write still running must not read zeros


async def _health_ctx(app: web.Application) -> AsyncIterator[None]:
    runtime, config = app[RUNTIME], app[CONFIG]
    runtime.health = HealthMonitor(
        runtime.coordinator,
        config.health_interval_s,
        config.health_timeout_s,
        connect_pending=lambda: connect_pending(runtime),
    )
    task = asyncio.get_running_loop().create_task(runtime.health.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _summary_ctx(app: web.Application) -> AsyncIterator[None]:
    # Its own task, cancelled on cleanup: drain() waits for spawned tasks, and this never ends.
    task = asyncio.get_running_loop().create_task(summary_loop(app[RUNTIME], app[CONFIG].summary_interval_s))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def start_site(
    app: web.Application, host: str, port: int, shutdown_timeout: float = 60.0
) -> web.AppRunner:
    """Open the app's resources and listen; the caller owns ``runner.cleanup()``, which stops
    listening, gives in-flight requests ``shutdown_timeout`` seconds, then closes everything."""
    config = app[CONFIG]
    # aiohttp's keep-alive timer runs from the connection's start and from each answer's end, and
    # closes a connection whose next request head is not complete by then: an idle timeout and a
    # header read deadline in one (its default is an hour).
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout,
        keepalive_timeout=config.idle_timeout_s,
    )
    try:
        await runner.setup()
    except BaseException:
        await runner.cleanup()  # closes what the startup contexts opened before the failure
        raise
    raise_file_limit(config.max_connections)
    limits = ConnectionLimits(config.max_connections, config.max_connections_per_client)
    for listen, flag in ((port, "--port"), (config.metrics_port, "--metrics-port")):
        if flag == "--metrics-port" and not listen:
            continue
        try:
            await GuardedSite(runner, host, listen, limits).start()
        except OSError as exc:
            await runner.cleanup()
            raise ConfigError(
                f"cannot listen on {host}:{listen}: {exc.strerror}",
                fix=f"choose another {flag}, or stop what listens there",
            ) from exc
    return runner


__all__ = ["CONFIG", "RUNTIME", "build_app", "error_response", "start_site"]
