"""report.md of `radixctl bench kvctl`: moves through the mover against memcpy, main-loop stalls."""

from __future__ import annotations

from typing import Any

from proxy.bench.markdown import fmt_mib, fmt_n, md_table


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
            f"{fmt_n(learned.get('export_mb_s'), '{:.0f}')} MB/s, import (host-to-device) "
            f"{fmt_n(learned.get('import_mb_s'), '{:.0f}')} MB/s",
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
                    fmt_mib(s["bytes"]),
                    fmt_n(o["total_ms_p50"], "{:.1f}"),
                    fmt_n(o["server_ms_p50"], "{:.1f}"),
                    fmt_n(o.get("loop_ms_p50"), "{:.1f}"),
                    fmt_n(o["mb_s"], "{:.0f}"),
                    fmt_n(o.get("device_mb_s"), "{:.0f}"),
                    fmt_n(s["memcpy_mb_s"], "{:.0f}"),
                    fmt_n(o.get("probe_ms"), "{:.1f}"),
                    fmt_n(report.get("probe_idle_ms"), "{:.1f}"),
                ]
            )
    lines += md_table(
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
    parallel = [s for s in report["sizes"] if s.get("parallel_import")]
    if parallel:
        lines += [
            "",
            "Imports into different slots at once (as the proxy's restores into different slots run): "
            "the server's main loop copies them in turn; each one's checks on an HTTP thread, its "
            "payload's mapping and its round trip overlap the others'.",
            "",
        ]
        lines += md_table(
            ["tokens", "slots", "wall ms p50", "one after the other ms", "speedup", "MB/s", "memcpy MB/s"],
            [
                [
                    str(s["tokens"]),
                    str(s["parallel_import"]["slots"]),
                    fmt_n(s["parallel_import"]["wall_ms_p50"], "{:.1f}"),
                    fmt_n(s["parallel_import"]["serial_ms"], "{:.1f}"),
                    fmt_n(s["parallel_import"]["speedup"], "{:.2f}x"),
                    fmt_n(s["parallel_import"]["mb_s"], "{:.0f}"),
                    fmt_n(s["memcpy_mb_s"], "{:.0f}"),
                ]
                for s in parallel
            ],
        )
    return "\n".join(lines) + "\n"
