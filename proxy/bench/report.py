"""Figures per arm, the ratio to Legacy, and the report files (JSON, markdown, PNG charts).

Charts are drawn only if matplotlib can be imported; it is not a dependency, and without it
the markdown says the charts were skipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.bench.runner import RequestResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


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
        "requests": len(results), "errors": len(results) - len(ok),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p90_s": percentile(e2e, 90),
        "wall_s": wall, "requests_per_s": len(ok) / wall if wall > 0 else None,
        "generated_tokens_per_s": generated / wall if wall > 0 and generated is not None else None,
        "cache_n": _sum([r.cache_n for r in ok]), "prompt_n": _sum([r.prompt_n for r in ok]),
        "generated_tokens": generated,
    }


def _groups(results: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    out: dict[str, list[RequestResult]] = {}
    for r in results:
        out.setdefault(r.group, []).append(r)
    return {g: {k: v for k, v in summarize(rs).items()
                if k in ("requests", "errors", "ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "cache_n", "prompt_n")}
            for g, rs in out.items()}


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
    return {"pairs": len(full), "ttft_ms_p50": percentile(d_ttft, 50), "ttft_ms_p90": percentile(d_ttft, 90),
            "e2e_ms_p50": percentile(d_e2e, 50), "e2e_ms_p90": percentile(d_e2e, 90),
            "residual_ms_p50": percentile(d_res, 50), "residual_ms_p90": percentile(d_res, 90),
            "target_p50_ms": 2.0}


def _residual_ms(r: RequestResult) -> float | None:
    if r.ttft_s is None or r.prompt_ms is None:
        return None
    return 1000 * r.ttft_s - r.prompt_ms


def build_report(workload: dict[str, Any], arms: dict[str, dict[str, Any]],
                 settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """``arms``: name -> {"results": [RequestResult], "stats": {...}} in run order."""
    out: dict[str, Any] = {"workload": workload, "settings": settings or {}, "arms": {}}
    for name, arm in arms.items():
        results: list[RequestResult] = arm["results"]
        stats = dict(arm.get("stats") or {})
        entry = {**summarize(results), "host_cache_bytes": stats.pop("host_cache_bytes", None),
                 "kv_cells_used": stats.pop("kv_cells_used", None), "groups": _groups(results), "details": stats}
        routes: dict[str, int] = {}
        for r in results:
            if r.route:
                routes[r.route] = routes.get(r.route, 0) + 1
        if routes:
            entry["routes"] = routes
        overhead = paired_overhead(results)
        if overhead:
            entry["overhead"] = overhead
        out["arms"][name] = entry
    legacy = out["arms"].get("legacy")
    for entry in out["arms"].values():
        for key in ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "e2e_p90_s"):
            entry[f"{key[:-2]}_vs_legacy"] = _ratio(entry[key], legacy[key]) if legacy else None
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
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(row) + " |" for row in rows]]


def render_markdown(report: dict[str, Any], chart_note: str = "") -> str:
    wl, arms = report["workload"], report["arms"]
    lines = [f"# Benchmark: {wl.get('name')}", "", str(wl.get("description", "")), "",
             "Workload: " + ", ".join(f"{k}={v}" for k, v in (wl.get("params") or {}).items()), ""]
    if report.get("settings"):
        lines += ["Arms share: " + ", ".join(f"{k}={v}" for k, v in report["settings"].items()), ""]
    lines += ["Times in seconds; ratios are arm / Legacy (below 1 is faster).", ""]
    rows = [[name, str(a["requests"]), str(a["errors"]), _s(a["ttft_p50_s"]), _s(a["ttft_p90_s"]),
             _s(a["e2e_p50_s"]), _s(a["e2e_p90_s"]), _n(a["requests_per_s"], "{:.2f}"),
             _n(a["generated_tokens_per_s"], "{:.1f}"), _n(a["cache_n"]), _n(a["prompt_n"]),
             _mib(a["host_cache_bytes"]), _n(a["kv_cells_used"]), _x(a["ttft_p50_vs_legacy"]),
             _x(a["e2e_p50_vs_legacy"])] for name, a in arms.items()]
    lines += _table(["arm", "n", "err", "TTFT p50", "TTFT p90", "e2e p50", "e2e p90", "req/s", "gen tok/s",
                     "cache_n", "prompt_n", "host cache", "KV cells", "TTFT vs legacy", "e2e vs legacy"], rows)
    groups = list(dict.fromkeys(g for a in arms.values() for g in a["groups"]))
    if len(groups) > 1:
        lines += ["", "TTFT p50 (s) by group, and cache_n / prompt_n:", ""]
        grows = [[g, *[f"{_s(a['groups'].get(g, {}).get('ttft_p50_s'))} ({_n(a['groups'].get(g, {}).get('cache_n'))}"
                       f" / {_n(a['groups'].get(g, {}).get('prompt_n'))})" for a in arms.values()]] for g in groups]
        lines += _table(["group", *arms], grows)
    over = {n: a["overhead"] for n, a in arms.items() if "overhead" in a}
    if over:
        lines += ["", "Paired difference front - server in ms (on arms without a proxy front and server are the same: "
                  "the noise floor). Residual = TTFT minus the server's prompt_ms, which takes the prefill's own "
                  "variation out; target for the proxy: residual p50 < 2 ms.", ""]
        lines += _table(["arm", "pairs", "residual p50", "residual p90", "TTFT p50", "TTFT p90", "e2e p50", "e2e p90"],
                        [[n, str(o["pairs"]), _n(o.get("residual_ms_p50"), "{:.2f}"),
                          _n(o.get("residual_ms_p90"), "{:.2f}"), _n(o["ttft_ms_p50"], "{:.2f}"),
                          _n(o["ttft_ms_p90"], "{:.2f}"), _n(o["e2e_ms_p50"], "{:.2f}"), _n(o["e2e_ms_p90"], "{:.2f}")]
                         for n, o in over.items()])
    routes = {n: a["routes"] for n, a in arms.items() if a.get("routes")}
    for name, r in routes.items():
        lines += ["", f"{name} routes: " + ", ".join(f"{k} {v}" for k, v in sorted(r.items()))]
    if chart_note:
        lines += ["", chart_note]
    return "\n".join(lines) + "\n"


def render_kvctl_markdown(report: dict[str, Any]) -> str:
    lines = ["# Benchmark: kvctl", "", "KV moves through the proxy's mover against a numpy memcpy of the same bytes.",
             "`server ms` is the wall time of the /kvctl call (the server's main loop is busy for it); `total ms` adds "
             "the proxy's side (payload file parse / build). Probe: a tiny generation on another slot.", ""]
    rows = []
    for s in report["sizes"]:
        for op in ("export", "import"):
            o = s[op]
            rows.append([str(s["tokens"]), op, _mib(s["bytes"]), _n(o["total_ms_p50"], "{:.1f}"),
                         _n(o["server_ms_p50"], "{:.1f}"), _n(o["mb_s"], "{:.0f}"), _n(s["memcpy_mb_s"], "{:.0f}"),
                         _n(o.get("probe_ms"), "{:.1f}"), _n(report.get("probe_idle_ms"), "{:.1f}")])
    lines += _table(["tokens", "op", "payload", "total ms p50", "server ms p50", "MB/s", "memcpy MB/s",
                     "probe ms during", "probe ms idle"], rows)
    return "\n".join(lines) + "\n"


def _charts(report: dict[str, Any], out_dir: Path) -> tuple[list[Path], str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "Charts skipped: matplotlib is not installed (it is not a dependency; `pip install matplotlib`)."
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
            ax.bar([g + k * width for g in range(len(groups))],
                   [arms[n]["groups"].get(gr, {}).get("ttft_p50_s") or 0 for gr in groups], width, label=n)
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
    md = render_kvctl_markdown(report) if "sizes" in report else render_markdown(report, note)
    (out_dir / "report.md").write_text(md)
    return [out_dir / "report.json", out_dir / "report.md", *written]
