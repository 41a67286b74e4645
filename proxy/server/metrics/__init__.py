"""Metrics: every Prometheus family of the proxy, on one injected registry (docs/observability.md).

The bottom layer of ``proxy.server``: every package above records into it, and it imports
none of them (only ``proxy.core`` and ``proxy.errors``, for the label values). Used through
this module, like the coordinator: ``metrics`` (``Metrics``, the families), ``labels`` (the
label values each family starts with at 0), ``tiers`` (the disk tier's families), ``remote`` (the remote tier's).
"""

from __future__ import annotations

from proxy.server.metrics.labels import (
    ARENA_PATHS,
    DIRECTIONS,
    FALLBACK_CAUSES,
    REJECT_REASONS,
    ROUTES,
    SHARE_PATHS,
)
from proxy.server.metrics.metrics import Metrics
from proxy.server.metrics.remote import RemoteMetrics
from proxy.server.metrics.tiers import DEMOTE_FAILURES, DROP_CAUSES, DiskMetrics

__all__ = [
    "ARENA_PATHS",
    "DEMOTE_FAILURES",
    "DIRECTIONS",
    "DROP_CAUSES",
    "FALLBACK_CAUSES",
    "REJECT_REASONS",
    "ROUTES",
    "SHARE_PATHS",
    "DiskMetrics",
    "Metrics",
    "RemoteMetrics",
]
