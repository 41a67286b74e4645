"""The one owner of mutable state: slot tables, the host radix tree, the wait queue.

Every mutation is one synchronous method, so no half-changed structure survives an
``await``. KV moves to one server are serialized by that server's lock; a host path in
use is pinned before an ``await`` and unpinned in ``finally``. Plans are made on pure
data, the I/O is done, and state is committed only after the server confirmed.

By job: ``leases`` (who gets which slot, the FIFO queue), ``fanout`` (the wait for a request
in flight holding a longer prefix), ``waves`` (a wave's prefix step), ``moves`` (a plan's KV
moves), ``saves`` (saving after the answer), ``decisions`` (typed records, metrics, the log
line), ``scan`` (each request's common prefixes, computed once), ``state``.

Above ``tiers``, ``dataplane`` and ``metrics``, which it may import (servers and movers
mostly through the Protocols of ``dataplane.ports``); nothing of ``http``, ``ops`` or ``api``.
"""

from __future__ import annotations

from proxy.server.coordinator.coordinator import Coordinator
from proxy.server.coordinator.decisions import Decision
from proxy.server.coordinator.moves import RestoreAbandoned
from proxy.server.coordinator.state import Divergence, KvPlace, Lease, ServerState, SlotState

__all__ = [
    "Coordinator",
    "Decision",
    "Divergence",
    "KvPlace",
    "Lease",
    "RestoreAbandoned",
    "ServerState",
    "SlotState",
]
