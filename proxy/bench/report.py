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
from proxy.bench.stats import percentile
from proxy.bench.waits import route_waits, waits_markdown
from proxy.traffic.runner import RequestResult


def _sum(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


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
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "generated_tokens_per_s": generated / wall if wall > 0 and generated is not None else None,
        "cache_n": _sum([r.cache_n for r in ok]),
        "prompt_n": _sum([r.prompt_n for r in ok]),
        "generated_tokens": generated,
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
        for key in ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "e2e_p90_s"):
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


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _n(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:.1f} MiB"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *["| " + " | ".join(row) + " |" for row in rows],
    ]


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
            _s(a["ttft_p50_s"]),
            _s(a["ttft_p90_s"]),
            _s(a["e2e_p50_s"]),
            _s(a["e2e_p90_s"]),
            _n(a["requests_per_s"], "{:.2f}"),
            _n(a["generated_tokens_per_s"], "{:.1f}"),
            _n(a["cache_n"]),
            _n(a["prompt_n"]),
            _mib(a["host_cache_bytes"]),
            _n(a["kv_cells_used"]),
            _x(a["ttft_p50_vs_legacy"]),
            _x(a["e2e_p50_vs_legacy"]),
        ]
        for name, a in arms.items()
    ]
    lines += _table(
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
    optimum = {
        n: a["details"].get("host_optimum_bytes")
        for n, a in arms.items()
        if a.get("details", {}).get("host_optimum_bytes")
    }
    for name, best in optimum.items():
        lines += [
            "",
            f"Host cache optimum seen by `{name}` (its distinct tokens x KV bytes per token): {_mib(best)}.",
        ]
    lines += render_limit(report)
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
                _n(group_min.get(g)),
                *[
                    f"{_s(a['groups'].get(g, {}).get('ttft_p50_s'))} ({_n(a['groups'].get(g, {}).get('cache_n'))}"
                    f" / {_n(a['groups'].get(g, {}).get('prompt_n'))})"
                    for a in arms.values()
                ],
            ]
            for g in groups
        ]
        lines += _table(["group", "min prefill", *arms], grows)
    over = {n: a["overhead"] for n, a in arms.items() if "overhead" in a}
    if over:
        lines += [
            "",
            "Paired difference front - server in ms (on arms without a proxy front and server are the same: "
            "the noise floor). Residual = TTFT minus the server's prompt_ms, which takes the prefill's own "
            "variation out; target for the proxy: residual p50 at most 1 ms, p99 at most 3 ms.",
            "",
        ]
        lines += _table(
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
                    _n(o.get("residual_ms_p50"), "{:.2f}"),
                    _n(o.get("residual_ms_p90"), "{:.2f}"),
                    _n(o.get("residual_ms_p99"), "{:.2f}"),
                    _n(o["ttft_ms_p50"], "{:.2f}"),
                    _n(o["ttft_ms_p90"], "{:.2f}"),
                    _n(o["e2e_ms_p50"], "{:.2f}"),
                    _n(o["e2e_ms_p90"], "{:.2f}"),
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
        lines += _table(
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
                    " / ".join(_n(v, "{:.2f}") for v in f["ttft_sorted_s"]),
                    _s(f["last_ttft_s"]),
                    _s(f["total_s"]),
                    str(f["errors"]),
                    " / ".join(_x(v) for v in f.get("ttft_sorted_vs_legacy") or []),
                    _x(f.get("last_ttft_vs_legacy")),
                    _x(f.get("total_vs_legacy")),
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


def render_kvctl_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Benchmark: kvctl",
        "",
        "KV moves through the proxy's mover against a numpy memcpy of the same bytes.",
        "`server ms` is the wall time of the /kvctl call; `loop ms` the part of it on the server's main loop "
        "(what it reports as `t_ms`: other slots wait for it); `total ms` adds the proxy's side (payload file "
        "read / build). `device MB/s` is the server's copy alone (`loop ms`): device-to-host for an "
        "export, host-to-device for an import where the KV is on a device. Probe: a tiny generation on "
        "another slot.",
        "",
    ]
    kv = report.get("kv") or {}
    if kv:
        on_host = kv.get("on_host")
        memory = "" if on_host is None else " (host memory)" if on_host else " (device memory)"
        where = ", ".join(kv.get("devices") or []) or "unknown"
        backends = ", ".join(kv.get("backends") or []) or "unknown"
        lines += [
            f"KV on {where}, backend {backends}{memory}" + (f": {kv['unknown']}" if kv.get("unknown") else "")
        ]
    learned = report.get("learned") or {}
    if learned:
        lines += [
            f"Move rates the mover learned ({learned.get('moves')} moves): export (device-to-host) "
            f"{_n(learned.get('export_mb_s'), '{:.0f}')} MB/s, import (host-to-device) "
            f"{_n(learned.get('import_mb_s'), '{:.0f}')} MB/s",
        ]
    if kv or learned:
        lines += [""]
    rows = []
    for s in report["sizes"]:
        for op in ("export", "import"):
            o = s[op]
            rows.append(
                [
                    str(s["tokens"]),
                    op,
                    _mib(s["bytes"]),
                    _n(o["total_ms_p50"], "{:.1f}"),
                    _n(o["server_ms_p50"], "{:.1f}"),
                    _n(o.get("loop_ms_p50"), "{:.1f}"),
                    _n(o["mb_s"], "{:.0f}"),
                    _n(o.get("device_mb_s"), "{:.0f}"),
                    _n(s["memcpy_mb_s"], "{:.0f}"),
                    _n(o.get("probe_ms"), "{:.1f}"),
                    _n(report.get("probe_idle_ms"), "{:.1f}"),
                ]
            )
    lines += _table(
        [
            "tokens",
            "op",
            "payload",
            "total ms p50",
            "server ms p50",
            "loop ms p50",
            "MB/s",
            "device MB/s",
            "memcpy MB/s",
            "probe ms during",
            "probe ms idle",
        ],
        rows,
    )
    return "\n".join(lines) + "\n"


def render_capacity_markdown(report: dict[str, Any]) -> str:
    wl, search, arms = report["workload"], report["search"], report["capacity"]
    ideal = search.get("ideal") or {}
    n = wl.get("requests")
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
    lines += [
        f"Host caches {search.get('host_cache', 'off')}. Prompts of {search.get('prompt_tokens')} tokens, "
        f"common prefix {search.get('shared_tokens')} tokens. Lower bound (one prompt plus its generation) "
        f"{search.get('lower')} cells; `-c` searched from {search['grid'][0]} to {search['grid'][1]} in steps "
        f"of {search.get('step')}, a fresh arm per probe. llama.cpp rounds the pool up to a multiple of 256 "
        "cells: figures are the cells allocated.",
        "",
        f"In theory: {ideal.get('unshared_cells')} cells with every prompt held whole, "
        f"{ideal.get('shared_cells')} with the common prefix held once: a saving of "
        f"{_n(ideal.get('saving_pct'), '{:.1f}')} %.",
        "",
        f"*Served together*: every request answered in full and at least {search.get('min_together')} of the "
        f"{n} in the server at once (the capacity comparable across arms). *Any order*: every request answered "
        "in full, even one after the other (the proxy queues requests on a slot holding their prefix when "
        "the pool cannot hold them together).",
        "",
    ]
    rows = []
    for name, a in arms.items():
        anyo = a.get("any_order") or {}
        rows.append(
            [
                name,
                _n(a.get("min_cells")),
                _n(a.get("min_ctx")),
                _n(a.get("max_failed_cells")),
                _n(a.get("saving_vs_legacy_pct"), "{:.1f} %"),
                _n(anyo.get("min_cells")),
                _n(anyo.get("saving_vs_legacy_pct"), "{:.1f} %"),
                str(len(a.get("probes", []))),
                str(a.get("started", "-")),
            ]
        )
    lines += _table(
        [
            "arm",
            "smallest pool, together (cells)",
            "at -c",
            "largest failed (cells)",
            "saving vs legacy",
            "smallest pool, any order",
            "saving vs legacy",
            "probes",
            "arms started",
        ],
        rows,
    )
    for name, a in arms.items():
        for label, part in (("together", a), ("any order", a.get("any_order") or {})):
            if part.get("failed_above_cells"):
                lines += [
                    "",
                    f"**{name}, {label}: not monotone.** Larger pools failed "
                    f"({', '.join(str(c) for c in part['failed_above_cells'])} cells) than the smallest that "
                    "passed: the binary search assumes they do not, so this figure is where the search "
                    "ended, not necessarily the smallest pool that passes.",
                ]
    lines += [
        "",
        "Probes in order (reused: same pool as an earlier probe, not run again; at once: most requests "
        "in the server at one time):",
        "",
    ]
    prow = []
    for name, a in arms.items():
        for p in a.get("probes", []):
            prow.append(
                [
                    name,
                    str(p["ctx"]),
                    _n(p.get("cells")),
                    "served" if p["ok"] else "failed",
                    _n(p.get("together")),
                    "yes" if p.get("reused") else "",
                    _n(p.get("ttft_max_s"), "{:.2f}"),
                    _n(p.get("prompt_n")),
                    _n(p.get("cache_n")),
                    _n(p.get("kv_cells_used")),
                    ", ".join(f"{k} {v}" for k, v in sorted((p.get("routes") or {}).items())),
                    str(p.get("reason", "")).replace("|", "/"),
                ]
            )
    lines += _table(
        [
            "arm",
            "-c",
            "cells",
            "verdict",
            "at once",
            "reused",
            "max TTFT",
            "prompt_n",
            "cache_n",
            "KV used after",
            "routes",
            "reason",
        ],
        prow,
    )
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
