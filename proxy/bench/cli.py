"""``radixctl bench WORKLOAD``: the workload commands, each arm in turn, and the bench group (the
other commands are in cli_tools.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import click

from proxy.bench.capacity import DEFAULT_PROBE_TIMEOUT_S, DEFAULT_STEP, DEFAULT_UPPER_FACTOR
from proxy.bench.cli_options import (
    ARM_OPTIONS,
    MMPROJ_OPTION,
    arm_settings,
    default_out,
    off_server_cpus,
    parse_sizes,
    say,
    with_projector,
)
from proxy.bench.cli_tools import kvctl, replay, report, soak
from proxy.bench.workloads import DEFAULT_ARMS, GENERATORS, make_workload
from proxy.cli.common import fail_cleanly
from proxy.errors import ConfigError
from proxy.traffic.spec import Workload

ALL_ARMS = ("nocache", "legacy", "proxy")


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
    "prompt_tokens": (
        "--prompt-tokens",
        "Approximate prompt size in tokens (cluster: each session's document).",
    ),
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
    "sessions": ("--sessions", "Sessions (agents: per scenario)."),
    "system_tokens": ("--system-tokens", "Approximate system prompt size in tokens."),
    "users": ("--users", "Users, each with a conversation of its own."),
    "question_tokens": ("--question-tokens", "Approximate size of each question in tokens."),
    "interval_ms": ("--interval-ms", "Milliseconds between two questions (over all users; open loop)."),
    "think_ms": ("--think-ms", "Milliseconds a session waits after an answer before its next question."),
    "stagger_ms": ("--stagger-ms", "Milliseconds between two sessions' first questions."),
    "image_px": ("--image-px", "Side of each (square) photo in pixels."),
    "shared_images": ("--shared-images", "Photos every session sends (the same bytes)."),
    "own_images": ("--own-images", "Photos of each session's own."),
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
    "cluster": "Sessions on a private document each, under one system prompt, behind a round-robin "
    "balancer in front of N proxies (one server each): a session's rounds move between the proxies, "
    "which restore its history from the shared Valkey tier (fleet-shared) or prefill it again (fleet).",
    "multi-round": "Many users of one chat service: a shared system prompt, a private history growing by one "
    "question and a short answer per round, questions arriving at a fixed rate (open loop).",
    "vision": "Inspection sessions with photos: shared reference photos and each session's own, sent again on "
    "every turn with the history; every arm's servers get a projector (--mmproj), the limit counts each "
    "image's cells as the server keys them.",
}


def _apply(fn: Callable[..., Any], options: Iterable[Callable[[Any], Any]]) -> Callable[..., Any]:
    """Decorate ``fn`` with ``options`` as if they were stacked in this order above it."""
    for option in reversed(list(options)):
        fn = option(fn)
    return fn


def run_arms(workload: Workload, arm_names: list[str], settings: Any, out_dir: Path) -> dict[str, Any]:
    """Each arm in turn: start it, replay the workload, collect its figures, stop it."""
    from proxy.bench.arms import ARMS, arm_binary, kvctl_auth, start_arm
    from proxy.bench.cluster import start_cluster_arm
    from proxy.bench.fleet import start_fleet_arm
    from proxy.bench.limit import tokenized_limit, workload_has_media
    from proxy.bench.report import build_report, write_report
    from proxy.traffic.runner import run_workload, write_results

    binaries = {name: arm_binary(ARMS[name], settings.build_backend) for name in arm_names}  # build first
    arms: dict[str, Any] = {}
    limit: dict[str, Any] | None = None
    media, tokenized = workload_has_media(workload), False
    for name in arm_names:
        say(f"arm {name}: {ARMS[name].description}")
        start = (
            start_fleet_arm
            if ARMS[name].fleet
            else start_cluster_arm
            if settings.n_servers > 1
            else start_arm
        )
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
            # the prompts as the server tokenizes them, once the run is over: on the first arm's
            # server, or with media on the first patched one (/kvctl/tokenize)
            if not tokenized and (arm.arm.proxy or not media):
                limit = tokenized_limit(
                    arm.server_url, workload, say, kvctl_auth(arm.server) if media else None
                )
                tokenized = True
        write_results(out_dir / f"results-{name}.jsonl", results)
        arms[name] = {"results": results, "stats": stats}
    if not tokenized:  # arm.arm.proxy: its servers run with --kvctl, hence /kvctl/tokenize
        say("no patched arm to tokenize the workload's media (/kvctl/tokenize): the report has no limit")
    shared = {
        "model": settings.model.name,
        "n_parallel": settings.n_parallel,
        "ctx_size": settings.ctx_size,
        "threads": settings.threads,
        "batch_size": settings.batch_size,
        "ubatch_size": settings.ubatch_size,
        "servers": settings.n_servers,
        **settings.cpus_setting(),
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
        say(f"wrote {path}")
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
        workload, arm_names, settings, out_dir, say=say, **{k: v for k, v in search.items() if v is not None}
    )
    for path in write_report(report, out_dir):
        say(f"wrote {path}")
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
    server_args: tuple[str, ...] = (),
    server_cpus: str | None = None,
    **sizes: Any,
) -> None:
    """``radixctl bench NAME``: write the request list, then (unless ``dry_run``) run it on each arm."""
    from proxy.bench.arms import parse_arms
    from proxy.traffic.runner import ManifestEntry, write_manifest

    search = {
        k: sizes.pop(k) for k in ("step", "upper_factor", "probe_timeout_s", "min_together") if k in sizes
    }
    n_servers = int(sizes.pop("n_servers", None) or DEFAULT_SERVERS.get(name, 1))
    if n_servers < 1:
        raise ConfigError("--servers must be at least 1", fix="pass e.g. --servers 2")
    tier, tier_sizes = sizes.pop("tier", "ram"), sizes.pop("tier_sizes", None)
    if tier == "disk":
        from proxy.bench.disktier import run_disk_restore

        out = out_dir or default_out("restore-disk")
        settings = arm_settings(
            out,
            model_arg,
            n_parallel,
            ctx_size,
            threads,
            batch_size,
            ubatch_size,
            build_backend,
            gpu_layers,
            server_args,
            server_cpus,
        )
        arm_names = tuple(a.strip() for a in (arms or "disk,ram,legacy,prefill").split(",") if a.strip())
        with off_server_cpus(settings.server_cpus):
            run_disk_restore(settings, parse_sizes(tier_sizes or "1024,2048,4096,8192"), out, arm_names)
        return
    mmproj = sizes.pop("mmproj", None)
    workload = make_workload(name, **sizes)
    out = out_dir or default_out(name)
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(
        out / "workload.jsonl",
        (ManifestEntry(0.0, r.id, r.session, r.group, r.via, r.body, r.path) for r in workload.requests),
    )
    say(
        f"{name}: {len(workload.requests)} requests, concurrency {workload.concurrency}, "
        f"params {json.dumps(workload.params)}; request list in {out / 'workload.jsonl'}"
    )
    if dry_run:
        return
    settings = arm_settings(
        out,
        model_arg,
        n_parallel,
        ctx_size,
        threads,
        batch_size,
        ubatch_size,
        build_backend,
        gpu_layers,
        server_args,
        server_cpus,
    )
    if n_servers > 1:
        import dataclasses

        settings = dataclasses.replace(settings, n_servers=n_servers)
    if mmproj is not None:
        settings = with_projector(settings, mmproj)
    defaults = ",".join(DEFAULT_ARMS.get(name, ALL_ARMS))
    with off_server_cpus(settings.server_cpus):
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
    if name == "vision":
        options.append(MMPROJ_OPTION)
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
CLUSTER_WORKLOADS = ("agents", "prefix-tiers", "multi-round", "coding-agent", "cluster")
#: Servers per arm where ``--servers`` is not given (``cluster``: a fleet of two proxies).
DEFAULT_SERVERS = {"cluster": 2}
SERVERS_OPTION = click.option(
    "--servers",
    "n_servers",
    type=int,
    default=None,
    help="Servers per arm: N patched servers behind the proxy (or, on the fleet arms, a proxy each "
    "behind a round-robin balancer) against N stock servers behind that balancer "
    "[default: 1; cluster: 2].",
)


def _workload_command(name: str) -> click.Command:
    """``radixctl bench NAME`` for one generator of :data:`GENERATORS`: one definition, one command each."""

    def command(**kw: Any) -> None:
        run_workload_command(name, **kw)

    return click.command(name, help=HELP[name])(fail_cleanly(_apply(command, _workload_options(name))))


for _name in GENERATORS:
    bench.add_command(_workload_command(_name))
del _name


for _command in (kvctl, replay, report, soak):
    bench.add_command(_command)
del _command

__all__ = ["bench", "run_arms", "run_capacity_arms"]
