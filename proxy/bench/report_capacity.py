"""report.md of `radixctl bench capacity`: the smallest KV pool that serves the wave, per arm."""

from __future__ import annotations

from typing import Any

from proxy.bench.markdown import fmt_n, md_table


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
        f"{fmt_n(ideal.get('saving_pct'), '{:.1f}')} %.",
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
                fmt_n(a.get("min_cells")),
                fmt_n(a.get("min_ctx")),
                fmt_n(a.get("max_failed_cells")),
                fmt_n(a.get("saving_vs_legacy_pct"), "{:.1f} %"),
                fmt_n(anyo.get("min_cells")),
                fmt_n(anyo.get("saving_vs_legacy_pct"), "{:.1f} %"),
                str(len(a.get("probes", []))),
                str(a.get("started", "-")),
            ]
        )
    lines += md_table(
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
                    fmt_n(p.get("cells")),
                    "served" if p["ok"] else "failed",
                    fmt_n(p.get("together")),
                    "yes" if p.get("reused") else "",
                    fmt_n(p.get("ttft_max_s"), "{:.2f}"),
                    fmt_n(p.get("prompt_n")),
                    fmt_n(p.get("cache_n")),
                    fmt_n(p.get("kv_cells_used")),
                    ", ".join(f"{k} {v}" for k, v in sorted((p.get("routes") or {}).items())),
                    str(p.get("reason", "")).replace("|", "/"),
                ]
            )
    lines += md_table(
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
