"""The fleet arms' part of a report (``radixctl bench cluster``): per proxy, its requests and
routes, what it took from the shared tier and what it wrote there, and the store's size."""

from __future__ import annotations

from typing import Any

from proxy.bench.markdown import fmt_mib, fmt_n, md_table


def render_fleet(report: dict[str, Any]) -> list[str]:
    rows: list[list[str]] = []
    stores: list[str] = []
    for name, arm in report["arms"].items():
        details = arm.get("details") or {}
        for i, p in enumerate(details.get("per_proxy") or []):
            remote = p.get("remote") or {}
            routes = ", ".join(f"{r} {n}" for r, n in sorted((p.get("by_route") or {}).items()))
            rows.append(
                [
                    f"{name} #{i}",
                    fmt_n(p.get("requests")),
                    routes or "-",
                    fmt_n(remote.get("promotions")) if remote else "-",
                    fmt_n(remote.get("promoted_tokens")) if remote else "-",
                    fmt_n(remote.get("writes")) if remote else "-",
                    _causes(remote.get("fallbacks")) if remote else "-",
                    _causes(remote.get("dropped")) if remote else "-",
                ]
            )
        store = details.get("store")
        if store:
            stores.append(
                f"Store of `{name}` after the run: {fmt_n(store.get('keys'))} entries, "
                f"{fmt_mib(store.get('used_memory_bytes'))} used"
                + (f" ({store['error']})" if store.get("error") else "")
                + "."
            )
    if not rows:
        return []
    lines = ["", "Fleet arms, per proxy (routes as the proxy counted them; the shared tier's figures):", ""]
    lines += md_table(
        ["proxy", "requests", "routes", "from store", "tokens", "writes", "fallbacks", "writes dropped"], rows
    )
    return lines + (["", *stores] if stores else [])


def _causes(counts: dict[str, int] | None) -> str:
    return ", ".join(f"{c} {n}" for c, n in sorted((counts or {}).items())) or "0"
