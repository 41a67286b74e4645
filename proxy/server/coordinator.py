"""The one owner of mutable state: slot tables, the host radix tree, the wait queue.

Every mutation is one synchronous method, so no half-changed structure survives an
``await``. KV moves to one server are serialized by that server's lock; a host path in
use is pinned before an ``await`` and unpinned in ``finally``. Plans are made on pure
data, the I/O is done, and state is committed only after the server confirmed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from proxy.config import Config
from proxy.core.planner import Plan, PlanInput, Route, SlotView
from proxy.core.planner import plan as choose_plan
from proxy.core.radix import HostMatch, RadixTree
from proxy.core.resident import common_prefix
from proxy.errors import BadRequest, KvMoveError
from proxy.server.backend import Backend
from proxy.server.metrics import SHARE_PATHS, Metrics
from proxy.server.mover import KvMover
from proxy.server.sharing import Sharing

log = logging.getLogger("radix")

_EMPTY = np.zeros(0, dtype=np.int32)


@dataclass
class SlotState:
    slot_id: int
    tokens: np.ndarray = field(default_factory=lambda: _EMPTY)  # exactly what its KV holds
    busy: bool = False
    last_used: float = 0.0


@dataclass
class ServerState:
    name: str
    backend: Backend
    mover: KvMover
    slots: list[SlotState]
    n_ctx_slot: int
    sharing: Sharing | None = None
    move_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def busy_count(self) -> int:
        return sum(s.busy for s in self.slots)


@dataclass
class Lease:
    """One request's hold on one slot, from plan to release."""

    request_id: str
    server: ServerState
    slot: SlotState
    plan: Plan
    tokens: np.ndarray
    host: HostMatch | None
    queued_s: float = 0.0
    route: str = ""
    fallback: str = ""
    owner_pinned: bool = False
    finishing: bool = False  # the answer is complete; the slot is being saved
    why: dict[str, Any] = field(default_factory=dict)  # where cached prefixes stopped matching, at plan time
    started: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Waiter:
    request_id: str
    tokens: np.ndarray
    future: asyncio.Future[Lease]
    since: float


class Coordinator:
    def __init__(self, config: Config, servers: list[ServerState], tree: RadixTree, metrics: Metrics) -> None:
        self.config = config
        self.servers = servers
        self.tree = tree
        self.metrics = metrics
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._inflight: dict[str, Lease] = {}
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(maxlen=1000)

    # ---- acquiring a slot ------------------------------------------------------------

    async def acquire(self, request_id: str, tokens: np.ndarray) -> Lease:
        """A leased slot and its plan; waits in a fair FIFO queue while every slot is busy."""
        limit = min(s.n_ctx_slot for s in self.servers)
        if len(tokens) >= limit:
            raise BadRequest(f"the request exceeds the available context size: {len(tokens)} prompt tokens, "
                             f"{limit} per slot")
        await self._wait_for_shared_prefix(tokens)
        if not self._waiters:
            lease = self._plan_and_lease(request_id, tokens)
            if lease is not None:
                return lease
        waiter = _Waiter(request_id, tokens, asyncio.get_running_loop().create_future(), time.monotonic())
        self._waiters.append(waiter)
        try:
            lease = await waiter.future
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result())
            raise
        lease.queued_s = time.monotonic() - waiter.since
        return lease

    async def _wait_for_shared_prefix(self, tokens: np.ndarray) -> None:
        """Wait for a request in flight that holds a much longer prefix of this one than
        anything available now, then reuse it instead of computing it again: a session's
        next turn waits the few milliseconds its previous turn needs to save; and with
        sharing on (fan-out), k requests sharing a prefix on a cold server compute it once."""
        if len(tokens) == 0:
            return
        while True:
            blocker = self._fanout_blocker(tokens)
            if blocker is None:
                return
            await blocker.done.wait()

    def _fanout_blocker(self, tokens: np.ndarray) -> Lease | None:
        gain = self.config.min_restore_tokens
        best, blocker = 0, None
        for lease in self._inflight.values():
            if not (lease.finishing or self.config.kv_share):
                continue
            shared = min(common_prefix(lease.tokens, tokens), len(tokens) - 1)
            if shared > best:
                best, blocker = shared, lease
        if blocker is None or best < gain:
            return None
        have = self.tree.match(tokens, touch=False).length
        for server in self.servers:
            have = max([have] + [common_prefix(s.tokens, tokens) for s in server.slots if not s.busy])
            if server.sharing is not None:
                have = max([have] + [v.lcp for v in server.sharing.index.views(tokens)])
        return blocker if best >= have + gain else None

    def _plan_and_lease(self, request_id: str, tokens: np.ndarray) -> Lease | None:
        """Pick server, slot and route on pure data, and mark the slot busy (synchronous)."""
        host = self.tree.match(tokens)
        best: tuple[Plan, ServerState] | None = None
        for server in self.servers:
            plan = choose_plan(self._plan_input(server, tokens, host.length))
            if plan is None:
                continue
            if best is None or (plan.predicted_cached, -server.busy_count()) > (
                    best[0].predicted_cached, -best[1].busy_count()):
                best = (plan, server)
        if best is None:
            return None
        plan, server = best
        slot = server.slots[plan.slot_id]
        slot.busy = True
        uses_host = plan.host_to > plan.host_from
        if uses_host:
            self.tree.pin(host)
        lease = Lease(request_id, server, slot, plan, tokens, host if uses_host else None, route=plan.route.value,
                      why=self._divergence(tokens, host.length))
        if plan.owner_id is not None and server.sharing is not None:
            server.sharing.index.pin(plan.owner_id)
            lease.owner_pinned = True
        self._inflight[request_id] = lease
        return lease

    def _plan_input(self, server: ServerState, tokens: np.ndarray, host_len: int) -> PlanInput:
        views = tuple(SlotView(s.slot_id, not s.busy, common_prefix(s.tokens, tokens), len(s.tokens), s.last_used)
                      for s in server.slots)
        sharing = server.sharing
        residents = sharing.index.views(tokens) if sharing is not None else ()
        return PlanInput(n_prompt=len(tokens), slots=views, host_len=host_len, residents=residents,
                         policy=self.config.kv_share_route, min_restore_tokens=self.config.min_restore_tokens,
                         share_enabled=sharing is not None, mixed_enabled=self.config.mixed_restore)

    def release(self, lease: Lease) -> None:
        """Give the slot back and hand it to the first waiter that can use a slot now."""
        lease.slot.busy = False
        lease.slot.last_used = time.monotonic()
        self._unpin(lease)
        self._inflight.pop(lease.request_id, None)
        lease.done.set()
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.future.done():
                self._waiters.popleft()
                continue
            granted = self._plan_and_lease(waiter.request_id, waiter.tokens)
            if granted is None:
                break
            self._waiters.popleft()
            waiter.future.set_result(granted)

    # ---- KV moves --------------------------------------------------------------------

    async def restore(self, lease: Lease, n_predict: int) -> None:
        """Do the plan's KV moves into the leased slot; on failure fall back to prefill."""
        plan, slot, server = lease.plan, lease.slot, lease.server
        try:
            async with server.move_lock:
                if server.sharing is not None:
                    need = len(lease.tokens) - plan.predicted_cached + n_predict
                    await server.sharing.ensure_free(need)
                if plan.route in (Route.S, Route.SH) and server.sharing is not None and plan.owner_id is not None:
                    await server.sharing.attach(plan.owner_id, slot.slot_id, plan.reuse_len)
                    slot.tokens = lease.tokens[:plan.reuse_len].copy()
                if lease.host is not None:
                    await self._import_host(lease)
        except KvMoveError as exc:
            # The server removed what it wrote and cleared the slot's tokens.
            slot.tokens = _EMPTY
            lease.fallback = exc.cause
            lease.route = Route.PREFILL.value
            self.metrics.fallbacks.labels(exc.cause).inc()
            log.warning("restore into %s slot %d failed, prefilling: %s", server.name, slot.slot_id, exc)
        finally:
            self._unpin(lease)

    async def _import_host(self, lease: Lease) -> None:
        assert lease.host is not None
        # On top of the slot's verified [0,p0) (the server drops whatever it holds past p0).
        p0, p1 = lease.plan.host_from, lease.plan.host_to
        segments = self.tree.segments(lease.host, p0, p1)
        await lease.server.mover.import_(lease.slot.slot_id, p0, lease.tokens[:p1].tolist(), segments)
        lease.slot.tokens = lease.tokens[:p1].copy()
        self.tree.record_load(p1 - p0)
        self.metrics.tree_loads.inc()

    def _unpin(self, lease: Lease) -> None:
        if lease.host is not None:
            self.tree.unpin(lease.host)
            lease.host = None
        if lease.owner_pinned and lease.server.sharing is not None and lease.plan.owner_id is not None:
            lease.server.sharing.index.unpin(lease.plan.owner_id)
            lease.owner_pinned = False

    async def finish(self, lease: Lease) -> None:
        """After the answer: learn what the slot holds, save what the tree lacks, release."""
        lease.finishing = True
        try:
            await self._refresh_slot(lease)
            await self._save(lease)
            await self._share(lease)
        except Exception as exc:  # a failed save loses a future hit, never an answer
            cause = exc.cause if isinstance(exc, KvMoveError) else "transport"
            self.metrics.fallbacks.labels(cause).inc()
            log.warning("saving %s slot %d failed: %s", lease.server.name, lease.slot.slot_id, exc)
        finally:
            self.release(lease)

    async def _refresh_slot(self, lease: Lease) -> None:
        slot = lease.slot
        for _ in range(100):
            info = await lease.server.backend.slots(tokens=True)
            entry = next(s for s in info["slots"] if int(s["id"]) == slot.slot_id)
            if not entry.get("busy"):
                break
            await asyncio.sleep(0.02)  # a cancelled request is still winding down
        else:
            slot.tokens = _EMPTY
            return
        tokens = np.asarray(entry.get("tokens", []), dtype=np.int32)
        held = int(entry.get("pos_max", -1)) + 1
        # Invariant 1: only tokens whose KV the sequence really holds count.
        slot.tokens = tokens if held == len(tokens) and int(entry.get("pos_min", 0)) <= 0 else _EMPTY

    async def _save(self, lease: Lease) -> None:
        tokens = lease.slot.tokens
        match = self.tree.match(tokens)
        if len(tokens) - match.length < max(1, self.config.min_restore_tokens // 4):
            return
        # Pinned so the prefix the export continues cannot be evicted while we wait.
        self.tree.pin(match)
        try:
            async with lease.server.move_lock:
                segment = await lease.server.mover.export({"slot": lease.slot.slot_id}, match.length, len(tokens))
            stored = self.tree.insert(tokens, segment)
        finally:
            self.tree.unpin(match)
        self.metrics.tree_saves.inc()
        self.metrics.tree_saved_tokens.inc(stored)

    async def _share(self, lease: Lease) -> None:
        """Record the completed prompt, and a restored host prefix, as resident prefixes."""
        sharing = lease.server.sharing
        if sharing is None:
            return
        tokens = lease.slot.tokens
        sharing.index.slot_changed(lease.slot.slot_id, tokens)
        held = common_prefix(tokens, lease.tokens)
        lengths = [n for n in (len(lease.tokens), lease.plan.host_to) if 0 < n <= held]
        if not lengths or lease.fallback:
            return
        async with lease.server.move_lock:
            await sharing.record(lease.slot.slot_id, tokens, lengths)

    # ---- bookkeeping -----------------------------------------------------------------

    def record(self, lease: Lease, timings: dict[str, Any] | None, ttft_s: float | None, status: int) -> dict[str, Any]:
        """One decision for metrics, logs and `radixctl routes`."""
        cached = int(timings.get("cache_n", 0)) if timings else None
        prefilled = int(timings.get("prompt_n", 0)) if timings else None
        prev = lease.why
        decision = {
            "time": time.time(), "request_id": lease.request_id, "route": lease.route,
            "server": lease.server.name, "slot": lease.slot.slot_id, "prompt_tokens": len(lease.tokens),
            "predicted_cached": lease.plan.predicted_cached if not lease.fallback else 0,
            "cached": cached, "prefilled": prefilled, "ttft_s": ttft_s, "queued_s": lease.queued_s,
            "fallback": lease.fallback or None, "status": status, **prev,
        }
        self.decisions.append(decision)
        m = self.metrics
        m.requests.labels(lease.route, lease.server.name).inc()
        m.queue_wait.labels(lease.server.name).observe(lease.queued_s)
        m.e2e.labels(lease.route, lease.server.name).observe(time.monotonic() - lease.started)
        if ttft_s is not None:
            m.ttft.labels(lease.route, lease.server.name).observe(ttft_s)
        m.prompt_tokens.inc(len(lease.tokens))
        m.predicted_cached.inc(decision["predicted_cached"])
        path = SHARE_PATHS[lease.route]
        m.share_path_requests[path].inc()
        if cached is not None and prefilled is not None:
            m.share_path_tokens[path].inc(cached)
            m.cached_tokens.inc(cached)
            m.prefilled_tokens.inc(prefilled)
            m.route_tokens.labels(lease.route).inc(cached)
        log.info("request %s route=%s server=%s slot=%d prompt=%d predicted=%d cached=%s prefilled=%s "
                 "ttft_ms=%s queued_ms=%.0f diverge_at=%s status=%d%s",
                 lease.request_id, lease.route, lease.server.name, lease.slot.slot_id, len(lease.tokens),
                 decision["predicted_cached"], cached, prefilled,
                 f"{ttft_s * 1000:.0f}" if ttft_s is not None else "-", lease.queued_s * 1000,
                 decision.get("diverge_at"), status, f" fallback={lease.fallback}" if lease.fallback else "")
        return decision

    _WHY_CONTEXT = 16  # tokens kept on each side of the divergence, shown as text by `radixctl routes`

    def _divergence(self, tokens: np.ndarray, host_len: int) -> dict[str, Any]:
        """Where the longest prefix held anywhere (a slot, a resident owner, the host tree)
        stopped matching the prompt, with the token windows around that position."""
        held: list[tuple[int, str, np.ndarray]] = []
        for sv in self.servers:
            held += [(common_prefix(s.tokens, tokens), f"slot {sv.name}/{s.slot_id}", s.tokens) for s in sv.slots]
            if sv.sharing is not None:
                held += [(common_prefix(e.tokens, tokens), f"resident {sv.name}/{e.owner_id}", e.tokens)
                         for e in sv.sharing.index.entries.values()]
        best, where, holder = max(held, key=lambda h: h[0], default=(0, None, _EMPTY))
        best_slot = max((n for n, what, _ in held if what.startswith("slot")), default=0)
        at = max(host_len, best)
        lo, hi = max(0, at - self._WHY_CONTEXT), at + self._WHY_CONTEXT
        from_holder = best >= host_len and best > 0
        return {"host_match": host_len, "best_slot_match": best_slot, "diverge_at": at,
                "diverge_source": where if from_holder else ("host" if host_len else None),
                "ctx_from": lo, "request_ctx": tokens[lo:hi].tolist(),
                "cached_ctx": holder[lo:hi].tolist() if from_holder else None}
