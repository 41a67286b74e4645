"""The bench commands that are not workloads: ``kvctl`` (the mover against memcpy), ``replay``,
``soak`` and ``report`` (a run's report written again from its results)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import click

import proxy.cli.options as options
from proxy.bench.cli_options import (
    arm_settings,
    batch_size_option,
    build_backend_option,
    ctx_size_option,
    default_out,
    gpu_layers_option,
    out_option,
    parallel_option,
    parse_sizes,
    say,
    threads_option,
    ubatch_size_option,
)
from proxy.cli.common import fail_cleanly
from proxy.cli.options import model_option
from proxy.config import Config
from proxy.errors import ConfigError


@click.command("kvctl")
@out_option
@model_option
@parallel_option
@ctx_size_option
@threads_option
@batch_size_option
@ubatch_size_option
@build_backend_option
@gpu_layers_option
@click.option("--sizes", default="512,2048,8192", show_default=True, help="Token counts to move.")
@click.option("--reps", default=5, show_default=True, help="Repetitions per size and direction.")
@click.option("--no-probe", is_flag=True, help="Do not time a tiny generation during the moves.")
@click.option(
    "--transport",
    type=click.Choice(["arena", "shared", "inline", "both", "all"]),
    default="arena",
    show_default=True,
    help="Moves through the KV arena (one copy, the proxy's default), shared-memory payload "
    "files (--kv-arena off), inline over HTTP (msgpack binary, as across hosts); both: files "
    "and inline side by side; all: the three.",
)
@click.option(
    "--arena-chunk",
    type=click.IntRange(0, 65536),
    default=Config.kv_arena_chunk,
    show_default=True,
    help="Tokens per arena block (--kv-arena-chunk; 0: about 16 MiB of KV) for the arena transport.",
)
@fail_cleanly
def kvctl(
    out_dir: Path | None,
    model_arg: str | None,
    n_parallel: int,
    ctx_size: int,
    threads: int | None,
    batch_size: int,
    ubatch_size: int,
    build_backend: str,
    gpu_layers: int,
    sizes: str,
    reps: int,
    no_probe: bool,
    transport: str,
    arena_chunk: int,
) -> None:
    """KV export/import throughput through the proxy's mover against a numpy memcpy, and main-loop stalls."""
    from proxy.bench.arms import patched_server
    from proxy.bench.kvbench import kvctl_ctx_size, run_kvctl_bench
    from proxy.bench.report import write_report

    token_sizes = parse_sizes(sizes)
    out = out_dir or default_out("kvctl")
    settings = arm_settings(
        out,
        model_arg,
        max(n_parallel, 4),
        ctx_size,
        threads,
        batch_size,
        ubatch_size,
        build_backend,
        gpu_layers,
    )
    kinds = {"both": ["shared", "inline"], "all": ["arena", "shared", "inline"]}.get(transport, [transport])
    reports: dict[str, dict[str, Any]] = {}
    with patched_server(settings, max(ctx_size, kvctl_ctx_size(token_sizes))) as (server, shm):
        from proxy.bench.transport import warm_slot0

        asyncio.run(warm_slot0(server.url, max(token_sizes)))
        for kind in kinds:
            reports[kind] = asyncio.run(
                run_kvctl_bench(
                    server.url,
                    shm if kind in ("arena", "shared") else None,
                    token_sizes,
                    reps,
                    not no_probe,
                    say,
                    kvctl_key=server.spec.kvctl_key,
                    arena=kind == "arena",
                    chunk_tokens=arena_chunk,
                )
            )
    for kind, report in reports.items():
        where = out / kind if len(reports) > 1 else out
        for path in write_report(report, where):
            say(f"wrote {path}")
        click.echo((where / "report.md").read_text())
    if "shared" in reports and "inline" in reports:
        from proxy.bench.transport import transport_table

        table, rows = transport_table(reports["shared"], reports["inline"])
        (out / "transport.md").write_text(table)
        (out / "transport.json").write_text(json.dumps(rows, indent=2))
        click.echo(table)


@click.command("replay")
@click.argument("manifest", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--url", required=True, help="OpenAI base URL (with or without /v1).")
@click.option("--speed", default=1.0, show_default=True, help="Time scale: 2 sends twice as fast.")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write results and a report here.",
)
@fail_cleanly
def replay(manifest: Path, url: str, speed: float, out_dir: Path | None) -> None:
    """Replay a manifest (manifest-ARM.jsonl of a run) against any OpenAI URL with its original timing."""
    from proxy.bench.report import build_report, render_markdown, write_report
    from proxy.traffic.runner import read_manifest, replay_manifest, write_results

    if speed <= 0:
        raise ConfigError("--speed must be positive", fix="pass e.g. --speed 1")
    entries = read_manifest(manifest)
    if not entries:
        raise ConfigError(
            f"{manifest} holds no requests", fix="pass a manifest-ARM.jsonl written by a bench run"
        )
    say(f"replaying {len(entries)} requests over {entries[-1].t / speed:.1f} s against {url}")
    results = asyncio.run(replay_manifest(entries, url, speed=speed))
    report = build_report(
        {"name": f"replay of {manifest.name}", "description": f"against {url}", "params": {"speed": speed}},
        {"replay": {"results": results, "stats": {}}},
    )
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_results(out_dir / "results-replay.jsonl", results)
        for path in write_report(report, out_dir, charts=False):
            say(f"wrote {path}")
    click.echo(render_markdown(report))


@click.command("soak")
@out_option
@click.option("--minutes", default=30.0, show_default=True, help="How long to run.")
@click.option(
    "--kill-every", "kill_every", default=5.0, show_default=True, help="Minutes between server kills."
)
@click.option("--sessions", default=1, show_default=True, help="Agent sessions per scenario.")
@click.option("--system-tokens", default=800, show_default=True, help="System prompt size of each scenario.")
@click.option("--max-tokens", default=32, show_default=True, help="Answer length.")
@options.threads_option(default=2, show_default=True, help="llama-server threads.")
@ctx_size_option
@fail_cleanly
def soak(
    out_dir: Path | None,
    minutes: float,
    kill_every: float,
    sessions: int,
    system_tokens: int,
    max_tokens: int,
    threads: int,
    ctx_size: int,
) -> None:
    """The agents workload against `radixctl up` with llama-server killed every few minutes:
    answered/failed, TTFT between kills, seconds until cache hits again, proxy RSS over time."""
    from proxy.bench.soak import run_soak

    out = out_dir or default_out("soak")
    report = run_soak(
        out, minutes, kill_every, sessions, system_tokens, max_tokens, threads, ctx_size, say=say
    )
    say(f"wrote {out / 'report.json'}")
    shown = {k: v for k, v in report.items() if k != "rss_samples"}
    click.echo(json.dumps(shown, indent=1))


@click.command("report")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
@fail_cleanly
def report(run_dir: Path) -> None:
    """Write a workload run's report.json and report.md again from its results-ARM.jsonl files (the
    report of today's code over an older run's requests; nothing is run)."""
    from proxy.bench.report import rebuild_report, write_report

    rebuilt = rebuild_report(run_dir)
    for path in write_report(rebuilt, run_dir):
        say(f"wrote {path}")
    click.echo((run_dir / "report.md").read_text())
