"""Figures per arm, the ratio to Legacy, and the report files (JSON, markdown, PNG charts).

Charts are drawn only if matplotlib can be imported; it is not a dependency, and without it
the markdown says the charts were skipped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.bench.limit import arm_limit, render_limit
from proxy.bench.markdown import fmt_mib, fmt_n, fmt_s, fmt_x, md_table
from proxy.bench.report_capacity import render_capacity_markdown
from proxy.bench.report_fleet import render_fleet
from proxy.bench.report_kvctl import render_kvctl_markdown
from proxy.bench.report_spec import render_speculation
from proxy.bench.stats import percentile
from proxy.bench.waits import route_waits, waits_markdown
from proxy.traffic.runner import RequestResult


def _sum(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


#: Figures compared with Legacy's, as ``<figure>_vs_legacy`` (ratios: below 1 is faster).
VS_LEGACY = (
    "ttft_p50_s",
    "ttft_p90_s",
    "e2e_p50_s",
    "e2e_p90_s",
    "ttft_mean_s",
    "ttft_p99_s",
    "e2e_mean_s",
    "e2e_p99_s",
)


def summarize(results: Sequence[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    ends = [r.sent_s + (r.e2e_s or 0.0) for r in results]
    wall = max(ends) - min(r.sent_s for r in results) if results else 0.0
    generated = _sum([r.predicted_n for r in ok])
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p90_s": percentile(e2e, 90),
        "ttft_mean_s": _mean(ttft),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_mean_s": _mean(e2e),
        "e2e_p99_s": percentile(e2e, 99),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "generated_tokens_per_s": generated / wall if wall > 0 and generated is not None else None,
        "cache_n": _sum([r.cache_n for r in ok]),
        "prompt_n": _sum([r.prompt_n for r in ok]),
        "generated_tokens": generated,
        "draft_n": _sum([r.draft_n for r in ok]),
        "draft_n_accepted": _sum([r.draft_n_accepted for r in ok]),
    }


def _groups(results: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    out: dict[str, list[RequestResult]] = {}
    for r in results:
        out.setdefault(r.group, []).append(r)
    return {
        g: {
            k: v
            for k, v in summarize(rs).items()
            if k in ("requests", "errors", "ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "cache_n", "prompt_n")
        }
        for g, rs in out.items()
    }


def paired_overhead(results: Sequence[RequestResult]) -> dict[str, Any] | None:
    """What the front adds per pair (ms): ``front`` minus ``server``.

    Raw TTFT and end-to-end differences carry the noise of prefill time (other load, a few
    more or fewer reused tokens). The residual, TTFT minus the server's own ``prompt_ms``,
    removes the prefill from both sides: its paired difference is the time the request spent
    outside the server's computation, proxy included.
    """
    pairs: dict[Any, dict[str, RequestResult]] = {}
    for r in results:
        if "pair" in r.meta and r.ok:
            pairs.setdefault(r.meta["pair"], {})[r.via] = r
    full = [p for p in pairs.values() if "front" in p and "server" in p]
    if not full:
        return None
    d_ttft = [1000 * ((p["front"].ttft_s or 0) - (p["server"].ttft_s or 0)) for p in full]
    d_e2e = [1000 * ((p["front"].e2e_s or 0) - (p["server"].e2e_s or 0)) for p in full]
    d_res = []
    for p in full:
        front, server = _residual_ms(p["front"]), _residual_ms(p["server"])
        if front is not None and server is not None:
            d_res.append(front - server)
    return {
        "pairs": len(full),
        "ttft_ms_p50": percentile(d_ttft, 50),
        "ttft_ms_p90": percentile(d_ttft, 90),
        "e2e_ms_p50": percentile(d_e2e, 50),
        "e2e_ms_p90": percentile(d_e2e, 90),
        "residual_ms_p50": percentile(d_res, 50),
        "residual_ms_p90": percentile(d_res, 90),
        "residual_ms_p99": percentile(d_res, 99),
        "target_p50_ms": 1.0,
        "target_p99_ms": 3.0,
    }


def _residual_ms(r: RequestResult) -> float | None:
    if r.ttft_s is None or r.prompt_ms is None:
        return None
    return 1000 * r.ttft_s - r.prompt_ms


def fanout_figures(results: Sequence[RequestResult]) -> dict[str, Any] | None:
    """Per round of branches off one trunk: TTFT of each branch, sorted, the last and the total.

    Times run from the round's first send (all branches are sent at once when the workload's
    concurrency allows): a branch's TTFT is when its first token came, ``total_s`` when the
    last answer ended. Over several rounds the figures are medians (for each rank of the
    sorted TTFTs, the median over rounds).
    """
    rounds: dict[Any, list[RequestResult]] = {}
    for r in results:
        if "branch" in r.meta:
            rounds.setdefault(r.meta.get("round", 1), []).append(r)
    if not rounds:
        return None
    per_round = []
    for rnd, rs in sorted(rounds.items()):
        ok = [r for r in rs if r.ok and r.ttft_s is not None]
        start = min(r.sent_s for r in rs)
        first = {str(r.meta["branch"]): r.sent_s - start + (r.ttft_s or 0.0) for r in ok}
        per_round.append(
            {
                "round": rnd,
                "branches": len(rs),
                "errors": len(rs) - len(ok),
                "ttft_by_branch_s": first,
                "ttft_sorted_s": sorted(first.values()),
                "last_ttft_s": max(first.values(), default=None),
                "total_s": max(r.sent_s - start + (r.e2e_s or 0.0) for r in rs),
                "prompt_n": _sum([r.prompt_n for r in ok]),
                "cache_n": _sum([r.cache_n for r in ok]),
            }
        )
    ranks = max(len(p["ttft_sorted_s"]) for p in per_round)
    sorted_med = [
        percentile([p["ttft_sorted_s"][k] for p in per_round if len(p["ttft_sorted_s"]) > k], 50)
        for k in range(ranks)
    ]
    lasts = [p["last_ttft_s"] for p in per_round if p["last_ttft_s"] is not None]
    return {
        "rounds": per_round,
        "ttft_sorted_s": sorted_med,
        "first_ttft_s": sorted_med[0] if sorted_med else None,
        "last_ttft_s": percentile(lasts, 50),
        "total_s": percentile([p["total_s"] for p in per_round], 50),
        "errors": sum(p["errors"] for p in per_round),
    }


def build_report(
    workload: dict[str, Any],
    arms: dict[str, dict[str, Any]],
    settings: dict[str, Any] | None = None,
    limit: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``arms``: name -> {"results": [RequestResult], "stats": {...}} in run order; ``limit``:
    the workload's minimum prefill (``proxy.bench.limit.workload_limit``), when known."""
    out: dict[str, Any] = {"workload": workload, "settings": settings or {}, "arms": {}}
    if limit:
        out["limit"] = limit
    for name, arm in arms.items():
        results: list[RequestResult] = arm["results"]
        stats = dict(arm.get("stats") or {})
        entry = {
            **summarize(results),
            "host_cache_bytes": stats.pop("host_cache_bytes", None),
            "kv_cells_used": stats.pop("kv_cells_used", None),
            "groups": _groups(results),
            "details": stats,
        }
        routes: dict[str, int] = {}
        for r in results:
            if r.route:
                routes[r.route] = routes.get(r.route, 0) + 1
        if routes:
            entry["routes"] = routes
        waits = route_waits(results)
        if waits:
            entry["waits"] = waits
        overhead = paired_overhead(results)
        if overhead:
            entry["overhead"] = overhead
        fan = fanout_figures(results)
        if fan:
            entry["fanout"] = fan
        if limit:
            entry["limit"] = arm_limit(results, limit["min_prefill_by_request"])
        out["arms"][name] = entry
    legacy = out["arms"].get("legacy")
    for entry in out["arms"].values():
        for key in VS_LEGACY:
            entry[f"{key[:-2]}_vs_legacy"] = _ratio(entry[key], legacy[key]) if legacy else None
        fan, base = entry.get("fanout"), (legacy or {}).get("fanout")
        if fan:
            for key in ("first_ttft_s", "last_ttft_s", "total_s"):
                fan[f"{key[:-2]}_vs_legacy"] = _ratio(fan[key], base[key]) if base else None
            fan["ttft_sorted_vs_legacy"] = [
                _ratio(v, base["ttft_sorted_s"][k]) if base and k < len(base["ttft_sorted_s"]) else None
                for k, v in enumerate(fan["ttft_sorted_s"])
            ]
    return out


# ---- rendering ----------------------------------------------------------------------------


def render_markdown(report: dict[str, Any], chart_note: str = "") -> str:
    wl, arms = report["workload"], report["arms"]
    lines = [
        f"# Benchmark: {wl.get('name')}",
        "",
        str(wl.get("description", "")),
        "",
        "Workload: " + ", ".join(f"{k}={v}" for k, v in (wl.get("params") or {}).items()),
        "",
    ]
    if report.get("settings"):
        lines += ["Arms share: " + ", ".join(f"{k}={v}" for k, v in report["settings"].items()), ""]
    lines += ["Times in seconds; ratios are arm / Legacy (below 1 is faster).", ""]
    rows = [
        [
            name,
            str(a["requests"]),
            str(a["errors"]),
            fmt_s(a["ttft_p50_s"]),
            fmt_s(a["ttft_p90_s"]),
            fmt_s(a["e2e_p50_s"]),
            fmt_s(a["e2e_p90_s"]),
            fmt_n(a["requests_per_s"], "{:.2f}"),
            fmt_n(a["generated_tokens_per_s"], "{:.1f}"),
            fmt_n(a["cache_n"]),
            fmt_n(a["prompt_n"]),
            fmt_mib(a["host_cache_bytes"]),
            fmt_n(a["kv_cells_used"]),
            fmt_x(a["ttft_p50_vs_legacy"]),
            fmt_x(a["e2e_p50_vs_legacy"]),
        ]
        for name, a in arms.items()
    ]
    lines += md_table(
        [
            "arm",
            "n",
            "err",
            "TTFT p50",
            "TTFT p90",
            "e2e p50",
            "e2e p90",
            "req/s",
            "gen tok/s",
            "cache_n",
            "prompt_n",
            "host cache",
            "KV cells",
            "TTFT vs legacy",
            "e2e vs legacy",
        ],
        rows,
    )
    lines += ["", "Means and tails (the same requests):", ""]
    lines += md_table(
        [
            "arm",
            "TTFT mean",
            "TTFT p99",
            "e2e mean",
            "e2e p99",
            "vs legacy: TTFT mean",
            "TTFT p99",
            "e2e mean",
            "e2e p99",
        ],
        [
            [
                name,
                *(fmt_s(a.get(k)) for k in ("ttft_mean_s", "ttft_p99_s", "e2e_mean_s", "e2e_p99_s")),
                *(
                    fmt_x(a.get(k))
                    for k in (
                        "ttft_mean_vs_legacy",
                        "ttft_p99_vs_legacy",
                        "e2e_mean_vs_legacy",
                        "e2e_p99_vs_legacy",
                    )
                ),
            ]
            for name, a in arms.items()
        ],
    )
    optimum = {
        n: a["details"].get("host_optimum_bytes")
        for n, a in arms.items()
        if a.get("details", {}).get("host_optimum_bytes")
    }
    for name, best in optimum.items():
        lines += [
            "",
            f"Host cache optimum seen by `{name}` (its distinct tokens x KV bytes per token): {fmt_mib(best)}.",
        ]
    lines += render_speculation(arms)
    lines += render_limit(report)
    lines += render_fleet(report)
    groups = list(dict.fromkeys(g for a in arms.values() for g in a["groups"]))
    if len(groups) > 1:
        group_min = (report.get("limit") or {}).get("min_prefill_by_group") or {}
        lines += [
            "",
            "TTFT p50 (s) by group, and cache_n / prompt_n (min prefill: the limit's, per group):",
            "",
        ]
        grows = [
            [
                g,
                fmt_n(group_min.get(g)),
                *[
                    f"{fmt_s(a['groups'].get(g, {}).get('ttft_p50_s'))} ({fmt_n(a['groups'].get(g, {}).get('cache_n'))}"
                    f" / {fmt_n(a['groups'].get(g, {}).get('prompt_n'))})"
                    for a in arms.values()
                ],
            ]
            for g in groups
        ]
        lines += md_table(["group", "min prefill", *arms], grows)
    over = {n: a["overhead"] for n, a in arms.items() if "overhead" in a}
    if over:
        lines += [
            "",
            "Paired difference front - server in ms (on arms without a proxy front and server are the same: "
            "the noise floor). Residual = TTFT minus the server's prompt_ms, which takes the prefill's own "
            "variation out; target for the proxy: residual p50 at most 1 ms, p99 at most 3 ms.",
            "",
        ]
        lines += md_table(
            [
                "arm",
                "pairs",
                "residual p50",
                "residual p90",
                "residual p99",
                "TTFT p50",
                "TTFT p90",
                "e2e p50",
                "e2e p90",
            ],
            [
                [
                    n,
                    str(o["pairs"]),
                    fmt_n(o.get("residual_ms_p50"), "{:.2f}"),
                    fmt_n(o.get("residual_ms_p90"), "{:.2f}"),
                    fmt_n(o.get("residual_ms_p99"), "{:.2f}"),
                    fmt_n(o["ttft_ms_p50"], "{:.2f}"),
                    fmt_n(o["ttft_ms_p90"], "{:.2f}"),
                    fmt_n(o["e2e_ms_p50"], "{:.2f}"),
                    fmt_n(o["e2e_ms_p90"], "{:.2f}"),
                ]
                for n, o in over.items()
            ],
        )
    fans = {n: a["fanout"] for n, a in arms.items() if a.get("fanout")}
    if fans:
        lines += [
            "",
            "Fan-out: TTFT of each branch (s, sorted: first answered first), the last branch's first token "
            "and the total (first send to last answer) from the start of the round; ratios to Legacy "
            "(below 1 is faster). Several rounds: medians.",
            "",
        ]
        lines += md_table(
            [
                "arm",
                "TTFT of the branches",
                "last TTFT",
                "total",
                "errors",
                "each vs legacy",
                "last TTFT vs legacy",
                "total vs legacy",
            ],
            [
                [
                    n,
                    " / ".join(fmt_n(v, "{:.2f}") for v in f["ttft_sorted_s"]),
                    fmt_s(f["last_ttft_s"]),
                    fmt_s(f["total_s"]),
                    str(f["errors"]),
                    " / ".join(fmt_x(v) for v in f.get("ttft_sorted_vs_legacy") or []),
                    fmt_x(f.get("last_ttft_vs_legacy")),
                    fmt_x(f.get("total_vs_legacy")),
                ]
                for n, f in fans.items()
            ],
        )
    routes = {n: a["routes"] for n, a in arms.items() if a.get("routes")}
    for name, r in routes.items():
        lines += ["", f"{name} routes: " + ", ".join(f"{k} {v}" for k, v in sorted(r.items()))]
    lines += waits_markdown(arms)
    if chart_note:
        lines += ["", chart_note]
    return "\n".join(lines) + "\n"


def _charts(report: dict[str, Any], out_dir: Path) -> tuple[list[Path], str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            [],
            "Charts skipped: matplotlib is not installed (it is not a dependency; `pip install matplotlib`).",
        )
    arms = report["arms"]
    names = list(arms)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.35
    xs = range(len(names))
    for k, (key, label) in enumerate((("ttft_p50_s", "TTFT p50"), ("ttft_p90_s", "TTFT p90"))):
        ax.bar([x + k * width for x in xs], [arms[n][key] or 0 for n in names], width, label=label)
    ax.set_xticks([x + width / 2 for x in xs], names)
    ax.set_ylabel("seconds")
    ax.set_title(f"{report['workload'].get('name')}: time to first token")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "ttft.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    groups = list(dict.fromkeys(g for a in arms.values() for g in a["groups"]))
    if len(groups) > 1:
        fig, ax = plt.subplots(figsize=(max(7, len(groups) * 1.2), 4))
        width = 0.8 / max(1, len(names))
        for k, n in enumerate(names):
            ax.bar(
                [g + k * width for g in range(len(groups))],
                [arms[n]["groups"].get(gr, {}).get("ttft_p50_s") or 0 for gr in groups],
                width,
                label=n,
            )
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, rotation=20)
        ax.set_ylabel("TTFT p50 (s)")
        ax.legend()
        fig.tight_layout()
        paths.append(out_dir / "ttft_by_group.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths, ""


def rebuild_report(run_dir: Path) -> dict[str, Any]:
    """A workload run's report built again from its files (report.json's workload, settings, limit
    and arm stats; each arm's results-ARM.jsonl): what ``radixctl bench report`` writes."""
    from proxy.errors import ConfigError
    from proxy.traffic.runner import read_results

    path = run_dir / "report.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist", fix="pass the --out folder of a `radixctl bench` run")
    old = json.loads(path.read_text())
    if "sizes" in old or "capacity" in old or not old.get("arms"):
        raise ConfigError(
            f"{path} is not a workload run's report (kvctl and capacity runs keep no results to rebuild from)",
            fix="pass the --out folder of a workload run (agents, restore, multi-round, ...)",
        )
    arms: dict[str, dict[str, Any]] = {}
    for name, entry in old["arms"].items():
        results_path = run_dir / f"results-{name}.jsonl"
        if not results_path.is_file():
            raise ConfigError(f"{results_path} is missing", fix="rebuild from a complete run folder")
        stats = {
            **(entry.get("details") or {}),
            "host_cache_bytes": entry.get("host_cache_bytes"),
            "kv_cells_used": entry.get("kv_cells_used"),
        }
        arms[name] = {"results": read_results(results_path), "stats": stats}
    return build_report(old["workload"], arms, old.get("settings"), old.get("limit"))


def write_report(report: dict[str, Any], out_dir: Path, charts: bool = True) -> list[Path]:
    """report.json, report.md and (matplotlib permitting) PNG charts in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    note = ""
    if charts and report.get("arms"):
        pngs, note = _charts(report, out_dir)
        written += pngs
        report = {**report, "charts": [p.name for p in pngs], "charts_note": note or None}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    if "sizes" in report:
        md = render_kvctl_markdown(report)
    elif "capacity" in report:
        md = render_capacity_markdown(report)
    else:
        md = render_markdown(report, note)
    (out_dir / "report.md").write_text(md)
    return [out_dir / "report.json", out_dir / "report.md", *written]
