"""Where each route's requests waited in the proxy before their forward: for a slot (queued),
for a request in flight with their prefix, for the server's move lock, and the whole restore
(``X-Radix-Waits-Ms``, read by the runner). A report field of its own, next to the routes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.bench.stats import percentile
from proxy.traffic.runner import RequestResult

KINDS = ("queued", "prefix", "lock", "restore")


def route_waits(results: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    """route -> {"n", and per kind "<kind>_ms": {"mean", "p50", "p90", "max"}}; {} for an arm
    whose answers carry no waits (stock llama-server)."""
    by_route: dict[str, list[dict[str, float]]] = {}
    for r in results:
        if r.route and r.waits_ms:
            by_route.setdefault(r.route, []).append(r.waits_ms)
    out: dict[str, dict[str, Any]] = {}
    for route, waits in sorted(by_route.items()):
        entry: dict[str, Any] = {"n": len(waits)}
        for kind in KINDS:
            values = [w[kind] for w in waits if kind in w]
            entry[f"{kind}_ms"] = {
                "mean": sum(values) / len(values) if values else None,
                "p50": percentile(values, 50),
                "p90": percentile(values, 90),
                "max": max(values) if values else None,
            }
        out[route] = entry
    return out


def waits_markdown(arms: dict[str, dict[str, Any]]) -> list[str]:
    """The waits table of every arm that has them (mean / p90 / max in ms)."""
    rows: list[list[str]] = []
    for name, arm in arms.items():
        for route, w in (arm.get("waits") or {}).items():
            cells = [name, route, str(w["n"])]
            for kind in KINDS:
                s = w[f"{kind}_ms"]
                cells.append(" / ".join(_ms(s[k]) for k in ("mean", "p90", "max")))
            rows.append(cells)
    if not rows:
        return []
    header = ["arm", "route", "n", *(f"{k} ms (mean / p90 / max)" for k in KINDS)]
    return [
        "",
        "Waits in the proxy before the forward, per route (X-Radix-Waits-Ms): queued for a slot, "
        "for a request in flight with the prefix, for the server's move lock (part of the "
        "restore), the whole restore.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"
