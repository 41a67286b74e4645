"""A slot is free when its answer is done (issue 28 item 7), on the coordinator's fakes:

- the slot is handed on as soon as the server exported what the tree lacks (the payload is read
  and inserted after that), not after the insert and the idle release;
- a save not worth waiting for (the tree lacks less than a restore of the slot) leaves the
  slot to a request that finds no idle one, and that save then never touches the slot: no
  read-back written to it, no export started from it, no erase of it; an export already sent
  files only what the server confirms the slot holds;
- saves take no move lock: a restore does not queue behind a save's export.

No timed assertions: each wait is a gate the test opens, each check a few loop turns.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.core.payload import KvSegment
from proxy.core.planner import Route
from proxy.errors import FallbackCause, KvMoveError
from proxy.server.coordinator import Coordinator, Lease, ServerState
from proxy.server.dataplane.kvctl import Slots
from tests.unit.test_coordinator import LAYOUT, FakeServer, check, coordinator, rows, server, toks

pytestmark = pytest.mark.unit


class GatedServer(FakeServer):
    """A fake server whose read-back and export can be held at a gate the test opens: the
    export either inside the server's part (``hold`` entered) or after it (the payload being
    read into segments)."""

    def __init__(self, n_slots: int) -> None:
        super().__init__(n_slots)
        self.slots_gate: asyncio.Event | None = None
        self.export_gate: asyncio.Event | None = None  # inside the server's part
        self.parse_gate: asyncio.Event | None = None  # after it
        self.exported: list[tuple[int, int, int]] = []  # (slot, p0, p1) the server exported

    async def slots(self, tokens: bool = False) -> Slots:
        if self.slots_gate is not None:
            await self.slots_gate.wait()
        return await super().slots(tokens)

    async def export(
        self,
        seq: dict[str, int],
        p0: int,
        tokens: Sequence[int] | np.ndarray,
        hold: contextlib.AbstractAsyncContextManager[Any] | None = None,
    ) -> list[KvSegment]:
        async with hold or contextlib.nullcontext():
            if self.export_gate is not None:
                await self.export_gate.wait()
            held = self.held[seq["slot"]]
            if list(held[: len(tokens)]) != [int(t) for t in tokens]:  # the server's expect_sha256
                raise KvMoveError(FallbackCause.CONFLICT, "the slot holds other tokens")
            self.exported.append((seq["slot"], p0, len(tokens)))
        if self.parse_gate is not None:
            await self.parse_gate.wait()
        return [KvSegment.from_rows(p0, LAYOUT, rows(held[p0 : len(tokens)]))]


def gated(name: str, n_slots: int) -> tuple[ServerState, GatedServer]:
    s = server(name, n_slots=n_slots)
    fake = GatedServer(n_slots)
    s.backend = s.mover = fake
    return s, fake


async def turns(until: Any, n: int = 200) -> None:
    """Run the loop until ``until()`` holds (a deadlock guard of ``n`` turns, not a clock)."""
    for _ in range(n):
        if until():
            return
        await asyncio.sleep(0)


def in_tree(coord: Coordinator, tokens: np.ndarray) -> None:
    coord.tree.insert(tokens, KvSegment.from_rows(0, LAYOUT, rows(tokens.tolist())))


async def answered_host_turn(coord: Coordinator, fake: FakeServer, prompt: np.ndarray, answer: int) -> Lease:
    """A request restored from the tree and answered: the slot holds its prompt and answer."""
    lease = await coord.acquire("a", prompt, n_predict=answer)
    assert lease.route is Route.H
    await coord.restore(lease, answer)
    fake.held[lease.slot.slot_id] = np.concatenate([prompt, toks(8000, answer)]).tolist()
    return lease


async def test_the_slot_is_handed_on_once_the_server_exported_before_the_insert() -> None:
    s0, fake = gated("s0", 1)
    coord = coordinator(s0)
    first = await coord.acquire("a", toks(0, 100))
    fake.held[0] = toks(0, 120).tolist()  # prompt and answer: the tree lacks all of it
    waiter = asyncio.create_task(coord.acquire("w", toks(5000, 50)))
    await turns(lambda: coord.leases.queued() == 1)
    fake.parse_gate = asyncio.Event()
    saving = asyncio.create_task(coord.finish(first, 20))
    await turns(waiter.done)
    # The server exported; the payload is not in the tree yet, and the slot is the waiter's.
    assert fake.exported == [(0, 0, 120)] and waiter.done() and not saving.done()
    assert coord.tree.match(toks(0, 120)).length == 0
    nxt = waiter.result()
    assert first.handed_on and not nxt.took_saving and nxt.slot is first.slot
    assert coord.metrics.value("radix_save_hold_seconds_count", server="s0") == 1
    check(coord)
    fake.held[0] = toks(5000, 60).tolist()  # the next request ran meanwhile
    fake.parse_gate.set()
    await saving
    # Filed under the tokens the server exported, not under what the slot holds now.
    assert coord.tree.match(toks(0, 120)).length == 120
    assert coord.tree.match(toks(5000, 60)).length == 0
    await coord.finish(nxt, 10)
    assert coord.tree.match(toks(5000, 60)).length == 60
    check(coord)


async def test_a_save_not_worth_waiting_for_gives_its_slot_to_a_waiter_and_keeps_off_it() -> None:
    s0, fake = gated("s0", 1)
    coord = coordinator(s0, min_restore_tokens=64, idle_release=True)
    fake.shm_dir = Path("/dev/shm/payloads")  # idle release on: the erase would apply
    s0.n_cells = 1000
    doc = toks(0, 200)
    in_tree(coord, doc)
    first = await answered_host_turn(coord, fake, np.concatenate([doc, toks(7000, 10)]), 8)
    waiter = asyncio.create_task(coord.acquire("w", toks(3000, 50)))
    await turns(lambda: coord.leases.queued() == 1)
    fake.slots_gate = asyncio.Event()  # the server's main loop is busy: the read-back waits
    saving = asyncio.create_task(coord.finish(first, 8))
    await turns(waiter.done)
    assert waiter.done(), "the waiter waited for a save that adds 19 tokens to the tree"
    nxt = waiter.result()
    assert nxt.took_saving and first.handed_on and first.request_id not in coord.leases.inflight
    assert coord.metrics.value("radix_saving_slot_takes_total", server="s0") == 1
    # What the slot holds is unknown past nothing, and counted as held (at most 219 cells).
    slot = s0.slots[0]
    assert len(slot.tokens) == 0 and slot.unrecorded == 219 and slot.ns == ""
    assert s0.free_cells_estimate() <= 1000 - 219
    check(coord)
    fake.held[0] = toks(3000, 60).tolist()  # the taker's answer, before the old read-back returns
    fake.slots_gate.set()
    await saving
    # The old save wrote nothing to the slot, exported nothing from it, erased nothing.
    assert len(slot.tokens) == 0 and slot.unrecorded == 219 and slot.busy
    assert fake.exported == [] and fake.erased == []
    assert coord.tree.match(toks(3000, 60)).length == 0
    await coord.finish(nxt, 10)  # the taker's own save reads the slot back: known again
    assert fake.exported == [(0, 0, 60)] and slot.unrecorded == 0
    check(coord)


async def test_a_saving_slot_is_taken_only_when_no_slot_is_idle() -> None:
    s0, fake = gated("s0", 2)
    coord = coordinator(s0, min_restore_tokens=64)
    doc = toks(0, 200)
    in_tree(coord, doc)
    first = await answered_host_turn(coord, fake, np.concatenate([doc, toks(7000, 10)]), 8)
    fake.slots_gate = asyncio.Event()
    saving = asyncio.create_task(coord.finish(first, 8))
    await turns(lambda: first.takeable)
    other = await coord.acquire("o", toks(3000, 50))
    assert other.slot is not first.slot and not other.took_saving  # the idle slot first
    third = await coord.acquire("t", toks(4000, 50))
    assert third.slot is first.slot and third.took_saving  # then the saving one, at once
    fake.slots_gate.set()
    await saving
    for lease in (other, third):
        coord.release(lease)
    check(coord)


async def test_a_tenant_taking_a_saving_slot_erases_it_first() -> None:
    s0, fake = gated("s0", 1)
    coord = coordinator(s0, min_restore_tokens=64)
    doc = toks(0, 200)
    in_tree(coord, doc)
    first = await answered_host_turn(coord, fake, np.concatenate([doc, toks(7000, 10)]), 8)
    fake.slots_gate = asyncio.Event()
    saving = asyncio.create_task(coord.finish(first, 8))
    await turns(lambda: first.takeable)
    other = await coord.acquire("b", toks(0, 150), ns="tenant-b")
    # No tokens recorded, yet KV of the default namespace: erased before tenant B's request.
    assert other.took_saving and other.erase_first and other.plan.predicted_cached == 0
    fake.slots_gate.set()
    await saving
    coord.release(other)
    check(coord)


async def test_a_save_the_tree_lacks_a_restore_of_is_waited_for() -> None:
    s0, fake = gated("s0", 1)
    coord = coordinator(s0, min_restore_tokens=64)
    first = await coord.acquire("a", toks(0, 100))
    fake.held[0] = toks(0, 108).tolist()
    waiter = asyncio.create_task(coord.acquire("w", toks(3000, 50)))
    await turns(lambda: coord.leases.queued() == 1)
    fake.slots_gate = asyncio.Event()
    saving = asyncio.create_task(coord.finish(first, 8))
    await turns(lambda: first.finishing)
    await turns(waiter.done, 50)
    assert not waiter.done() and not first.takeable  # 109 cells the tree lacks: worth the export
    fake.slots_gate.set()
    await saving
    assert coord.tree.match(toks(0, 108)).length == 108 and waiter.done()
    coord.release(waiter.result())
    check(coord)


async def test_a_restore_does_not_queue_behind_a_saves_export() -> None:
    s0, fake = gated("s0", 2)
    coord = coordinator(s0)
    doc = toks(0, 100)
    in_tree(coord, doc)
    first = await coord.acquire("a", toks(5000, 100))
    fake.held[first.slot.slot_id] = toks(5000, 120).tolist()
    fake.export_gate = asyncio.Event()  # the export waits in the server's main loop
    saving = asyncio.create_task(coord.finish(first, 20))
    await turns(lambda: fake.export_gate is not None and bool(saving) and first.finishing)
    await turns(lambda: False, 20)
    restoring = await coord.acquire("r", np.concatenate([doc, toks(7000, 10)]))
    assert restoring.route is Route.H
    restore = asyncio.create_task(coord.restore(restoring, 16))
    await turns(restore.done)
    assert restore.done() and fake.exported == [] and not saving.done()
    assert (restoring.slot.slot_id, 0, 100) in fake.imports and restoring.lock_wait_s >= 0
    fake.export_gate.set()
    await saving
    assert fake.exported == [(first.slot.slot_id, 0, 120)]
    coord.release(restoring)
    check(coord)


async def test_idle_release_leaves_a_slot_handed_on_alone() -> None:
    s0, fake = gated("s0", 1)
    coord = coordinator(s0, idle_release=True, min_restore_tokens=64)
    fake.shm_dir = Path("/dev/shm/payloads")
    first = await coord.acquire("a", toks(0, 100))
    fake.held[0] = toks(0, 120).tolist()
    # The session's next turn is queued for the slot.
    waiter = asyncio.create_task(coord.acquire("w", toks(0, 130)))
    await turns(lambda: coord.leases.queued() == 1)
    await coord.finish(first, 20)
    await turns(waiter.done)
    # Saved, then handed on to the waiter (route A on the slot's own KV), not erased.
    nxt = waiter.result()
    assert coord.tree.match(toks(0, 120)).length == 120 and fake.erased == []
    assert nxt.slot is first.slot and nxt.route is Route.A and nxt.plan.reuse_len == 120
    fake.held[0] = toks(0, 140).tolist()
    await coord.finish(nxt, 10)  # nobody waits now: saved, then released from the pool
    assert fake.erased == [0] and len(s0.slots[0].tokens) == 0
    check(coord)


async def test_a_request_waiting_for_the_prefix_wakes_once_the_tree_has_it() -> None:
    s0, fake = gated("s0", 2)
    coord = coordinator(s0)
    first = await coord.acquire("a", toks(0, 100))
    fake.held[first.slot.slot_id] = toks(0, 120).tolist()
    fake.export_gate, fake.parse_gate = asyncio.Event(), asyncio.Event()
    saving = asyncio.create_task(coord.finish(first, 20))
    await turns(lambda: first.finishing)
    # The next turn arrives while the answer is being saved: it waits for the save (fan-out).
    nxt_task = asyncio.create_task(coord.acquire("n", toks(0, 130)))
    await turns(lambda: coord.leases.waiting_for_prefix == 1)
    fake.export_gate.set()  # exported: the slot is handed on, the tree does not have it yet
    await turns(lambda: first.handed_on)
    await turns(nxt_task.done, 50)
    assert first.handed_on and not first.done.is_set() and not nxt_task.done()
    fake.parse_gate.set()
    await saving
    nxt = await nxt_task
    assert coord.tree.match(toks(0, 120)).length == 120
    assert nxt.route is Route.A and nxt.plan.reuse_len == 120  # the slot's own KV, still there
    coord.release(nxt)
    check(coord)


async def test_a_slot_taken_during_its_export_keeps_the_takers_state_and_the_tree_stays_right() -> None:
    s0, fake = gated("s0", 1)
    coord = coordinator(s0, min_restore_tokens=64)
    doc = toks(0, 200)
    in_tree(coord, doc)
    prompt = np.concatenate([doc, toks(7000, 30)])
    first = await answered_host_turn(coord, fake, prompt, 8)  # 38 tokens the tree lacks: exported
    fake.export_gate = asyncio.Event()  # the export waits in the server's main loop
    saving = asyncio.create_task(coord.finish(first, 8))
    await turns(lambda: len(s0.slots[0].tokens) == 238)  # read back: a taker can plan on it
    taker = await coord.acquire("t", np.concatenate([prompt, toks(8000, 8), toks(9000, 5)]))
    assert taker.took_saving and taker.route is Route.A and taker.plan.reuse_len == 238
    # The server ran the taker first: its slot holds other tokens when the export comes.
    fake.held[0] = toks(3000, 300).tolist()
    fake.export_gate.set()
    await saving
    assert fake.exported == [] and coord.metrics.value("radix_fallbacks_total", cause="conflict") == 1
    assert coord.tree.match(prompt).length == 200  # nothing filed under the old tokens
    slot = s0.slots[0]
    assert slot.busy and len(slot.tokens) == 238 and slot.gen == taker.gen  # the taker's, untouched
    coord.release(taker)
    check(coord)


async def test_a_slot_is_taken_once_its_export_is_on_its_way_and_the_export_still_lands() -> None:
    s0, fake = gated("s0", 1)
    coord = coordinator(s0, min_restore_tokens=64)
    first = await coord.acquire("a", toks(0, 100))
    first.splittable = False  # sent (its restore done): too late for a prefix step (waves.py)
    fake.held[0] = toks(0, 120).tolist()  # 120 tokens the tree lacks: worth the export
    waiter = asyncio.create_task(coord.acquire("w", toks(0, 125)))
    await turns(lambda: coord.leases.queued() == 1)
    fake.export_gate = asyncio.Event()  # the export waits in the server's main loop
    saving = asyncio.create_task(coord.finish(first, 20))
    await turns(waiter.done)
    # Taken while the export is under way, planned on what the slot was read back to hold.
    nxt = waiter.result()
    assert nxt.took_saving and nxt.route is Route.A and nxt.plan.reuse_len == 120
    assert fake.exported == [] and not saving.done()
    assert coord.metrics.value("radix_saving_slot_takes_total", server="s0") == 1
    assert not first.done.is_set()  # requests waiting for its prefix wait for the export
    check(coord)
    fake.export_gate.set()  # the server ran the export first (it was sent first)
    await saving
    assert first.done.is_set()
    assert fake.exported == [(0, 0, 120)] and coord.tree.match(toks(0, 120)).length == 120
    assert s0.slots[0].busy and s0.slots[0].gen == nxt.gen and len(s0.slots[0].tokens) == 120
    coord.release(nxt)
    check(coord)


async def test_a_next_turn_arriving_after_the_hand_on_waits_for_the_saves_insert() -> None:
    """The slot went on to a queued request once the export was answered, and the KV is not
    in the tree yet: a request with that prefix arriving now waits for the insert (it would
    compute the prefix a second time), then restores it."""
    s0, fake = gated("s0", 1)
    coord = coordinator(s0, min_restore_tokens=64)
    first = await coord.acquire("a", toks(0, 300), n_predict=8)
    first.splittable = False  # sent
    other = asyncio.create_task(coord.acquire("x", toks(5000, 100)))
    await turns(lambda: coord.leases.queued() == 1)
    fake.held[0] = toks(0, 308).tolist()
    fake.parse_gate = asyncio.Event()  # answered by the server, the payload still being read
    saving = asyncio.create_task(coord.finish(first, 8))
    await turns(other.done)
    taker = other.result()  # the slot went on
    assert first.handed_on and not saving.done() and "a" in coord.leases.saving
    following = asyncio.create_task(coord.acquire("b", toks(0, 340), n_predict=8))
    await turns(lambda: False, 20)
    assert not following.done() and coord.leases.waiting_for_prefix == 1
    fake.parse_gate.set()
    await saving
    assert not coord.leases.saving and coord.tree.match(toks(0, 340)).length == 308
    coord.release(taker)
    lease = await asyncio.wait_for(following, 5)
    assert lease.plan.predicted_cached == 308  # reused, not computed a second time
    coord.release(lease)
    check(coord)
