"""Routing decisions as typed records: kept for ``radixctl routes``, counted, logged.

A ``Divergence`` (state.py) says where the longest prefix held anywhere (a slot, a resident owner,
the host tree) stopped matching the prompt, with the token windows around that position
(shown as text by ``radixctl routes``). A ``Decision`` is one request's outcome.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from proxy.core.planner import Route
from proxy.errors import FallbackCause
from proxy.server.coordinator.state import Divergence, Lease
from proxy.server.metrics import SHARE_PATHS, Metrics

if TYPE_CHECKING:
    from proxy.server.coordinator.scan import PrefixScan

log = logging.getLogger("radix")

WHY_CONTEXT = 16  # tokens kept on each side of the divergence
DECISIONS_KEPT = 1000


@dataclass(frozen=True)
class Decision:
    time: float
    request_id: str
    route: Route
    server: str
    slot: int
    prompt_tokens: int
    predicted_cached: int
    cached: int | None  # as the server reported (timings.cache_n); None when it did not say
    prefilled: int | None
    ttft_s: float | None
    queued_s: float
    fallback: FallbackCause | None
    status: int
    why: Divergence
    restore_s: float = 0.0  # KV moves before the answer (making room, attach, import)
    lock_wait_s: float = 0.0  # of which waiting for the server's move lock
    import_s: float = 0.0  # of which the host import
    prefix_wait_s: float = 0.0  # before planning, waiting for a request in flight with its prefix

    def summary(self) -> dict[str, Any]:
        """The flat fields of the admin API (the token windows are rendered separately)."""
        return {
            "time": self.time,
            "request_id": self.request_id,
            "route": self.route.value,
            "server": self.server,
            "slot": self.slot,
            "prompt_tokens": self.prompt_tokens,
            "predicted_cached": self.predicted_cached,
            "cached": self.cached,
            "prefilled": self.prefilled,
            "ttft_s": self.ttft_s,
            "queued_s": self.queued_s,
            "prefix_wait_s": self.prefix_wait_s,
            "restore_s": self.restore_s,
            "lock_wait_s": self.lock_wait_s,
            "import_s": self.import_s,
            "fallback": self.fallback.value if self.fallback else None,
            "status": self.status,
            "host_match": self.why.host_match,
            "best_slot_match": self.why.best_slot_match,
            "diverge_at": self.why.at,
            "diverge_source": self.why.source,
        }


def divergence(found: PrefixScan) -> Divergence:
    tokens = found.tokens
    held: list[tuple[int, str, np.ndarray]] = []
    for sv in found.servers:
        server = sv.server
        held += [
            (n, f"slot {server.name}/{s.slot_id}", s.tokens)
            for s, n in zip(server.slots, sv.slot_lcp, strict=True)
        ]
        if server.sharing is not None:
            entries = server.sharing.index.entries
            held += [
                (r.lcp, f"resident {server.name}/{r.owner_id}", entries[r.owner_id].tokens)
                for r in sv.residents
            ]
    best, where, holder = max(held, key=lambda h: h[0], default=(0, None, np.zeros(0, np.int32)))
    best_slot = max((n for n, what, _ in held if what.startswith("slot")), default=0)
    host_len = found.host.length
    at = max(host_len, best)
    lo, hi = max(0, at - WHY_CONTEXT), at + WHY_CONTEXT
    from_holder = best >= host_len and best > 0
    return Divergence(
        host_match=host_len,
        best_slot_match=best_slot,
        at=at,
        source=where if from_holder else ("host" if host_len else None),
        ctx_from=lo,
        request_ctx=tuple(tokens[lo:hi].tolist()),
        cached_ctx=tuple(holder[lo:hi].tolist()) if from_holder else None,
    )


class DecisionLog:
    """The last decisions, the per-request metrics and the per-request log line."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=DECISIONS_KEPT)

    def add(
        self, lease: Lease, timings: dict[str, Any] | None, ttft_s: float | None, status: int
    ) -> Decision:
        cached = int(timings.get("cache_n", 0)) if timings else None
        prefilled = int(timings.get("prompt_n", 0)) if timings else None
        if lease.prefix_step_tokens and cached is not None and prefilled is not None:
            # A wave's head computed part of its prompt in a prefix step: the server counts
            # those tokens as reused by the answer; they were computed for it.
            step = min(lease.prefix_step_tokens, cached)
            cached, prefilled = cached - step, prefilled + step
        decision = Decision(
            time=time.time(),
            request_id=lease.request_id,
            route=lease.route,
            server=lease.server.name,
            slot=lease.slot.slot_id,
            prompt_tokens=len(lease.tokens),
            predicted_cached=0 if lease.fallback else lease.plan.predicted_cached,
            cached=cached,
            prefilled=prefilled,
            ttft_s=ttft_s,
            queued_s=lease.queued_s,
            fallback=lease.fallback,
            status=status,
            why=lease.why,
            restore_s=lease.restore_s,
            lock_wait_s=lease.lock_wait_s,
            import_s=lease.import_s,
            prefix_wait_s=lease.prefix_wait_s,
        )
        self.decisions.append(decision)
        self._count(decision, time.monotonic() - lease.started)
        log.info(
            "request %s route=%s server=%s slot=%d prompt=%d predicted=%d cached=%s prefilled=%s "
            "ttft_ms=%s prefix_wait_ms=%.0f queued_ms=%.0f restore_ms=%.0f lock_wait_ms=%.0f import_ms=%.0f diverge_at=%s status=%d%s",
            decision.request_id,
            decision.route,
            decision.server,
            decision.slot,
            decision.prompt_tokens,
            decision.predicted_cached,
            cached,
            prefilled,
            f"{ttft_s * 1000:.0f}" if ttft_s is not None else "-",
            decision.prefix_wait_s * 1000,
            decision.queued_s * 1000,
            decision.restore_s * 1000,
            decision.lock_wait_s * 1000,
            decision.import_s * 1000,
            decision.why.at,
            status,
            f" fallback={decision.fallback}" if decision.fallback else "",
        )
        return decision

    def _count(self, d: Decision, e2e_s: float) -> None:
        m = self.metrics
        m.requests.labels(d.route, d.server).inc()
        m.queue_wait.labels(d.server).observe(d.queued_s)
        m.e2e.labels(d.route, d.server).observe(e2e_s)
        if d.ttft_s is not None:
            m.ttft.labels(d.route, d.server).observe(d.ttft_s)
        m.prompt_tokens.inc(d.prompt_tokens)
        m.predicted_cached.inc(d.predicted_cached)
        path = SHARE_PATHS[d.route]
        m.share_path_requests[path].inc()
        if d.cached is not None and d.prefilled is not None:
            m.share_path_tokens[path].inc(d.cached)
            m.cached_tokens.inc(d.cached)
            m.prefilled_tokens.inc(d.prefilled)
            m.route_tokens.labels(d.route).inc(d.cached)

    def since(self, since: float, after: float) -> list[Decision]:
        return [d for d in self.decisions if d.time >= since and d.time > after]
