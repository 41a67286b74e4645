"""Figures from a simulation run: hit rate, balance, TTFT percentiles; a Markdown table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from proxy.sim.engine import SimResult


@dataclass(frozen=True)
class Summary:
    servers: int
    policy: str
    cache: str  # "proxy" (host tree + planner) or "stock" (slot reuse only)
    requests: int
    proxies: int
    hit_rate: float  # prompt tokens not computed / prompt tokens
    restored: float  # share of those tokens imported from a host tree (the rest: slot or resident)
    ttft_p50: float
    ttft_p95: float
    ttft_p99: float
    busy_max_mean: float  # engine time: busiest server / mean
    busy_cv: float  # engine time: stdev / mean
    utilisation: float  # mean engine time / simulated time
    moved: float  # share of sessions served by more than one server


def summarize(r: SimResult) -> Summary:
    ttft = np.array([s.ttft_s for s in r.served]) if r.served else np.zeros(1)
    prompt = sum(s.n_prompt for s in r.served)
    cached = sum(s.cached for s in r.served)
    busy = r.busy_s
    mean = statistics.fmean(busy)
    sessions = len({s.session_id for s in r.served})
    return Summary(
        servers=r.config.servers,
        policy=r.config.policy,
        cache="proxy" if r.config.host_tree else "stock",
        requests=len(r.served),
        proxies=r.config.proxies,
        hit_rate=sum(s.cached for s in r.served) / prompt if prompt else 0.0,
        restored=sum(s.restored for s in r.served) / cached if cached else 0.0,
        ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p95=float(np.percentile(ttft, 95)),
        ttft_p99=float(np.percentile(ttft, 99)),
        busy_max_mean=max(busy) / mean if mean else 0.0,
        busy_cv=statistics.pstdev(busy) / mean if mean else 0.0,
        utilisation=mean / r.end_s if r.end_s else 0.0,
        moved=r.sessions_moved / sessions if sessions else 0.0,
    )


HEADER = (
    "| servers | proxies | policy | cache | requests | hit rate | restored | TTFT p50 | TTFT p95 | TTFT p99 "
    "| busy max/mean | busy CV | utilisation | sessions moved |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def row(s: Summary) -> str:
    return (
        f"| {s.servers} | {s.proxies} | {s.policy} | {s.cache} | {s.requests} | {s.hit_rate:.3f} "
        f"| {s.restored:.2f} | {s.ttft_p50:.2f} "
        f"| {s.ttft_p95:.2f} | {s.ttft_p99:.2f} | {s.busy_max_mean:.2f} | {s.busy_cv:.3f} "
        f"| {s.utilisation:.2f} | {s.moved:.2f} |"
    )


def table(summaries: list[Summary]) -> str:
    return "\n".join([HEADER, *(row(s) for s in summaries)])
