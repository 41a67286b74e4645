"""Leases and the wait queue: which request gets which slot, and when.

A request gets a slot at once when nobody is queued and a plan exists, else it waits in a
FIFO queue that every release serves from the front. Planning and leasing are one
synchronous step, so a slot is never given twice. A request that shares a much longer
prefix with a request still in flight waits for it first (``_blocker``, ``fanout.py``).

Every wait is bounded: the queue holds at most ``max_queue`` requests (429 past it), a
queued request gets a slot within ``queue_timeout_s`` or a 503, and the wait for a request
holding the prefix ends after ``fanout_wait_s`` whatever happened. Servers that are down
get no new leases.

A slot whose answer is done and whose save is not worth waiting for (``finishing``) may be
taken by a request that finds no idle slot: the save's lease ends there (``_take``), and the
save stops before it touches the slot again (``saves.py``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from proxy.config import Config
from proxy.core.adapters import NO_ADAPTERS, Adapters
from proxy.core.admission import check_reservations
from proxy.core.checkpoints import CheckpointStore
from proxy.core.planner import Plan, PlanInput, Route, SlotView
from proxy.core.planner import plan as choose_plan
from proxy.core.radix import RadixTree
from proxy.core.routing import (
    CostModel,
    ServerLoad,
    choose_server,
)
from proxy.errors import BadRequest, RejectReason, TooManyRequests, Unavailable
from proxy.server.coordinator.decisions import divergence
from proxy.server.coordinator.fanout import PrefixWaits
from proxy.server.coordinator.scan import PrefixScan, ServerScan, scan
from proxy.server.coordinator.state import EMPTY, Lease, ServerState, SlotState, prompt_cells
from proxy.server.dataplane.kvctl import Tokenized


@dataclass
class _Waiter:
    request_id: str
    tokens: np.ndarray
    ns: str
    future: asyncio.Future[Lease]
    since: float
    want: _Want


@dataclass(frozen=True)
class _Want:
    """What routing needs besides the tokens: which model, whose session, how long an answer."""

    model: str = ""  # "" (unit tests): any server
    session: str = ""
    n_predict: int = 0
    adapters: Adapters = NO_ADAPTERS  # the request's LoRA scales (in its namespace already)
    # A request with media, as a server with a projector tokenized it (None: text only): only a
    # multimodal server takes it, and among slots holding its tokens a slot that served the same
    # media after them is preferred (``_media_match``).
    media: Tokenized | None = None

    @property
    def media_ids(self) -> tuple[str, ...]:
        return tuple(m.id for m in self.media.media) if self.media is not None else ()


AFFINITY_MAX = 65536  # sessions remembered for the affinity tie-break (least recent forgotten)


def session_key(session: str) -> str:
    """What the affinity map keeps of an ``X-Session-Id``: a 16-byte digest, so the map holds
    32 characters per session whatever a client sends (up to 8 KB) and no client's raw id."""
    return hashlib.blake2b(session.encode(), digest_size=16).hexdigest() if session else ""


class Leases(PrefixWaits):
    def __init__(
        self,
        config: Config,
        servers: list[ServerState],
        tree: RadixTree,
        on_reject: Callable[[RejectReason], None] = lambda reason: None,
        checkpoints: CheckpointStore | None = None,
        on_take: Callable[[Lease], None] = lambda lease: None,
    ) -> None:
        self.config = config
        self.servers = servers
        self.tree = tree
        self.checkpoints = checkpoints  # whole-state checkpoints of servers with moves off
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self.inflight: dict[str, Lease] = {}
        # Answers handed on before their save's insert (the slot went on, the KV is on its way
        # to the tree): a request arriving now waits for it as for one in flight (``_blocker``).
        self.saving: dict[str, Lease] = {}
        self.waiting_for_prefix = 0
        self.closed = False
        self.on_reject = on_reject  # counts a refused request by reason (metrics)
        self.on_take = on_take  # counts a slot taken while its save was pending (metrics)
        self.cost_model = CostModel()
        self._affinity: collections.OrderedDict[str, str] = collections.OrderedDict()
        n_slots = sum(len(s.slots) for s in servers)
        self.max_queue = config.max_queue or 4 * n_slots

    def queued(self) -> int:
        return sum(not w.future.done() for w in self._waiters)

    def waiting(self) -> int:
        """Requests waiting for a slot or for a request that holds their prefix."""
        return self.queued() + self.waiting_for_prefix

    def _refuse(self, reason: RejectReason, exc: Exception) -> Exception:
        self.on_reject(reason)
        return exc

    async def acquire(
        self,
        request_id: str,
        tokens: np.ndarray,
        ns: str = "",
        *,
        model: str = "",
        session: str = "",
        n_predict: int = 0,
        scanned: PrefixScan | None = None,
        adapters: Adapters = NO_ADAPTERS,
        media: Tokenized | None = None,
    ) -> Lease:
        """A leased slot and its plan; waits in a fair FIFO queue while every slot is busy.
        ``ns``: the request's cache-isolation namespace (see ``RadixTree``); ``model``: only
        servers of this model ("" = any); ``session``: the affinity tie-break; ``scanned``: the
        request's prefix scan when the caller just took it (no ``await`` since); ``media``: the
        request's tokenization by a server with a projector (``tokens`` are its keyed part)."""
        want = _Want(model, session_key(session), n_predict, adapters, media)
        limit = min((s.n_ctx_slot for s in self.servers if not model or s.model == model), default=0)
        if len(tokens) >= limit:
            raise BadRequest(
                f"the request exceeds the available context size: {len(tokens)} prompt tokens, "
                f"{limit} per slot"
            )
        self._admit()
        waited = time.monotonic()
        found = await self._wait_for_shared_prefix(tokens, ns, scanned)
        waited = time.monotonic() - waited
        if self.closed:
            raise self._refuse(RejectReason.SHUTTING_DOWN, Unavailable("the proxy is shutting down"))
        if not self.queued_for(want.model):
            lease = self._plan_and_lease(request_id, found, want)
            if lease is not None:
                lease.prefix_wait_s = waited
                return lease
        waiter = _Waiter(
            request_id, tokens, ns, asyncio.get_running_loop().create_future(), time.monotonic(), want
        )
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.config.queue_timeout_s):
                lease = await waiter.future
        except (asyncio.CancelledError, TimeoutError) as exc:
            self._abandon(waiter)
            if isinstance(exc, TimeoutError):
                raise self._refuse(
                    RejectReason.QUEUE_TIMEOUT,
                    Unavailable(f"no slot became free within {self.config.queue_timeout_s:g} s"),
                ) from None
            raise
        lease.queued_s = time.monotonic() - waiter.since
        lease.prefix_wait_s = waited
        return lease

    def _admit(self) -> None:
        if self.closed:
            raise self._refuse(RejectReason.SHUTTING_DOWN, Unavailable("the proxy is shutting down"))
        if self.waiting() >= self.max_queue:
            raise self._refuse(
                RejectReason.QUEUE_FULL,
                TooManyRequests(f"too many requests waiting ({self.waiting()}); retry shortly"),
            )

    def _abandon(self, waiter: _Waiter) -> None:
        """A queued request gave up: leave the queue, or give back a slot granted meanwhile."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            self.release(waiter.future.result())
        elif not waiter.future.done():
            waiter.future.cancel()

    def _plan_and_lease(self, request_id: str, found: PrefixScan, want: _Want = _Want()) -> Lease | None:
        """Pick server, slot and route on pure data, and mark the slot busy (synchronous).
        Each server's planner gives its best plan (one with a host restore also its plan
        without it); the routing cost model picks the server and, so, whether to restore."""
        plans: list[tuple[Plan, ServerScan]] = []
        loads: list[ServerLoad] = []
        for sv in found.servers:
            server = sv.server
            if not server.healthy or (want.model and server.model != want.model):
                continue
            if want.media is not None and (not server.media_marker or server.media_keys != want.media.keys):
                continue  # no projector (it refuses media), or one keying media otherwise
            inp = self._plan_input(sv, found, want.media_ids)
            plan = choose_plan(inp)
            if plan is None:
                continue
            loads.append(self._load(len(plans), plan, server, found, want))
            plans.append((plan, sv))
            if plan.host_to > plan.host_from:
                # The host restore priced against computing those tokens on the same server
                # (at its measured import rate): listed after it, so it wins a tie.
                alt = choose_plan(replace(inp, host_len=0, host_whole=False))
                if alt is not None:
                    loads.append(self._load(len(plans), alt, server, found, want))
                    plans.append((alt, sv))
        chosen = choose_server(loads, self.cost_model)
        if chosen is None:
            return None
        plan, sv = plans[chosen.index]
        server = sv.server
        if want.session:
            self._affinity[want.session] = server.name
            self._affinity.move_to_end(want.session)
            if len(self._affinity) > AFFINITY_MAX:
                self._affinity.popitem(last=False)
        host = found.host
        self.tree.touch(host)
        slot = server.slots[plan.slot_id]
        took_saving = slot.saver is not None
        if took_saving:
            self._take(slot)
        slot.busy = True
        slot.gen += 1
        # A host restore comes from the tree's segments, or with moves off from a checkpoint.
        uses_host = plan.host_to > plan.host_from and server.moves
        checkpoint = sv.checkpoint if plan.host_to > plan.host_from and not server.moves else None
        if uses_host:
            self.tree.pin(host)
            server.move_lock.planned()  # requests sent from now on wait for its import
        if checkpoint is not None and self.checkpoints is not None:
            self.checkpoints.touch(checkpoint)
        lease = Lease(
            request_id,
            server,
            slot,
            plan,
            found.tokens,
            host if uses_host else None,
            why=divergence(found),
            checkpoint=checkpoint,
            route=plan.route,
            ns=found.ns,
            adapters=want.adapters,
            epoch=server.epoch,
            erase_first=slot.ns != found.ns
            and (slot.ns is None or len(slot.tokens) > 0 or slot.unrecorded > 0),
            n_predict=want.n_predict,
            media=want.media,
            media_ids=want.media_ids,
            gen=slot.gen,
            took_saving=took_saving,
        )
        # A prefix step computes token ids: not a prompt whose keyed tokens name media.
        lease.splittable = not bool((found.tokens < 0).any())
        # What the slot holds from now on is this request's: its namespace, once a slot holding
        # another key's KV is erased (unknown until moves._erase confirms it).
        slot.ns = None if lease.erase_first else found.ns
        if plan.owner_id is not None and server.sharing is not None:
            server.sharing.index.pin(plan.owner_id)
            lease.owner_pinned = True
        lease.planned_restore = uses_host
        self.inflight[request_id] = lease
        return lease

    def _load(
        self, index: int, plan: Plan, server: ServerState, found: PrefixScan, want: _Want
    ) -> ServerLoad:
        """The numbers the routing cost model prices for this server's plan."""
        # The chosen slot's own KV past what the plan keeps is dropped: those cells count as free.
        slot = server.slots[plan.slot_id]
        kept = plan.reuse_len if plan.route in (Route.A, Route.AH) else 0
        n_prompt = prompt_cells(len(found.tokens), want.media)
        return ServerLoad(
            index=index,
            n_prompt=n_prompt,
            cached=plan.predicted_cached,
            moved_bytes=(plan.host_to - plan.host_from) * server.mover.bytes_per_token,
            inline=server.mover.shm_dir is None,
            import_bytes_per_s=server.rates.import_bytes_per_s,
            busy_slots=self._running(server),
            free_cells=server.free_cells_estimate() + max(0, len(slot.tokens) - kept),
            n_predict=min(want.n_predict, max(0, server.n_ctx_slot - n_prompt)),
            healthy=server.healthy,
            affinity=bool(want.session) and self._affinity.get(want.session) == server.name,
        )

    def _plan_input(self, sv: ServerScan, found: PrefixScan, media: tuple[str, ...] = ()) -> PlanInput:
        server = sv.server
        # A slot only being saved (not worth waiting for) is offered when no slot is idle.
        takeable = not any(not s.busy for s in server.slots)
        views = tuple(
            SlotView(
                s.slot_id,
                not s.busy or (takeable and s.saver is not None),
                lcp,
                len(s.tokens),
                s.last_used,
                _media_match(s, lcp, len(found.tokens), media),
            )
            for s, lcp in zip(server.slots, sv.slot_lcp, strict=True)
        )
        return PlanInput(
            n_prompt=len(found.tokens),
            slots=views,
            host_len=found.host.length
            if server.moves
            else (sv.checkpoint.n_tokens if sv.checkpoint is not None else 0),
            host_whole=not server.moves,
            residents=sv.residents,
            policy=self.config.kv_share_route,
            min_restore_tokens=self.config.min_restore_tokens,
            share_enabled=server.sharing is not None and server.moves,
        )

    def finishing(self, lease: Lease, takeable_cells: int | None) -> None:
        """The answer is done; its save starts. A save not worth waiting for (``takeable_cells``:
        the most KV cells the slot can hold now) leaves the slot to a request that finds no idle
        one: until the save reads it back, the slot is recorded as holding no known tokens and
        at most that many cells."""
        lease.finishing, lease.splittable = True, False
        slot = lease.slot
        if takeable_cells is None or not slot.busy or slot.gen != lease.gen:
            return
        lease.takeable = True
        # At most what the answer can have left, or what the slot held if the request never ran.
        held = max(takeable_cells, len(slot.tokens) + slot.unrecorded)
        slot.tokens, slot.unrecorded, slot.saver = EMPTY, held, lease
        self.grant_waiters()

    def offer(self, lease: Lease) -> None:
        """The save's export is on its way: the slot may be taken by a request that finds no idle
        one (what it holds is known: read back). Nothing if it was handed on already."""
        slot = lease.slot
        if lease.handed_on or not slot.busy or slot.gen != lease.gen or slot.saver is lease:
            return
        slot.saver = lease
        self.grant_waiters()

    def _take(self, slot: SlotState) -> None:
        """A request takes a slot whose save was not worth waiting for: that save's lease ends
        here (the save sees ``handed_on`` and leaves the slot alone from now on)."""
        old = slot.saver
        assert old is not None and old.slot is slot
        slot.saver = None
        old.handed_on = True
        self.on_take(old)
        try:
            old.unpin(self.tree)
        finally:
            self._end(old, done=False)  # its save sets ``done`` when it ends (the export may land)

    def release(self, lease: Lease, done: bool = True) -> None:
        """Give the slot back and hand it to the first waiter that can use a slot now.
        ``done=False``: requests waiting for this one's prefix (``lease.done``) keep waiting
        (its save sets it once the tree has the KV)."""
        lease.slot.busy = False
        lease.slot.saver = None
        lease.slot.last_used = time.monotonic()
        try:
            lease.unpin(self.tree)
        finally:
            self._end(lease, done)
            self.grant_waiters()

    def _end(self, lease: Lease, done: bool = True) -> None:
        lease.end_planned_restore()
        lease.server.admission_ended(lease)
        if lease.epoch != lease.server.epoch:  # the server restarted under this lease: contents unknown
            lease.slot.tokens, lease.slot.ns = EMPTY, None
        self.inflight.pop(lease.request_id, None)
        if done:
            self.saving.pop(lease.request_id, None)
            lease.set_done()
        else:
            self.saving[lease.request_id] = lease

    def saved(self, lease: Lease) -> None:
        """Its save ended (the tree has what it could insert): waiters look again."""
        self.saving.pop(lease.request_id, None)
        lease.set_done()

    def queued_for(self, model: str) -> bool:
        """Someone waits for a slot this request could take (FIFO within a model)."""
        return any(not w.future.done() and _overlaps(w.want.model, model) for w in self._waiters)

    def grant_waiters(self) -> None:
        """Hand free slots to the queue, in order within each model, while plans exist (after a
        release, or when a server came back). A model whose front waiter gets no plan is skipped,
        so requests for one model never wait behind requests for another."""
        blocked: set[str] = set()
        for waiter in list(self._waiters):
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            if any(_overlaps(waiter.want.model, m) for m in blocked):
                continue
            found = scan(waiter.tokens, self.servers, self.tree, waiter.ns, self.checkpoints)
            granted = self._plan_and_lease(waiter.request_id, found, waiter.want)
            if granted is None:
                blocked.add(waiter.want.model)
                continue
            self._waiters.remove(waiter)
            waiter.future.set_result(granted)

    def check_invariants(self) -> None:
        """Each server's reserved cells are its unfinished leases' (see ``check_reservations``)."""
        for server in self.servers:
            parts = [
                (x.reserved_cells, x.admitted_cells) for x in self.inflight.values() if x.server is server
            ]
            # A request sent past the queue deadline may oversubscribe the books on purpose.
            overdue = any(x.overdue for x in self.inflight.values() if x.server is server)
            n_cells = 0 if overdue else server.n_cells
            check_reservations(n_cells, server.reserved_cells, server.admitted_cells, parts)

    def close(self) -> None:
        """Shutting down: no new leases, and every queued request gets a 503 now."""
        self.closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                self.on_reject(RejectReason.SHUTTING_DOWN)
                waiter.future.set_exception(Unavailable("the proxy is shutting down"))


def _overlaps(a: str, b: str) -> bool:
    """Two requests may compete for the same slots ("" = any model)."""
    return not a or not b or a == b


def _media_match(slot: SlotState, lcp: int, n_text: int, media: tuple[str, ...]) -> int:
    """How many of the request's leading media parts the slot's last request with media had
    right after the same text: the server's own reuse (route A) goes on through those (it
    matches media chunks by content hash). A tie-break between slots, never a prediction."""
    if not media or not slot.media or lcp != n_text or len(slot.tokens) != n_text:
        return 0
    n = 0
    for mine, theirs in zip(media, slot.media, strict=False):
        if mine != theirs:
            break
        n += 1
    return n
