"""``radixctl bench WORKLOAD`` and ``radixctl bench replay MANIFEST --url URL``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import click

import proxy.cli.options as options
from proxy.bench.capacity import DEFAULT_PROBE_TIMEOUT_S, DEFAULT_STEP, DEFAULT_UPPER_FACTOR
from proxy.bench.workloads import DEFAULT_ARMS, GENERATORS, make_workload
from proxy.cli.common import fail_cleanly
from proxy.cli.options import model_option
from proxy.config import Config
from proxy.errors import ConfigError
from proxy.traffic.spec import Workload

ALL_ARMS = ("nocache", "legacy", "proxy")


def _say(message: str) -> None:
    click.echo(f"[bench] {message}", err=True)


def _default_out(name: str) -> Path:
    return Path("bench-out") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _sizes(text: str) -> tuple[int, ...]:
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
)

# ---- options of the workload commands ----------------------------------------------------------

dry_run_option = click.option("--dry-run", is_flag=True, help="Only write the request list (workload.jsonl).")

#: The pool-size search of ``radixctl bench capacity``.
CAPACITY_OPTIONS = (
    click.option(
        "--step",
        type=int,
        default=DEFAULT_STEP,
        show_default=True,
        help="Grid of pool sizes (-c) searched, in cells.",
    ),
    click.option(
        "--upper-factor",
        type=float,
        default=DEFAULT_UPPER_FACTOR,
        show_default=True,
        help="Largest pool tried, as a multiple of the lower bound (one prompt plus generation).",
    ),
    click.option(
        "--probe-timeout",
        "probe_timeout_s",
        type=float,
        default=DEFAULT_PROBE_TIMEOUT_S,
        show_default=True,
        help="Seconds a request of a probe may take.",
    ),
    click.option(
        "--min-together",
        type=int,
        default=None,
        help="Requests that must be in the server at once for 'served together' "
        "[default: prompts - 1; 0: any order counts].",
    ),
)

_SIZE_OPTIONS: dict[str, tuple[str, str]] = {
    "prompt_tokens": ("--prompt-tokens", "Approximate prompt size in tokens."),
    "rounds": ("--rounds", "Rounds."),
    "prompts": (
        "--prompts",
        "Prompts per tier (prefix-tiers), in all (host-dedup) or sent at once (capacity).",
    ),
    "shared_pct": ("--shared-pct", "Common prefix of the prompts, in percent."),
    "trunk_tokens": ("--trunk-tokens", "Approximate size of the common trunk in tokens."),
    "branches": ("--branches", "Concurrent branches off the trunk."),
    "in_flight": (
        "--in-flight",
        "Queue every round at once and keep this many requests in flight (0: a round after the "
        "previous one finished).",
    ),
    "fillers": ("--fillers", "Prompts sent at once to evict the first one from every slot."),
    "pairs": ("--pairs", "Front/server request pairs."),
    "sessions": ("--sessions", "Sessions per scenario."),
    "system_tokens": ("--system-tokens", "Approximate system prompt size in tokens."),
    "users": ("--users", "Users, each with a conversation of its own."),
    "question_tokens": ("--question-tokens", "Approximate size of each question in tokens."),
    "interval_ms": ("--interval-ms", "Milliseconds between two questions (over all users; open loop)."),
    "max_tokens": ("--max-tokens", "Tokens generated per request."),
    "seed": ("--seed", "Seed of the generated text."),
}

HELP = {
    "prefix-tiers": "Common prefixes of 0/25/50/75/90 % of each prompt: per tier a wave of concurrent requests, "
    "tier after tier, round after round (later rounds find the tiers' prefixes only in host caches).",
    "host-dedup": "Prompts sharing their first half, one at a time, then asked again: host cache size "
    "(a full copy per prompt against each shared prefix once) and reuse after the slots moved on.",
    "restore": "A prompt, then one other prompt per slot at once (evicting it everywhere), then the prompt again "
    "with a new question: TTFT of 'again' (host restore) against 'first' (full prefill).",
    "overhead": "Short distinct prompts, alternately through the front and to the server directly: the paired "
    "TTFT difference is what the proxy adds on a miss (target p50 <= 1 ms, p99 <= 3 ms); on Legacy it is the "
    "noise floor.",
    "agents": "Edge agents: financial research, field maintenance and edge incident scenarios, each a long shared "
    "system prompt with tool schemas and documents; concurrent sessions with scripted tool loops on "
    "local data and branching follow-ups.",
    "capacity": "The smallest KV pool (-c, searched; host caches off) that serves 4 concurrent requests with a 50% "
    "common prefix in full, per arm, and the saving of sharing against Legacy. A fresh arm per probe; "
    "-c itself is ignored.",
    "fanout": "Concurrent branches off one long trunk on a cold server: TTFT of each branch and the total, "
    "the trunk computed once per branch (stock) or once and shared (fan-out).",
    "coding-agent": "A coding agent through the Anthropic Messages API (or --api chat): one long system prompt "
    "and the same tool schemas on every request, concurrent sessions whose tool loops return code and "
    "test output, and a sub-agent branching off each session's history.",
    "multi-round": "Many users of one chat service: a shared system prompt, a private history growing by one "
    "question and a short answer per round, questions arriving at a fixed rate (open loop).",
}


def _apply(fn: Callable[..., Any], options: Iterable[Callable[[Any], Any]]) -> Callable[..., Any]:
    """Decorate ``fn`` with ``options`` as if they were stacked in this order above it."""
    for option in reversed(list(options)):
        fn = option(fn)
    return fn


def _settings(
    out_dir: Path,
    model_arg: str | None,
    n_parallel: int,
    ctx_size: int,
    threads: int | None,
    batch_size: int,
    ubatch_size: int,
    build_backend: str,
    gpu_layers: int = 0,
) -> Any:
    import os

    from proxy.bench.arms import ArmSettings
    from proxy.native.model import resolve_model

    return ArmSettings(
        model=resolve_model(model_arg),
        log_dir=out_dir / "logs",
        n_parallel=n_parallel,
        ctx_size=ctx_size,
        threads=threads or os.cpu_count() or 2,
        batch_size=batch_size,
        ubatch_size=ubatch_size,
        build_backend=build_backend,
        gpu_layers=gpu_layers,
    )


def run_arms(workload: Workload, arm_names: list[str], settings: Any, out_dir: Path) -> dict[str, Any]:
    """Each arm in turn: start it, replay the workload, collect its figures, stop it."""
    from proxy.bench.arms import ARMS, arm_binary, start_arm
    from proxy.bench.cluster import start_cluster_arm
    from proxy.bench.limit import tokenized_limit
    from proxy.bench.report import build_report, write_report
    from proxy.traffic.runner import run_workload, write_results

    binaries = {name: arm_binary(ARMS[name], settings.build_backend) for name in arm_names}  # build first
    arms: dict[str, Any] = {}
    limit: dict[str, Any] | None = None
    for name in arm_names:
        _say(f"arm {name}: {ARMS[name].description}")
        start = start_cluster_arm if settings.n_servers > 1 else start_arm
        with start(name, settings, binaries[name]) as arm:
            results = asyncio.run(
                run_workload(
                    workload,
                    arm.front_url,
                    arm.server_url,
                    overrides=arm.overrides,
                    manifest=out_dir / f"manifest-{name}.jsonl",
                    label=name,
                )
            )
            stats = arm.stats()
            if name == arm_names[0]:  # the prompts as the server tokenizes them, once the run is over
                limit = tokenized_limit(arm.server_url, workload, _say)
        write_results(out_dir / f"results-{name}.jsonl", results)
        arms[name] = {"results": results, "stats": stats}
    shared = {
        "model": settings.model.name,
        "n_parallel": settings.n_parallel,
        "ctx_size": settings.ctx_size,
        "threads": settings.threads,
        "batch_size": settings.batch_size,
        "ubatch_size": settings.ubatch_size,
        "servers": settings.n_servers,
    }
    report = build_report(
        {
            "name": workload.name,
            "description": workload.description,
            "params": workload.params,
            "requests": len(workload.requests),
            "concurrency": workload.concurrency,
        },
        arms,
        shared,
        limit,
    )
    for path in write_report(report, out_dir):
        _say(f"wrote {path}")
    click.echo((out_dir / "report.md").read_text())
    return report


def run_capacity_arms(
    workload: Workload, arm_names: list[str], settings: Any, out_dir: Path, **search: Any
) -> dict[str, Any]:
    """The capacity search on each arm, then report.json and report.md."""
    from proxy.bench.capacity import run_capacity
    from proxy.bench.report import write_report

    if search.get("step") is not None and search["step"] < 1:
        raise ConfigError("--step must be positive", fix="pass e.g. --step 64")
    if search.get("upper_factor") is not None and search["upper_factor"] < 1:
        raise ConfigError("--upper-factor must be at least 1", fix="pass e.g. --upper-factor 4")
    together = search.get("min_together")
    if together is not None and not 0 <= together <= len(workload.requests):
        raise ConfigError(
            f"--min-together must be between 0 and the {len(workload.requests)} prompts",
            fix="pass e.g. --min-together 3, or leave it out",
        )
    report = run_capacity(
        workload, arm_names, settings, out_dir, say=_say, **{k: v for k, v in search.items() if v is not None}
    )
    for path in write_report(report, out_dir):
        _say(f"wrote {path}")
    click.echo((out_dir / "report.md").read_text())
    return report


# ---- the commands ------------------------------------------------------------------------------


@click.group()
def bench() -> None:
    """Benchmarks: workloads replayed against the arms nocache, legacy and proxy."""


def run_workload_command(
    name: str,
    arms: str | None,
    dry_run: bool,
    out_dir: Path | None,
    model_arg: str | None,
    n_parallel: int,
    ctx_size: int,
    threads: int | None,
    batch_size: int,
    ubatch_size: int,
    build_backend: str,
    gpu_layers: int,
    **sizes: Any,
) -> None:
    """``radixctl bench NAME``: write the request list, then (unless ``dry_run``) run it on each arm."""
    from proxy.bench.arms import parse_arms
    from proxy.traffic.runner import ManifestEntry, write_manifest

    search = {
        k: sizes.pop(k) for k in ("step", "upper_factor", "probe_timeout_s", "min_together") if k in sizes
    }
    n_servers = int(sizes.pop("n_servers", None) or 1)
    if n_servers < 1:
        raise ConfigError("--servers must be at least 1", fix="pass e.g. --servers 2")
    tier, tier_sizes = sizes.pop("tier", "ram"), sizes.pop("tier_sizes", None)
    if tier == "disk":
        from proxy.bench.disktier import run_disk_restore

        out = out_dir or _default_out("restore-disk")
        settings = _settings(
            out, model_arg, n_parallel, ctx_size, threads, batch_size, ubatch_size, build_backend, gpu_layers
        )
        arm_names = tuple(a.strip() for a in (arms or "disk,ram,legacy,prefill").split(",") if a.strip())
        run_disk_restore(settings, _sizes(tier_sizes or "1024,2048,4096,8192"), out, arm_names)
        return
    workload = make_workload(name, **sizes)
    out = out_dir or _default_out(name)
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(
        out / "workload.jsonl",
        (ManifestEntry(0.0, r.id, r.session, r.group, r.via, r.body, r.path) for r in workload.requests),
    )
    _say(
        f"{name}: {len(workload.requests)} requests, concurrency {workload.concurrency}, "
        f"params {json.dumps(workload.params)}; request list in {out / 'workload.jsonl'}"
    )
    if dry_run:
        return
    settings = _settings(
        out, model_arg, n_parallel, ctx_size, threads, batch_size, ubatch_size, build_backend, gpu_layers
    )
    if n_servers > 1:
        import dataclasses

        settings = dataclasses.replace(settings, n_servers=n_servers)
    defaults = ",".join(DEFAULT_ARMS.get(name, ALL_ARMS))
    if name == "capacity":
        run_capacity_arms(workload, parse_arms(arms or defaults), settings, out, **search)
    else:
        run_arms(workload, parse_arms(arms or defaults), settings, out)


def _workload_options(name: str) -> list[Callable[[Any], Any]]:
    """A workload's options: the arm options, then the sizes its generator takes (and the capacity search)."""
    from proxy.bench.workloads import generator_params

    accepted = generator_params(name)
    defaults = ",".join(DEFAULT_ARMS.get(name, ALL_ARMS))
    options = [
        click.option("--arms", default=None, help=f"Comma-separated arms (default: {defaults})."),
        dry_run_option,
        *ARM_OPTIONS,
    ]
    for key, (flag, text) in _SIZE_OPTIONS.items():
        if key in accepted:
            options.append(
                click.option(flag, key, type=int, default=None, help=f"{text} [default: {accepted[key]}]")
            )
    if name == "capacity":
        options += CAPACITY_OPTIONS
    if name in CLUSTER_WORKLOADS:
        options.append(SERVERS_OPTION)
    if name == "coding-agent":
        options.append(
            click.option(
                "--api",
                type=click.Choice(["messages", "chat"]),
                default=None,
                help="The API the requests use: Anthropic /v1/messages, or the same conversations as "
                "OpenAI chat [default: messages].",
            )
        )
    if name == "restore":
        options += [
            click.option(
                "--tier",
                type=click.Choice(["ram", "disk"]),
                default="ram",
                show_default=True,
                help="disk: TTFT of a restore from the disk tier after a proxy restart, against the RAM "
                "tree, stock's host cache and a full prefill (arms disk,ram,legacy,prefill), per --sizes.",
            ),
            click.option(
                "--sizes",
                "tier_sizes",
                default=None,
                help="With --tier disk: prompt sizes in tokens [default: 1024,2048,4096,8192].",
            ),
        ]
    return options


# Workloads that run on N servers per arm (proxy: one proxy over N; stock: a round-robin balancer).
CLUSTER_WORKLOADS = ("agents", "prefix-tiers")
SERVERS_OPTION = click.option(
    "--servers",
    "n_servers",
    type=int,
    default=None,
    help="Servers per arm: N patched servers behind the proxy against N stock servers behind a "
    "round-robin balancer [default: 1].",
)


def _workload_command(name: str) -> click.Command:
    """``radixctl bench NAME`` for one generator of :data:`GENERATORS`: one definition, one command each."""

    def command(**kw: Any) -> None:
        run_workload_command(name, **kw)

    return click.command(name, help=HELP[name])(fail_cleanly(_apply(command, _workload_options(name))))


for _name in GENERATORS:
    bench.add_command(_workload_command(_name))
del _name


@bench.command("kvctl")
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

    token_sizes = _sizes(sizes)
    out = out_dir or _default_out("kvctl")
    settings = _settings(
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
                    _say,
                    kvctl_key=server.spec.kvctl_key,
                    arena=kind == "arena",
                    chunk_tokens=arena_chunk,
                )
            )
    for kind, report in reports.items():
        where = out / kind if len(reports) > 1 else out
        for path in write_report(report, where):
            _say(f"wrote {path}")
        click.echo((where / "report.md").read_text())
    if "shared" in reports and "inline" in reports:
        from proxy.bench.transport import transport_table

        table, rows = transport_table(reports["shared"], reports["inline"])
        (out / "transport.md").write_text(table)
        (out / "transport.json").write_text(json.dumps(rows, indent=2))
        click.echo(table)


@bench.command("replay")
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
    _say(f"replaying {len(entries)} requests over {entries[-1].t / speed:.1f} s against {url}")
    results = asyncio.run(replay_manifest(entries, url, speed=speed))
    report = build_report(
        {"name": f"replay of {manifest.name}", "description": f"against {url}", "params": {"speed": speed}},
        {"replay": {"results": results, "stats": {}}},
    )
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_results(out_dir / "results-replay.jsonl", results)
        for path in write_report(report, out_dir, charts=False):
            _say(f"wrote {path}")
    click.echo(render_markdown(report))


@bench.command("soak")
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

    out = out_dir or _default_out("soak")
    report = run_soak(
        out, minutes, kill_every, sessions, system_tokens, max_tokens, threads, ctx_size, say=_say
    )
    _say(f"wrote {out / 'report.json'}")
    shown = {k: v for k, v in report.items() if k != "rss_samples"}
    click.echo(json.dumps(shown, indent=1))


__all__ = ["bench", "run_arms", "run_capacity_arms"]
