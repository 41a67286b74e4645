"""The label values of the proxy's metric families, each series created at 0 from the start
(``Metrics`` initialises every value listed here), and the names of the pool gauges."""

from __future__ import annotations

from proxy.core.planner import Route
from proxy.errors import FallbackCause, RejectReason

ROUTES = tuple(r.value for r in Route)
# The reference implementation's per-path families; a mixed route (A+H, S+H) counts under
# h, the host restore being the part that reached furthest.
SHARE_PATHS = {
    Route.A: "a",
    Route.S: "s",
    Route.H: "h",
    Route.AH: "h",
    Route.SH: "h",
    Route.PREFILL: "prefill",
}
FALLBACK_CAUSES = tuple(c.value for c in FallbackCause)
DIRECTIONS = ("export", "import")
ARENA_PATHS = ("in_place", "staged", "file")
ARENA_FULL_DIRECTIONS = (*DIRECTIONS, "promote")  # promote: a disk tier read
ARENA_STATES = ("capacity", "used", "quarantined")
REJECT_REASONS = tuple(r.value for r in RejectReason)
APIS = (
    "chat",
    "completions",
    "messages",
    "responses",
    "infill",
    "embeddings",
    "rerank",
)  # the client APIs of steered requests

# GET /kvctl/cells field -> pool gauge (all per server, in KV cells).
POOL_FIELDS = {
    "n_cells": "kv_cache_total_cells",
    "used": "kv_cache_used_cells",
    "slot": "kv_cache_slot_cells",
    "owner": "kv_cache_owner_cells",
    "owner_only": "kv_cache_owner_only_cells",
    "logical": "kv_cache_business_logical_cells",
}
POOL_HELP = {
    "n_cells": "Cells in the server's unified KV pool",
    "used": "Non-empty cells of the server's KV pool",
    "slot": "Cells held by at least one slot",
    "owner": "Cells held by at least one owner sequence (resident prefixes)",
    "owner_only": "Cells held by owner sequences and no slot",
    "logical": "Sum over sequences of the cells each holds (a cell shared by k sequences counts k times)",
}
