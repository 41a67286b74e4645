"""What the bench commands share: their messages, output folders and the options of every command
that starts arms (the workloads, kvctl)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

import proxy.cli.options as options
from proxy.cli.options import model_option


@contextlib.contextmanager
def off_server_cpus(server_cpus: tuple[int, ...]) -> Iterator[None]:
    """With ``--server-cpus``: this thread, and so every proxy, balancer, store and client thread
    it starts, runs on the other CPUs until the arms are done (the servers set their own when
    they start, proxy/native/launch.py)."""
    if not server_cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, before - set(server_cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def say(message: str) -> None:
    click.echo(f"[bench] {message}", err=True)


def default_out(name: str) -> Path:
    return Path("bench-out") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError as exc:
        raise click.BadParameter(f"not a comma-separated list of token counts: {text}") from exc
    if not sizes or min(sizes) < 1:
        raise click.BadParameter("give at least one positive token count")
    return sizes


# ---- options of every command that starts arms (the workloads, kvctl) ---------------------------

out_option = click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Output directory (default: bench-out/WORKLOAD-TIMESTAMP).",
)
parallel_option = options.parallel_option()
ctx_size_option = options.ctx_size_option()
threads_option = options.threads_option(help="Threads per server (default: all cores).")
batch_size_option = click.option("--batch-size", "-b", default=2048, show_default=True)
ubatch_size_option = click.option("--ubatch-size", "-ub", default=512, show_default=True)
build_backend_option = options.build_backend_option()
gpu_layers_option = click.option(
    "--gpu-layers",
    "-ngl",
    "gpu_layers",
    type=int,
    default=0,
    show_default=True,
    envvar="RADIX_GPU_LAYERS",
    help="Layers every llama-server offloads to its GPU (-ngl; 99: all, with the KV cache). "
    "Build the server for the GPU with --build-backend.",
)

server_args_option = click.option(
    "--server-arg",
    "server_args",
    multiple=True,
    help="Extra llama-server argument for every arm's servers, stock and patched alike (repeatable; "
    "e.g. --server-arg=--model-draft --server-arg=DRAFT.gguf --server-arg=--spec-type "
    "--server-arg=draft-simple: the report then gives each arm's draft acceptance).",
)


def parse_cpus(text: str) -> tuple[int, ...]:
    """``0``, ``0,2`` or ``0-3``: CPU numbers, as taskset -c reads them (ASCII digits only, each
    below the machine's CPU count)."""
    cpus: set[int] = set()
    n_cpus = os.cpu_count() or 1
    for part in (p.strip() for p in text.split(",") if p.strip()):
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part)
        first, last = (int(m[1]), int(m[2] or m[1])) if m else (1, 0)
        if last < first or last >= n_cpus:
            raise click.BadParameter(f"not a CPU list like 0,2 or 0-3 of CPUs 0-{n_cpus - 1}: {text}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise click.BadParameter(f"not a CPU list like 0,2 or 0-3: {text}")
    return tuple(sorted(cpus))


server_cpus_option = click.option(
    "--server-cpus",
    "server_cpus",
    default=None,
    help="Run every llama-server of every arm on these CPUs (0,2 or 0-3) and everything else (the "
    "proxies, the balancer, the store, the clients) on the others, as on hosts of their own "
    "(default: all share every CPU; -t then defaults to their count).",
)

#: In the order ``--help`` lists them.
ARM_OPTIONS: tuple[Callable[[Any], Any], ...] = (
    out_option,
    model_option,
    parallel_option,
    ctx_size_option,
    threads_option,
    batch_size_option,
    ubatch_size_option,
    build_backend_option,
    gpu_layers_option,
    server_args_option,
    server_cpus_option,
)


def arm_settings(
    out_dir: Path,
    model_arg: str | None,
    n_parallel: int,
    ctx_size: int,
    threads: int | None,
    batch_size: int,
    ubatch_size: int,
    build_backend: str,
    gpu_layers: int = 0,
    server_args: tuple[str, ...] = (),
    server_cpus: str | None = None,
) -> Any:
    import os

    cpus = parse_cpus(server_cpus) if server_cpus is not None else ()
    if cpus:
        available = os.sched_getaffinity(0)
        if not set(cpus) <= available or not available - set(cpus):
            raise click.BadParameter(
                f"--server-cpus {server_cpus}: give some of the CPUs this runs on "
                f"({','.join(map(str, sorted(available)))}) and leave at least one for the rest"
            )

    from proxy.bench.arms import ArmSettings
    from proxy.native.modelref import resolve_model

    return ArmSettings(
        model=resolve_model(model_arg),
        log_dir=out_dir / "logs",
        n_parallel=n_parallel,
        ctx_size=ctx_size,
        threads=threads or len(cpus) or os.cpu_count() or 2,
        batch_size=batch_size,
        ubatch_size=ubatch_size,
        build_backend=build_backend,
        gpu_layers=gpu_layers,
        extra_args=tuple(server_args),
        server_cpus=cpus,
    )


MMPROJ_OPTION = click.option(
    "--mmproj",
    "mmproj",
    default="clip-vit-b-16",
    show_default=True,
    help="The projector every arm's servers load (--mmproj): a tower shape of `radixctl model mmproj "
    "--list` (random weights, written once for the model's width), or an mmproj GGUF file.",
)


def with_projector(settings: Any, ref: str) -> Any:
    """``settings`` with every server loading the projector ``ref`` names (a shape or a file)."""
    import dataclasses

    from proxy.errors import ConfigError
    from proxy.native.projectors import resolve_projector

    if any(arg in settings.extra_args for arg in ("--mmproj", "-mm", "--mmproj-url", "-mmu")):
        raise ConfigError(
            "a projector is given twice: --mmproj and --server-arg=--mmproj",
            fix="pass the projector once, with --mmproj SHAPE|FILE",
        )
    path = resolve_projector(ref, settings.model)
    return dataclasses.replace(settings, extra_args=(*settings.extra_args, "--mmproj", str(path)))
