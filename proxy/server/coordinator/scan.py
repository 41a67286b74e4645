"""One look at everything cached that a request's tokens could reuse, computed once.

The fan-out wait, the planner and the divergence report all need each slot's and each
resident prefix's common prefix with the request, and the host tree's match. A scan is
taken synchronously (no ``await``), so it describes one consistent state; it is taken
again only after an ``await`` may have changed that state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proxy.core.checkpoints import Checkpoint, CheckpointStore
from proxy.core.planner import ResidentView
from proxy.core.prefix import common_prefix
from proxy.core.radix import HostMatch, RadixTree
from proxy.server.coordinator.state import ServerState, SlotState


@dataclass(frozen=True)
class ServerScan:
    server: ServerState
    slot_lcp: tuple[int, ...]  # per slot, in slot order: common prefix with the request
    residents: tuple[ResidentView, ...]  # resident prefixes sharing at least one token
    checkpoint: Checkpoint | None = None  # moves off: the longest whole-state checkpoint it can restore

    def best_idle(self) -> int:
        """Longest prefix available now on this server (an idle slot or a resident prefix)."""
        idle = [n for s, n in zip(self.server.slots, self.slot_lcp, strict=True) if not s.busy]
        return max(idle + [r.lcp for r in self.residents], default=0)


@dataclass(frozen=True)
class PrefixScan:
    tokens: np.ndarray
    ns: str  # the request's cache-isolation namespace: nothing of another one is counted
    host: HostMatch  # an estimate (not yet counted as a hit): see RadixTree.touch
    servers: tuple[ServerScan, ...]

    def best_available(self) -> int:
        return max([self.host.length] + [s.best_idle() for s in self.servers])


def _reusable(server: ServerState, slot: SlotState, tokens: np.ndarray) -> int:
    """How much of the request the slot's KV serves. A recurrent state cannot be cut: when the
    request parts from the slot's tokens, the server goes back to its latest context checkpoint
    at or before the parting point (or to nothing), not to the parting point itself."""
    lcp = common_prefix(slot.tokens, tokens)
    if not server.checkpoints or len(slot.tokens) <= lcp < len(tokens):
        return lcp
    # Parted, or nothing left to compute (the server needs one token): an earlier checkpoint.
    return max((n for n in slot.checkpoints if n <= lcp and n < len(tokens)), default=0)


def scan(
    tokens: np.ndarray,
    servers: list[ServerState],
    tree: RadixTree,
    ns: str = "",
    checkpoints: CheckpointStore | None = None,
) -> PrefixScan:
    out = []
    for server in servers:
        lcps = tuple(_reusable(server, s, tokens) if s.ns == ns else 0 for s in server.slots)
        residents = server.sharing.index.views(tokens, ns) if server.sharing is not None else ()
        whole = (
            checkpoints.match(ns, server.compat_id, tokens)
            if checkpoints is not None and server.checkpoints
            else None
        )
        out.append(ServerScan(server, lcps, residents, whole))
    return PrefixScan(tokens, ns, tree.match(tokens, touch=False, ns=ns), tuple(out))
