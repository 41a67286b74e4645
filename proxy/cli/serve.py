"""``radixctl serve`` and ``radixctl up``: the proxy as a process (signals, logging, server)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from proxy.cli.common import fail_cleanly
from proxy.config import Config
from proxy.native.build import BuildSpec, build_server
from proxy.native.fetch import cache_root, say
from proxy.native.launch import ServerProcess, ServerSpec, check_port_free, free_port
from proxy.native.model import resolve_model
from proxy.server.app import RUNTIME, build_app, start_site
from proxy.server.runtime import Runtime


def _proxy_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--host", default="127.0.0.1", show_default=True, envvar="RADIX_HOST",
                     help="Address the proxy listens on."),
        click.option("--port", default=8080, show_default=True, envvar="RADIX_PORT", help="Proxy port."),
        click.option("--cache-ram", "cache_ram_mib", default=4096, show_default=True, envvar="RADIX_CACHE_RAM",
                     help="Host radix tree budget in MiB (payload plus metadata)."),
        click.option("--shm-dir", type=click.Path(file_okay=False, path_type=Path), envvar="RADIX_SHM_DIR",
                     help="Shared-memory directory for KV payload files (same host as the server)."),
        click.option("--min-restore-tokens", default=64, show_default=True, envvar="RADIX_MIN_RESTORE_TOKENS",
                     help="A host restore shorter than this is prefilled instead."),
        click.option("--kvctl-key", envvar="RADIX_KVCTL_KEY", help="Key for the servers' /kvctl API."),
        click.option("--cache-kv-share", "kv_share", type=click.Choice(["on", "off"]), default="off",
                     show_default=True, envvar="RADIX_CACHE_KV_SHARE", callback=lambda c, p, v: v == "on",
                     help="Resident KV sharing (route S): prefixes held once in the server's pool."),
        click.option("--cache-kv-share-min-tokens", "kv_share_min_tokens", default=32, show_default=True,
                     envvar="RADIX_CACHE_KV_SHARE_MIN_TOKENS", help="Shortest prefix recorded or attached."),
        click.option("--cache-kv-share-max-entries", "kv_share_max_entries", default=0, show_default=True,
                     envvar="RADIX_CACHE_KV_SHARE_MAX_ENTRIES", help="Resident entries (0: min(64, owner ids))."),
        click.option("--cache-kv-share-cells", "kv_share_cells", default=0, show_default=True,
                     envvar="RADIX_CACHE_KV_SHARE_CELLS", help="Owner cell budget B (0: half the pool)."),
        click.option("--cache-kv-share-headroom", "kv_share_headroom", default=0, show_default=True,
                     envvar="RADIX_CACHE_KV_SHARE_HEADROOM",
                     help="Free cells R kept for requests (0: min(n_ubatch, max(1, pool/8)))."),
        click.option("--cache-kv-share-route", "kv_share_route", type=click.Choice(["longest", "share"]),
                     default="longest", show_default=True, envvar="RADIX_CACHE_KV_SHARE_ROUTE",
                     help="longest: longest executable prefix (ties A > S > H); share: A or S first."),
        click.option("--admin-key", envvar="RADIX_ADMIN_KEY", help="Key for the proxy's /radix admin API."),
        click.option("--record", "record_path", type=click.Path(dir_okay=False, path_type=Path),
                     envvar="RADIX_RECORD",
                     help="Append every completion request to this manifest (replay: radixctl bench replay)."),
        click.option("--log-level", default="info", show_default=True, envvar="RADIX_LOG_LEVEL",
                     type=click.Choice(["debug", "info", "warning", "error"])),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _config(backends: tuple[str, ...], **kw: Any) -> Config:
    return Config(backends=backends, tokenizer_cache=cache_root() / "tokenizers", **kw)


@click.command()
@click.option("--backend-url", "backends", multiple=True, required=True, envvar="RADIX_BACKENDS",
              help="Patched llama-server base URL (repeatable; env: space-separated).")
@_proxy_options
@fail_cleanly
def serve(backends: tuple[str, ...], **kw: Any) -> None:
    """Run the proxy in front of already running patched llama-servers."""
    asyncio.run(serve_forever(_config(backends, **kw)))


@click.command()
@click.option("--model", "-m", "model_arg", default=None, envvar="RADIX_MODEL",
              help="GGUF path (default: SmolLM2-135M-Instruct from its wheel).")
@click.option("--server-port", type=int, default=0, envvar="RADIX_SERVER_PORT",
              help="llama-server port (0: a free one).")
@click.option("--parallel", "-np", "n_parallel", default=4, show_default=True, envvar="RADIX_PARALLEL")
@click.option("--ctx-size", "-c", default=16384, show_default=True, envvar="RADIX_CTX_SIZE",
              help="Total KV pool in tokens (shared by all slots).")
@click.option("--threads", "-t", type=int, default=None, envvar="RADIX_THREADS")
@click.option("--build-backend", type=click.Choice(["cpu", "cuda", "cann", "metal", "vulkan"]), default="cpu",
              show_default=True, envvar="RADIX_BUILD_BACKEND")
@click.option("--server-arg", "server_args", multiple=True, help="Extra llama-server argument (repeatable).")
@_proxy_options
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


def register(main: click.Group) -> None:
    main.add_command(serve)
    main.add_command(up)
