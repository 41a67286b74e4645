"""The one owner of mutable state: slot tables, the host radix tree, the wait queue.

Every mutation is one synchronous method, so no half-changed structure survives an
``await``. KV moves to one server are serialized by that server's lock; a host path in
use is pinned before an ``await`` and unpinned in ``finally``. Plans are made on pure
data, the I/O is done, and state is committed only after the server confirmed.

By job: ``leases`` (who gets which slot, the FIFO queue, the fan-out wait), ``moves``
(a plan's KV moves, saving after the answer), ``decisions`` (typed records, metrics,
the log line), ``scan`` (each request's common prefixes, computed once), ``state``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from proxy.config import Config
from proxy.core.radix import RadixTree
from proxy.server.coordinator.decisions import Decision, DecisionLog, Divergence
from proxy.server.coordinator.leases import Leases
from proxy.server.coordinator.moves import KvMoves
from proxy.server.coordinator.state import Lease, ServerState, SlotState
from proxy.server.metrics import Metrics


class Coordinator:
    def __init__(self, config: Config, servers: list[ServerState], tree: RadixTree, metrics: Metrics) -> None:
        self.config = config
        self.servers = servers
        self.tree = tree
        self.metrics = metrics
        self.leases = Leases(config, servers, tree)
        self.moves = KvMoves(config, tree, metrics)
        self.log = DecisionLog(metrics)

    async def acquire(self, request_id: str, tokens: np.ndarray, ns: str = "") -> Lease:
        """A slot for the request, with its plan (may wait: see ``Leases.acquire``)."""
        return await self.leases.acquire(request_id, tokens, ns)

    async def restore(self, lease: Lease, n_predict: int) -> None:
        await self.moves.restore(lease, n_predict)

    async def finish(self, lease: Lease) -> None:
        """After the answer: save what the tree lacks, then release the slot on every path."""
        try:
            await self.moves.save(lease)
        finally:
            self.leases.release(lease)

    def release(self, lease: Lease) -> None:
        self.leases.release(lease)

    def record(self, lease: Lease, timings: dict[str, Any] | None, ttft_s: float | None, status: int) -> Decision:
        return self.log.record(lease, timings, ttft_s, status)


__all__ = ["Coordinator", "Decision", "Divergence", "Lease", "ServerState", "SlotState"]
