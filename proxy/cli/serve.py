"""``radixctl serve`` and ``radixctl up``: the proxy as a process (signals, logging, server)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import click

from proxy.cli.common import fail_cleanly
from proxy.cli.options import (
    build_backend_option,
    ctx_size_option,
    model_option,
    parallel_option,
    proxy_options,
    take_kvctl_key_file,
    threads_option,
)
from proxy.config import Config
from proxy.errors import ConfigError, RadixError
from proxy.native.build import build_server, spec_for
from proxy.native.fetch import cache_root, say
from proxy.native.launch import ServerProcess, ServerSpec, check_port_free, free_port
from proxy.native.modelref import resolve_model
from proxy.server.app import RUNTIME, build_app, start_site
from proxy.server.dataplane.arena import sweep_stale_arenas
from proxy.server.dataplane.paydir import check_private_dir, make_private_dir, remove_payloads
from proxy.server.ops import eventloop
from proxy.server.ops.runtime import Runtime


def _config(backends: tuple[str, ...], **kw: Any) -> Config:
    return Config(backends=backends, tokenizer_cache=cache_root() / "tokenizers", **kw)


log = logging.getLogger("radix")


@click.command()
@click.option(
    "--backend-url",
    "backends",
    multiple=True,
    required=True,
    envvar="RADIX_BACKENDS",
    help="Patched llama-server: [MODEL=]URL[#auto|#shared|#inline] (repeatable; env: space-separated; "
    "see docs/routing.md).",
)
@proxy_options
@fail_cleanly
def serve(backends: tuple[str, ...], **kw: Any) -> None:
    """Run the proxy in front of already running patched llama-servers."""
    take_kvctl_key_file(kw)
    config = _config(backends, **kw)
    eventloop.run(serve_forever(config), config.event_loop)


@click.command()
@model_option
@click.option(
    "--server-port",
    type=int,
    default=0,
    envvar="RADIX_SERVER_PORT",
    help="llama-server port (0: a free one).",
)
@parallel_option(envvar="RADIX_PARALLEL")
@ctx_size_option(envvar="RADIX_CTX_SIZE")
@threads_option(envvar="RADIX_THREADS", help="Threads of llama-server (default: llama-server's own).")
@build_backend_option(envvar="RADIX_BUILD_BACKEND")
@click.option("--server-arg", "server_args", multiple=True, help="Extra llama-server argument (repeatable).")
@proxy_options
@fail_cleanly
def up(
    model_arg: str | None,
    server_port: int,
    n_parallel: int,
    ctx_size: int,
    threads: int | None,
    build_backend: str,
    server_args: tuple[str, ...],
    **kw: Any,
) -> None:
    """Build and fetch what is missing, start llama-server and the proxy, serve until Ctrl-C."""
    take_kvctl_key_file(kw)
    up_forever(
        model_arg=model_arg,
        server_port=server_port,
        n_parallel=n_parallel,
        ctx_size=ctx_size,
        threads=threads,
        build_backend=build_backend,
        server_args=server_args,
        proxy_kw=kw,
    )


async def serve_forever(
    config: Config,
    on_ready: Callable[[Runtime], None] | None = None,
    background: Callable[[], Coroutine[Any, Any, None]] | None = None,
    on_force: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM. The first signal stops taking requests (queued ones get
    503 at once), gives in-flight ones ``--shutdown-grace`` seconds, then the app's cleanup
    drains the saves (bounded) and closes everything; a second signal exits at once."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log.info("event loop: %s", eventloop.loop_name(asyncio.get_running_loop()))
    app = build_app(config)
    runner = await start_site(app, config.host, config.port, shutdown_timeout=config.shutdown_grace_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            log.warning("second signal: exiting now")
            if on_force is not None:
                on_force()
            os._exit(130)
        log.info(
            "shutting down: no new requests; in-flight ones get %g s (a second signal exits now)",
            config.shutdown_grace_s,
        )
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    task = loop.create_task(background()) if background is not None else None
    try:
        if on_ready is not None:
            on_ready(app[RUNTIME])
        await stop.wait()
    finally:
        app[RUNTIME].coordinator.close()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await runner.cleanup()


def up_forever(
    *,
    model_arg: str | None,
    server_port: int,
    n_parallel: int,
    ctx_size: int,
    threads: int | None,
    build_backend: str,
    server_args: tuple[str, ...],
    proxy_kw: dict[str, Any],
) -> None:
    host, port = proxy_kw["host"], proxy_kw["port"]
    check_port_free(host, port, "proxy")
    model = resolve_model(model_arg)
    binary = build_server(spec_for("patched", build_backend))
    shm_dir = _payload_dir(proxy_kw.pop("shm_dir", None), port)
    remove_payloads(shm_dir)  # left by an earlier run that was killed
    # A /kvctl key and an API key per run unless given: to the server in 0600 files, to the proxy
    # in memory. With the API key only the proxy can use the server's port (docs/security.md).
    for key in ("kvctl_key", "server_api_key"):
        if not proxy_kw.get(key):
            proxy_kw[key] = secrets.token_urlsafe(32)
    spec = ServerSpec(
        binary=binary,
        model=model,
        port=server_port or free_port(),
        n_parallel=n_parallel,
        ctx_size=ctx_size,
        threads=threads,
        kvctl_dir=shm_dir,
        kvctl_key=proxy_kw.get("kvctl_key"),
        api_key=proxy_kw.get("server_api_key"),
        extra_args=server_args,
    )
    server = ServerProcess(spec, cache_root() / "logs" / f"llama-server-{spec.port}.log")
    say(f"starting llama-server on {spec.url} (log: {server.log_path})")
    try:
        _start_server(server)
    except BaseException:
        _remove_payload_dir(shm_dir)  # made for this run: nothing else will remove it
        raise
    config = Config(
        backends=(spec.url,), shm_dir=shm_dir, tokenizer_cache=cache_root() / "tokenizers", **proxy_kw
    )

    def ready(runtime: Runtime) -> None:
        base = f"http://{config.host}:{config.port}/v1"
        say(
            f"proxy ready. OpenAI base URL: {base}   (tokenizer: {runtime.tokenizer_note}, "
            f"chat template: {runtime.template_note})"
        )
        for line in moves_off_lines(runtime):
            say(line)
        say(
            "try:\n  curl " + base + "/chat/completions -H 'Content-Type: application/json' \\\n"
            '    -d \'{"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 32}\''
        )

    try:
        eventloop.run(
            serve_forever(
                config,
                on_ready=ready,
                background=lambda: supervise(server),
                on_force=lambda: server.stop(grace=0),
            ),
            config.event_loop,
        )
    except KeyboardInterrupt:
        pass
    finally:
        say("stopping llama-server")
        server.stop()
        _remove_payload_dir(shm_dir)


def moves_off_lines(runtime: Runtime) -> list[str]:
    """One line per server served without KV moves: why, and which routes it still gets."""
    lines = []
    for server in runtime.coordinator.servers:
        if not server.moves_off:
            if server.media_fixed:
                lines.append(
                    f"{server.name}: media served without moves (the text before it moves; route A "
                    f"reuses media on its slot): {server.media_fixed}"
                )
            continue
        routes = (
            "routes A, prefill and H from whole-state checkpoints"
            if server.checkpoints
            else "routes A and prefill only"
        )
        lines.append(f"{server.name}: served without KV moves ({routes}): {'; '.join(server.moves_off)}")
    return lines


def _start_server(server: ServerProcess) -> None:
    """Start it, or say in one line why it refused (not the whole log)."""
    try:
        server.start()
    except ConfigError as exc:
        if server.startup_exit is None:  # it did not exit (too slow): the whole message helps
            raise
        why, fix = server.startup_refusal()
        raise ConfigError(why, fix=fix) from exc


def _remove_payload_dir(shm_dir: Path) -> None:
    remove_payloads(shm_dir)
    with contextlib.suppress(OSError):
        shm_dir.rmdir()


async def supervise(server: ServerProcess, poll_s: float = 0.5, max_backoff_s: float = 30.0) -> None:
    """Restart llama-server when it exits, with exponential backoff; the proxy's health monitor
    takes it out of routing meanwhile and resets its state when it is back."""
    backoff = 1.0
    while True:
        await asyncio.sleep(poll_s)
        if server.alive():
            continue
        code = server.proc.returncode if server.proc is not None else None
        log.error(
            "llama-server exited (code %s); restarting in %.0f s. Log tail:\n%s",
            code,
            backoff,
            server.log_tail(10),
        )
        await asyncio.sleep(backoff)
        try:
            server.spawn()  # in the loop's (main) thread: the child's death signal follows this thread
            await _until_healthy(server, 180.0)
        except RadixError as exc:
            log.error("llama-server did not come back: %s", exc.message)
            server.stop(grace=2)
            backoff = min(backoff * 2, max_backoff_s)
            continue
        log.warning("llama-server is back on %s", server.url)
        backoff = 1.0


async def _until_healthy(server: ServerProcess, timeout_s: float) -> None:
    """Wait for the restarted server, cancellably (each probe is one short call in a thread)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await asyncio.to_thread(server.health_ok):
        if not server.alive():
            raise ConfigError(f"llama-server exited during startup:\n{server.log_tail()}")
        if loop.time() > deadline:
            raise ConfigError(f"llama-server did not become healthy within {timeout_s:.0f} s")
        await asyncio.sleep(0.5)
    server.ready()


def _payload_dir(given: Path | None, port: int) -> Path:
    """The operator's --shm-dir (created 0700 if missing), or a new one of ours; either checked
    (proxy/server/dataplane/paydir.py)."""
    if given is None:
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        sweep_stale_arenas(base, f"radix-{os.getuid()}-")  # killed runs' arenas, each --cache-ram
        return make_private_dir(base, f"radix-{os.getuid()}-{port}-")
    with contextlib.suppress(FileExistsError):
        given.mkdir(mode=0o700, parents=True)
    check_private_dir(given)
    return given
