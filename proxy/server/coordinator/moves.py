"""Executing a plan's KV moves: restore before the answer, save and share after it.

Moves into one slot are serialized by its server's ``move_lock``, and a move that touches
the whole pool (room checks and erases, owner sequences) holds all of it; moves into
different slots run together (movelock.py). State (a slot's tokens, the
tree) is committed only after the server confirmed the move; a failed restore clears the
slot's tokens (the server already dropped what it wrote) and the request is prefilled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from proxy.config import Config
from proxy.core.admission import cells_needed, free_estimate, own_tail
from proxy.core.checkpoints import CheckpointStore
from proxy.core.planner import Route
from proxy.core.radix import RadixTree
from proxy.core.routing import CostModel
from proxy.errors import FallbackCause, KvMoveError, RadixError, RejectReason, Unavailable
from proxy.server.coordinator.movelock import WHOLE
from proxy.server.coordinator.state import EMPTY, Lease
from proxy.server.coordinator.waves import hold_for_wave, prefix_step
from proxy.server.dataplane.backend import TRANSPORT_ERRORS
from proxy.server.dataplane.kvctl import Tokenized
from proxy.server.metrics import Metrics

# What a save may meet that is not a bug: a move the server refused, a server gone.
SAVE_ERRORS: tuple[type[Exception], ...] = (RadixError, *TRANSPORT_ERRORS)

log = logging.getLogger("radix")

WAVE_YIELDS = 3
RESTORES_FIRST_S = 5.0  # a request waits at most this long for other restores before it is sent
BUSY_POLLS = 100  # a cancelled request may still be winding down: poll its slot this often
BUSY_POLL_S = 0.02
CHECKPOINTS_PER_ANSWER = 3  # whole-state checkpoints kept from one answer's prompt, newest first


class RestoreAbandoned(Exception):
    """The server was taken out of routing while a restore waited on it: nothing was sent to
    it for this request, which may be planned again."""


class KvMoves:
    def __init__(
        self,
        config: Config,
        tree: RadixTree,
        metrics: Metrics,
        checkpoints: CheckpointStore | None = None,
        cost_model: CostModel | None = None,
        grant: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.grant = grant  # serve the queue (slots erased for room are free for it)
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self.tree = tree
        self.metrics = metrics
        self.checkpoints = checkpoints if checkpoints is not None else CheckpointStore(tree.budget_bytes)

    async def restore(self, lease: Lease, n_predict: int) -> None:
        """Do the plan's KV moves into the leased slot; on failure fall back to prefill."""
        started = time.monotonic()
        try:
            moves = (
                lease.host is not None
                or lease.checkpoint is not None
                or lease.erase_first
                or lease.plan.route in (Route.S, Route.SH)
            )
            try:
                if moves:
                    await self._unless_down(lease, self._restore(lease, n_predict))
                else:  # a plain request: only the books (room checks have deadlines of their own)
                    await self._restore(lease, n_predict)
            finally:
                lease.end_planned_restore()  # done, or never: others wait for it no more
            # A wave's head waits a moment for the rest of its wave, which may ask it to compute
            # their shared prefix alone first (waves.py); the waiters it wakes plan their
            # restores at once, and it is sent after them (below).
            await hold_for_wave(
                lease, self.config.min_restore_tokens, self.cost_model, enabled=not self.config.kv_share
            )
            if lease.split_to > 0:
                step = prefix_step(
                    lease,
                    self.tree,
                    self.metrics,
                    self.config.min_restore_tokens,
                    self.config.queue_timeout_s,
                )
                await self._unless_down(lease, step)
            # Requests that arrived together (a wave) get a few turns of the loop to reach their
            # own restore before this one is sent (an I/O poll, then their handlers' first step).
            for _ in range(WAVE_YIELDS):
                await asyncio.sleep(0)
            await lease.server.move_lock.restores_done(RESTORES_FIRST_S)
        finally:
            lease.restore_s += time.monotonic() - started

    async def _unless_down(self, lease: Lease, step: Coroutine[Any, Any, None]) -> None:
        """Run a restore step unless the health checks take the server out of routing first: a
        hung server would hold it until its move deadline (30 s and more). Then the step is
        cancelled, what the slot holds is unknown (the server may still finish the move: the slot
        is erased before anyone reuses it), and RestoreAbandoned sends the request back to be
        planned again (another server, or a 503 once the queue deadline passes)."""
        server = lease.server
        task = asyncio.ensure_future(step)
        down = asyncio.ensure_future(server.went_down.wait())
        try:
            await asyncio.wait((task, down), return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))  # wound down; a cancel of this task still propagates
        if not task.cancelled():
            task.result()  # the step's own outcome (its errors included)
            return
        lease.slot.tokens, lease.slot.ns = EMPTY, None
        # Never the server's own reuse now: an erase of another namespace's KV may not have run.
        lease.no_cache, lease.fallback, lease.route = True, FallbackCause.DOWN, Route.PREFILL
        self.metrics.fallbacks.labels(FallbackCause.DOWN).inc()
        raise RestoreAbandoned(
            f"{server.name} was taken out of routing during the restore into slot "
            f"{lease.slot.slot_id} ({server.down_reason})"
        )

    @contextlib.asynccontextmanager
    async def _locked(self, lease: Lease, whole: bool = False) -> AsyncIterator[None]:
        """The server's move lock for a restore step, ahead of queued saves, the wait timed:
        the lease's own slot, or with ``whole`` the whole server (its pool, its owners)."""
        waited = time.monotonic()
        async with lease.server.move_lock.first(WHOLE if whole else lease.slot.slot_id):
            lease.lock_wait_s += time.monotonic() - waited
            yield

    async def _restore(self, lease: Lease, n_predict: int) -> None:
        plan, slot, server = lease.plan, lease.slot, lease.server
        if lease.erase_first and not await self._erase(lease):
            lease.unpin(self.tree)
            return
        attach = (
            plan.route in (Route.S, Route.SH) and server.sharing is not None and plan.owner_id is not None
        )
        try:
            if server.sharing is not None or server.n_cells > 0:
                await self._reserve(lease, n_predict)
            if lease.checkpoint is not None:
                async with self._locked(lease):
                    await self._restore_checkpoint(lease)
                return
            if not (attach or lease.host is not None):
                return  # nothing moves: the server's own reuse does it; the lock is for moves only
            if not attach:
                # Only the server's part under the lock: the payload is written before it.
                async with lease.server.move_lock.restoring():
                    await self._import_host(lease, hold=self._locked(lease))
                return
            async with self._locked(lease, whole=True):  # reads an owner sequence
                if server.sharing is not None and plan.owner_id is not None:
                    await server.sharing.attach(
                        plan.owner_id, slot.slot_id, plan.reuse_len, lease.adapters.as_json()
                    )
                    slot.confirmed(lease.tokens[: plan.reuse_len].copy())
                if lease.host is not None:
                    await self._import_host(lease)
        except KvMoveError as exc:
            # The server removed what it wrote and cleared the slot's tokens.
            slot.tokens = EMPTY
            lease.fallback = exc.cause
            lease.route = Route.PREFILL
            self.metrics.fallbacks.labels(exc.cause).inc()
            log.warning("restore into %s slot %d failed, prefilling: %s", server.name, slot.slot_id, exc)
        finally:
            lease.unpin(self.tree)

    async def _reserve(self, lease: Lease, n_predict: int) -> None:
        """Reserve the KV cells this request will fill (``cells_needed``: its prompt past what
        the slot keeps or attaches, imports included, and its answer) on top of those reserved
        by requests admitted before it and not finished, in the same step as the check that
        they fit. When the proxy's own books show room (no owners, every slot's content known)
        that is all; else it measures the pool and makes room: release owners, then erase idle
        slots (their KV is a cache), then wait for a request in flight to finish. With nothing
        in flight to wait for the request goes ahead (the server then decides); past
        ``queue_timeout_s`` it is refused (503), not sent to run every active slot out of cells."""
        server = lease.server
        need = cells_needed(lease.plan, lease.n_cells_prompt, n_predict, server.n_ctx_slot)
        # Without owners nobody else holds the slot's cells: what it drops on start is room.
        tail = own_tail(lease.slot.tokens, lease.tokens) if server.sharing is None else 0
        if self._fits_unmeasured(lease, need.total - tail):
            server.admit(lease, need)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.queue_timeout_s
        while True:
            try:
                async with self._locked(lease, whole=True):  # measures the pool, erases other slots
                    room = await self._make_room(lease, need.total - tail)
                    if room:
                        server.admit(lease, need)  # no await since the check: nobody counted these
                    freed = server.room_freed  # taken under the lock: no release is missed
            finally:
                # Slots erased for room are idle and empty: a request that queued while they were
                # busy erasing takes one now (after this lease's admission, so its cells are
                # counted), also when measuring the pool failed after an erase.
                self.grant()
            if room:
                return
            if server.reserved_cells == 0:
                log.warning(
                    "%s: no room for %d KV cells of request %s and nothing in flight; sending it",
                    server.name,
                    need.total,
                    lease.request_id,
                )
                server.admit(lease, need)
                return
            if loop.time() >= deadline and server.sharing is None:
                # Without owners the books are conservative: a prompt being computed counts
                # both in the measured pool and in its reservation, and a slot leased by a
                # request not started yet still holds the cache it will drop. Long prefills
                # (minutes on a small CPU) would turn that into refusals of requests the
                # server can serve: past the deadline the server decides, as stock does.
                log.warning(
                    "%s: no room on the books for %d KV cells of request %s within %g s; sending it",
                    server.name,
                    need.total,
                    lease.request_id,
                    self.config.queue_timeout_s,
                )
                self.metrics.room_overdue.inc()
                lease.overdue = True
                server.admit(lease, need)
                return
            if loop.time() >= deadline:
                self.metrics.rejected.labels(RejectReason.NO_ROOM).inc()
                raise Unavailable(
                    f"no room for {need.total} KV cells within {self.config.queue_timeout_s:g} s "
                    "(the requests in flight hold the pool)"
                )
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await freed.wait()
            except TimeoutError:
                pass

    @staticmethod
    def _fits_unmeasured(lease: Lease, need: int) -> bool:
        """Room without asking the server: no owner sequences, no slot of unknown content, and
        ``need`` within the pool less every slot's tokens and every whole reservation."""
        server = lease.server
        if server.sharing is not None or any(s.ns is None for s in server.slots):
            return False
        held = (len(s.tokens) + s.unrecorded for s in server.slots)
        free = free_estimate(server.n_cells, held, server.admitted_cells)
        return free is not None and need <= free

    async def _free_cells(self, lease: Lease, cells: int) -> tuple[bool, int]:
        """Whether ``cells`` are free on top of every reservation (with sharing: plus the
        headroom, releasing owners for it), and the free count measured less the reservations.
        The reservations are read after the measurement: without owners a request can be
        admitted on the proxy's books (no lock) while this one waits for the server."""
        server = lease.server
        if server.sharing is not None:
            ok = await server.sharing.ensure_free(cells + server.reserved_cells)
            last = server.sharing.last_cells
            return ok, (last.free if last is not None else 0) - server.reserved_cells
        free = (await server.backend.cells()).free - server.reserved_cells
        return free >= cells, free

    async def _make_room(self, lease: Lease, cells: int) -> bool:
        """True when ``cells`` plus the headroom are free on top of every reservation (read after
        each measurement), after releasing owners and erasing idle slots, least recently used
        first (under the move lock); also when only the headroom is short: the headroom is kept
        for owners, and stock llama-server would run these requests without it."""
        server = lease.server
        ok, free = await self._free_cells(lease, cells)
        if ok:
            return True
        idle = [
            s for s in server.slots if not s.busy and s is not lease.slot and (len(s.tokens) or s.unrecorded)
        ]
        for slot in sorted(idle, key=lambda s: s.last_used):
            if slot.busy or not (len(slot.tokens) or slot.unrecorded):
                # Leased (or being released) while an earlier slot of the list was erased: its
                # KV is a request's now, not a cache, and its namespace that request's.
                continue
            slot.busy = True  # not leased while the server erases it
            try:
                await server.backend.erase(slot.slot_id)
                slot.confirmed(EMPTY)
                slot.ns = ""
                if server.sharing is not None:
                    server.sharing.index.slot_changed(slot.slot_id, EMPTY)
                self.metrics.room_erases.inc()
            except KvMoveError as exc:
                log.warning("erasing idle %s slot %d for room failed: %s", server.name, slot.slot_id, exc)
                slot.tokens, slot.ns = EMPTY, None  # unknown: erased before anyone reuses it
            except asyncio.CancelledError:
                slot.tokens, slot.ns = EMPTY, None  # the erase may have run: unknown
                raise
            finally:
                slot.busy = False
            ok, free = await self._free_cells(lease, cells)
            if ok:
                return True
        return free >= cells

    async def _erase(self, lease: Lease) -> bool:
        """Clear a slot holding another namespace's KV, so the server cannot reuse it for
        this request. If that fails, the request runs with the server's reuse off."""
        slot, server = lease.slot, lease.server
        try:
            async with self._locked(lease):
                await server.backend.erase(slot.slot_id)
        except KvMoveError as exc:
            lease.fallback, lease.no_cache, lease.route = exc.cause, True, Route.PREFILL
            slot.tokens, slot.ns = EMPTY, None
            self.metrics.fallbacks.labels(exc.cause).inc()
            log.warning(
                "erasing %s slot %d failed, prefilling without reuse: %s", server.name, slot.slot_id, exc
            )
            return False
        slot.confirmed(EMPTY)
        slot.ns = lease.ns
        return True

    async def _import_host(
        self, lease: Lease, hold: contextlib.AbstractAsyncContextManager[None] | None = None
    ) -> None:
        assert lease.host is not None
        # On top of the slot's verified [0,p0) (the server drops whatever it holds past p0); a
        # media chunk moves whole (the server computes one cut by the plan's end).
        p0, p1 = import_range(lease.plan.host_from, lease.plan.host_to, lease.media)
        media: list[dict[str, Any]] = []
        if lease.media is not None:
            media = lease.media.chunks_in(p0, p1)
            if p1 <= p0:
                return  # the host's part ends inside the request's first media chunk past p0
        segments = self.tree.segments(lease.host, p0, p1)  # lease.host is in lease.ns
        mover = lease.server.mover
        # An inline import copies the rows into a request body: bytes held outside the tree.
        inline = 0 if mover.shm_dir else self.tree.reserve(mover.bytes_per_token * (p1 - p0))
        started = time.monotonic()
        try:
            await mover.import_(
                lease.slot.slot_id,
                p0,
                lease.tokens[:p1].tolist(),
                segments,
                hold=hold,
                lora=lease.adapters.as_json(),
                media=media,
            )
        finally:
            self.tree.release(inline)
            lease.import_s += time.monotonic() - started
        lease.slot.confirmed(lease.tokens[:p1].copy())  # the server dropped what it held past p0
        self.tree.record_load(p1 - p0)
        self.metrics.tree_loads.inc()

    async def _restore_checkpoint(self, lease: Lease) -> None:
        """Write a whole-state checkpoint into the slot: it then holds exactly its tokens, and the
        server computes the rest of the prompt from there."""
        cp = lease.checkpoint
        assert cp is not None
        started = time.monotonic()
        try:
            await lease.server.backend.restore(
                lease.slot.slot_id, cp.tokens, cp.data, lease.adapters.as_json()
            )
        finally:
            lease.import_s += time.monotonic() - started
            lease.checkpoint = None
        lease.slot.confirmed(cp.tokens.copy())
        lease.slot.checkpoints = ()  # the server cleared the slot's own
        self.metrics.checkpoint_restores.inc()
        self.metrics.kv_move_bytes.labels("import").inc(len(cp.data))


def import_range(p0: int, p1: int, media: Tokenized | None) -> tuple[int, int]:
    """A host import's ``[p0, p1)`` on a prompt with media: each end at a media chunk's edge (a
    slot's kept prefix ending inside a chunk, one it held only part of, is cut at the chunk's
    start; the host's part ending inside one stops before it): the server keeps, replaces and
    computes a chunk whole (else 409)."""
    if media is None:
        return p0, p1
    return media.chunk_start(p0), media.chunk_start(p1)
