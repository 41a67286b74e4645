"""The wait for a request in flight that holds a longer prefix (fan-out, a session's next turn,
a wave's prefix step): which request to wait for, for how long, and whether waiting beats
computing the prefix side by side. Part of :class:`~proxy.server.coordinator.leases.Leases`,
whose state it reads (``leases.py``)."""

from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np

from proxy.config import Config
from proxy.core.checkpoints import CheckpointStore
from proxy.core.prefix import common_prefix
from proxy.core.radix import RadixTree
from proxy.core.routing import CostModel, compute_s, slowdown, time_to_answer_s, worth_waiting
from proxy.server.coordinator.scan import PrefixScan, scan
from proxy.server.coordinator.state import Lease, ServerState
from proxy.server.coordinator.waves import patience_s


class PrefixWaits:
    """The prefix waits of :class:`~proxy.server.coordinator.leases.Leases` (its state, below)."""

    config: Config
    servers: list[ServerState]
    tree: RadixTree
    checkpoints: CheckpointStore | None
    inflight: dict[str, Lease]
    saving: dict[str, Lease]
    waiting_for_prefix: int
    cost_model: CostModel

    async def _wait_for_shared_prefix(
        self, tokens: np.ndarray, ns: str, scanned: PrefixScan | None = None
    ) -> PrefixScan:
        """Wait for a request in flight that holds a much longer prefix of this one than
        anything available now, then reuse it instead of computing it again: a session's
        next turn waits the few milliseconds its previous turn needs to save; requests that
        arrive together with a common prefix compute it once (the others wait for the first
        one's answer, then restore it) when that wait is shorter than computing it side by
        side (``_worth_waiting``); and with sharing on (fan-out), k requests sharing a prefix
        on a cold server compute it once. Returns the scan of the state the wait ended in."""
        start = time.monotonic()
        while True:
            found = (
                scanned
                if scanned is not None
                else scan(tokens, self.servers, self.tree, ns, self.checkpoints)
            )
            scanned = None  # after a wait the state may have changed: scan again
            hit = self._blocker(found)
            if hit is None:
                return found
            blocker, patience, split = hit
            left = start + patience - time.monotonic()
            if left <= 0:
                return found
            self.waiting_for_prefix += 1
            blocker.split_waiters += split
            try:
                await asyncio.wait_for(blocker.wake.wait(), left)
            except TimeoutError:
                pass
            finally:
                self.waiting_for_prefix -= 1
                blocker.split_waiters -= split

    def _blocker(self, found: PrefixScan) -> tuple[Lease, float, bool] | None:
        """The request in flight to wait for, and for how long at most (from the start of the
        wait): ``fanout_wait_s`` for one finishing or with sharing on; for one still computing
        it, twice what computing the prefix would take at the speed the blocker shows (a blocker
        slower than its estimate means the server is: computing it now would be as slow), within
        ``queue_timeout_s``."""
        tokens = found.tokens
        if len(tokens) == 0:
            return None
        gain = self.config.min_restore_tokens
        available = found.best_available()
        best, hit, split = 0, None, False
        for lease in itertools.chain(self.inflight.values(), self.saving.values()):
            if lease.ns != found.ns:
                continue
            shared = min(common_prefix(lease.tokens, tokens), len(tokens) - 1)
            if shared <= best:
                continue
            if lease.finishing or self.config.kv_share:
                best, hit, split = shared, (lease, self.config.fanout_wait_s), False
            elif lease.splittable and self._worth_splitting(lease, shared, available):
                # A wave's head not sent yet: it computes the shared part alone first, sooner
                # than its whole answer (waves.py).
                patience = patience_s(lease, shared, self.cost_model, self.config.queue_timeout_s)
                best, hit, split = shared, (lease, patience), True
            elif (compute_s := self._worth_waiting(lease, shared - available)) is not None:
                best, hit, split = shared, (lease, min(2 * compute_s, self.config.queue_timeout_s)), False
        if hit is None or best < gain or best < available + gain:
            return None
        if split:
            hit[0].split_to = max(hit[0].split_to, best)
        return (*hit, split)

    def _worth_splitting(self, head: Lease, shared: int, available: int) -> bool:
        """Whether waiting for ``head`` to compute the ``shared`` prefix alone (its prefix step)
        and then restoring it beats computing it side by side now (on the least busy server
        of the model, as ``_worth_waiting`` weighs it)."""
        server = head.server
        gain = shared - available
        if not server.moves or gain <= 0:
            return False
        step_s = compute_s(max(0, shared - head.plan.predicted_cached), 0, server.rates, self.cost_model)
        restore_bytes = gain * server.mover.bytes_per_token
        running = self._least_running(server)
        return worth_waiting(gain, step_s, restore_bytes, running, server.rates, self.cost_model)

    def _worth_waiting(self, lease: Lease, gain: int) -> float | None:
        """The seconds computing this request's ``gain`` more prefix tokens now, side by side
        with it, would take, when waiting for its answer (its KV is saved right after) is
        shorter; else None. Estimated from the server's measured rates; an answer of unknown
        length is never waited for."""
        if gain <= 0 or lease.n_predict <= 0:
            return None
        server = lease.server
        computed = len(lease.tokens) - lease.plan.predicted_cached
        elapsed = time.monotonic() - lease.started
        wait_s = time_to_answer_s(computed, lease.n_predict, elapsed, server.rates)
        restore_bytes = gain * server.mover.bytes_per_token
        running = self._least_running(server)
        if not worth_waiting(gain, wait_s, restore_bytes, running, server.rates, self.cost_model):
            return None
        # A blocker slower than its estimate shows the server's real speed now: computing the
        # prefix would be as slow, so the patience grows with it (within --queue-timeout).
        slower = slowdown(computed, lease.n_predict, elapsed, server.rates)
        return compute_s(gain, running, server.rates, self.cost_model) * slower

    def _least_running(self, server: ServerState) -> int:
        """The load a prefix computed now would run beside: that of the least busy server of
        ``server``'s model (another may be idle: then it is computed there, at full speed,
        rather than waited for)."""
        peers = [s for s in self.servers if s.healthy and s.model == server.model]
        return min((self._running(s) for s in peers), default=self._running(server))

    def _running(self, server: ServerState) -> int:
        """Requests computing on the server now. A slot still busy saving a finished answer (an
        export of tens of milliseconds) is not load: counting it would send the next wave of
        requests to whichever server happened to finish saving first."""
        return sum(1 for lease in self.inflight.values() if lease.server is server and not lease.finishing)
