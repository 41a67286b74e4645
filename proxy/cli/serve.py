"""``radixctl serve`` and ``radixctl up``: the proxy as a process (signals, logging, server)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from proxy.cli.common import fail_cleanly
from proxy.cli.options import (
    BUILD_BACKENDS,
    admin_key_option,
    admin_show_text_option,
    cache_info_option,
    cache_isolation_option,
    cache_ram_option,
    host_option,
    kv_share_cells_option,
    kv_share_headroom_option,
    kv_share_max_entries_option,
    kv_share_min_tokens_option,
    kv_share_option,
    kv_share_route_option,
    kvctl_key_option,
    log_level_option,
    max_body_option,
    min_restore_tokens_option,
    model_option,
    port_option,
    record_option,
    shm_dir_option,
)
from proxy.config import Config
from proxy.native.build import BuildSpec, build_server
from proxy.native.fetch import cache_root, say
from proxy.native.launch import ServerProcess, ServerSpec, check_port_free, free_port
from proxy.native.model import resolve_model
from proxy.server.app import RUNTIME, build_app, start_site
from proxy.server.runtime import Runtime


def _config(backends: tuple[str, ...], **kw: Any) -> Config:
    return Config(backends=backends, tokenizer_cache=cache_root() / "tokenizers", **kw)


@click.command()
@click.option("--backend-url", "backends", multiple=True, required=True, envvar="RADIX_BACKENDS",
              help="Patched llama-server base URL (repeatable; env: space-separated).")
@host_option
@port_option
@cache_ram_option
@shm_dir_option
@min_restore_tokens_option
@kvctl_key_option
@kv_share_option
@kv_share_min_tokens_option
@kv_share_max_entries_option
@kv_share_cells_option
@kv_share_headroom_option
@kv_share_route_option
@admin_key_option
@admin_show_text_option
@cache_isolation_option
@cache_info_option
@max_body_option
@record_option
@log_level_option
@fail_cleanly
def serve(backends: tuple[str, ...], **kw: Any) -> None:
    """Run the proxy in front of already running patched llama-servers."""
    asyncio.run(serve_forever(_config(backends, **kw)))


@click.command()
@model_option
@click.option("--server-port", type=int, default=0, envvar="RADIX_SERVER_PORT",
              help="llama-server port (0: a free one).")
@click.option("--parallel", "-np", "n_parallel", default=4, show_default=True, envvar="RADIX_PARALLEL")
@click.option("--ctx-size", "-c", default=16384, show_default=True, envvar="RADIX_CTX_SIZE",
              help="Total KV pool in tokens (shared by all slots).")
@click.option("--threads", "-t", type=int, default=None, envvar="RADIX_THREADS")
@click.option("--build-backend", type=click.Choice(BUILD_BACKENDS), default="cpu", show_default=True,
              envvar="RADIX_BUILD_BACKEND")
@click.option("--server-arg", "server_args", multiple=True, help="Extra llama-server argument (repeatable).")
@host_option
@port_option
@cache_ram_option
@shm_dir_option
@min_restore_tokens_option
@kvctl_key_option
@kv_share_option
@kv_share_min_tokens_option
@kv_share_max_entries_option
@kv_share_cells_option
@kv_share_headroom_option
@kv_share_route_option
@admin_key_option
@admin_show_text_option
@cache_isolation_option
@cache_info_option
@max_body_option
@record_option
@log_level_option
@fail_cleanly
def up(model_arg: str | None, server_port: int, n_parallel: int, ctx_size: int, threads: int | None,
       build_backend: str, server_args: tuple[str, ...], **kw: Any) -> None:
    """Build and fetch what is missing, start llama-server and the proxy, serve until Ctrl-C."""
    up_forever(model_arg=model_arg, server_port=server_port, n_parallel=n_parallel, ctx_size=ctx_size,
           threads=threads, build_backend=build_backend, server_args=server_args, proxy_kw=kw)


async def serve_forever(config: Config, on_ready: Callable[[Runtime], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM; the app's cleanup closes everything it opened."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config)
    runner = await start_site(app, config.host, config.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        if on_ready is not None:
            on_ready(app[RUNTIME])
        await stop.wait()
    finally:
        await runner.cleanup()


def up_forever(*, model_arg: str | None, server_port: int, n_parallel: int, ctx_size: int, threads: int | None,
               build_backend: str, server_args: tuple[str, ...], proxy_kw: dict[str, Any]) -> None:
    host, port = proxy_kw["host"], proxy_kw["port"]
    check_port_free(host, port, "proxy")
    model = resolve_model(model_arg)
    binary = build_server(BuildSpec(variant="patched", backend=build_backend))
    shm_dir = proxy_kw.pop("shm_dir", None) or _default_shm_dir(port)
    # A /kvctl key per run unless one was given: to the server in a 0600 file, to the proxy in memory.
    if not proxy_kw.get("kvctl_key"):
        proxy_kw["kvctl_key"] = secrets.token_urlsafe(32)
    spec = ServerSpec(binary=binary, model=model, port=server_port or free_port(), n_parallel=n_parallel,
                      ctx_size=ctx_size, threads=threads, kvctl_dir=shm_dir, kvctl_key=proxy_kw.get("kvctl_key"),
                      extra_args=server_args)
    server = ServerProcess(spec, cache_root() / "logs" / f"llama-server-{spec.port}.log")
    say(f"starting llama-server on {spec.url} (log: {server.log_path})")
    server.start()
    config = Config(backends=(spec.url,), shm_dir=shm_dir, tokenizer_cache=cache_root() / "tokenizers", **proxy_kw)

    def ready(runtime: Runtime) -> None:
        base = f"http://{config.host}:{config.port}/v1"
        say(f"proxy ready. OpenAI base URL: {base}   (tokenizer: {runtime.tokenizer_note})")
        say("try:\n  curl " + base + "/chat/completions -H 'Content-Type: application/json' \\\n"
            "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Say hello\"}], \"max_tokens\": 32}'")

    try:
        asyncio.run(serve_forever(config, on_ready=ready))
    except KeyboardInterrupt:
        pass
    finally:
        say("stopping llama-server")
        server.stop()
        with contextlib.suppress(OSError):
            for leftover in shm_dir.glob("radix-*.kv"):
                leftover.unlink()
            shm_dir.rmdir()


def _default_shm_dir(port: int) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"radix-{os.getuid()}-{port}"

