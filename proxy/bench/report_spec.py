"""Speculative decoding's part of a report: for arms whose servers run a draft model
(``--server-arg --model-draft ...``), the tokens drafted and accepted (llama-server's own
``timings.draft_n`` and ``draft_n_accepted``) and the acceptance rate. A restored slot whose
draft KV were missing or stale would show as a lower rate than stock's on the same requests."""

from __future__ import annotations

from typing import Any

from proxy.bench.markdown import fmt_n, md_table


def acceptance(arm: dict[str, Any]) -> float | None:
    drafted, accepted = arm.get("draft_n"), arm.get("draft_n_accepted")
    return accepted / drafted if drafted and accepted is not None else None


def render_speculation(arms: dict[str, dict[str, Any]]) -> list[str]:
    rows = [
        [name, fmt_n(a.get("draft_n")), fmt_n(a.get("draft_n_accepted")), fmt_n(acceptance(a), "{:.3f}")]
        for name, a in arms.items()
        if a.get("draft_n")
    ]
    if not rows:
        return []
    lines = ["", "Speculative decoding (the servers' draft model), over the answered requests:", ""]
    return lines + md_table(["arm", "drafted tokens", "accepted", "acceptance"], rows)
