"""``radixctl sim``: run the scale simulator (docs/scale.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from proxy.config import Config
from proxy.sim.calibrate import CalibrationError, fit_prefill, measure
from proxy.sim.engine import SimConfig, Simulator
from proxy.sim.model import Calibration
from proxy.sim.policies import POLICIES
from proxy.sim.report import Summary, summarize, table
from proxy.sim.workload import WorkloadSpec

DEFAULTS = Calibration()


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"not a list of integers: {text!r}") from exc
    if not out or min(out) < 1:
        raise click.BadParameter("give one or more positive integers")
    return out


def _policies(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise click.BadParameter(f"unknown policy {bad} (choose from {', '.join(POLICIES)})")
    return names


# Policies that need the proxy (its host tree and plans): never run over stock servers.
PROXY_POLICIES = ("cache-aware", "proxy-cost")


def _arms(names: list[str], stock: bool, proxies: list[int], servers: int) -> list[tuple[str, bool, int]]:
    """(policy, host tree, proxies) to run: each policy with the proxy at each proxy count up to
    the number of servers, and the baselines once over stock servers (no proxy, so no count)."""
    out = []
    for name in names:
        out += [(name, True, p) for p in proxies if p <= servers]
        if stock and name not in PROXY_POLICIES:
            out.append((name, False, 1))
    return out


@click.group()
def sim() -> None:
    """Discrete-event simulation of many servers behind a routing policy."""


@sim.command("run")
@click.option("--servers", default="8,16,32,64", show_default=True, help="Server counts, comma-separated.")
@click.option("--policies", default=",".join(POLICIES), show_default=True)
@click.option(
    "--stock/--no-stock",
    default=True,
    show_default=True,
    help="Also run the baselines over stock servers (slot reuse only, no host tree).",
)
@click.option(
    "--proxies",
    default="1",
    show_default=True,
    help="Proxy counts, comma-separated: each owns servers/proxies servers and its own host tree, "
    "behind a balancer hashing the session (deploy/nginx).",
)
@click.option("--slots", default=4, show_default=True, help="Slots per server.")
@click.option("--sessions-per-server", default=50, show_default=True)
@click.option("--load", default=1.0, show_default=True, help="New sessions per server per minute.")
@click.option("--systems", default=8, show_default=True, help="Distinct system prompts.")
@click.option("--share/--no-share", default=False, show_default=True, help="Resident sharing (route S).")
@click.option(
    "--cache-ram-mib", default=Config.cache_ram_mib, show_default=True, help="Host tree budget (real bytes)."
)
@click.option("--prefill-tok-s", default=DEFAULTS.prefill_tok_s, show_default=True)
@click.option("--prefill-ctx-tokens", default=DEFAULTS.prefill_ctx_tokens, show_default=True)
@click.option("--decode-tok-s", default=DEFAULTS.decode_tok_s, show_default=True)
@click.option("--move-mb-s", default=DEFAULTS.move_mb_s, show_default=True)
@click.option(
    "--move-call-s", default=DEFAULTS.move_call_s, show_default=True, help="Fixed cost of one move."
)
@click.option(
    "--bytes-per-token",
    default=DEFAULTS.bytes_per_token,
    show_default=True,
    help="KV bytes per token (f16 of the default model; `radixctl model shapes` lists other shapes').",
)
@click.option("--seed", default=0, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Also write the table here.")
def run(
    servers: str,
    policies: str,
    stock: bool,
    proxies: str,
    slots: int,
    sessions_per_server: int,
    load: float,
    systems: int,
    share: bool,
    cache_ram_mib: int,
    prefill_tok_s: float,
    prefill_ctx_tokens: float,
    decode_tok_s: float,
    move_mb_s: float,
    move_call_s: float,
    bytes_per_token: int,
    seed: int,
    out: Path | None,
) -> None:
    """Every policy at every server count, on the same seeded workload per count."""
    if load <= 0 or sessions_per_server < 1 or slots < 1 or systems < 1:
        raise click.BadParameter("--load, --sessions-per-server, --slots and --systems must be positive")
    calib = dataclasses.replace(
        DEFAULTS,
        prefill_tok_s=prefill_tok_s,
        prefill_ctx_tokens=prefill_ctx_tokens,
        decode_tok_s=decode_tok_s,
        move_mb_s=move_mb_s,
        move_call_s=move_call_s,
        bytes_per_token=bytes_per_token,
    )
    results: list[Summary] = []
    for n in _ints(servers):
        spec = WorkloadSpec(
            sessions=n * sessions_per_server, rate_per_s=n * load / 60, systems=systems, seed=seed
        )
        for name, host_tree, n_proxies in _arms(_policies(policies), stock, _ints(proxies), n):
            cfg = SimConfig(
                servers=n,
                proxies=n_proxies,
                slots=slots,
                policy=name,
                host_tree=host_tree,
                share=share and host_tree,
                host_budget_mib=cache_ram_mib,
                calib=calib,
                workload=spec,
            )
            summary = summarize(Simulator(cfg).run())
            results.append(summary)
            click.echo(f"[sim] {n} servers, {n_proxies} proxies, {name}, {summary.cache}: done", err=True)
    text = table(results)
    click.echo(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


@sim.command("calibrate")
@click.option("--url", required=True, help="A running llama-server (idle: nothing else sent meanwhile).")
@click.option("--words", default="300,1500", show_default=True, help="Two prompt sizes, in words.")
@click.option("--n-predict", default=64, show_default=True)
def calibrate(url: str, words: str, n_predict: int) -> None:
    """Measure prefill and decode rates and print the `sim run` options they give."""
    sizes = _ints(words)
    if len(sizes) != 2:
        raise click.BadParameter("give two prompt sizes")
    try:
        samples = [measure(url, w, n_predict) for w in sizes]
    except CalibrationError as e:
        raise click.ClickException(str(e)) from None
    for s in samples:
        click.echo(
            f"prompt {s.prompt_n} tokens in {s.prompt_s:.3f} s ({s.prompt_n / s.prompt_s:.1f} tok/s); "
            f"{s.predicted_n} decoded in {s.predicted_s:.3f} s ({s.predicted_n / s.predicted_s:.1f} tok/s)"
        )
    rate, ctx = fit_prefill(*samples)
    decode = sum(s.predicted_n for s in samples) / sum(s.predicted_s for s in samples)
    click.echo(f"--prefill-tok-s {rate:.1f} --prefill-ctx-tokens {ctx:.0f} --decode-tok-s {decode:.1f}")
