"""KV-cell admission: the cells a plan fills, the room check, the books' invariant (pure), and
the coordinator reserving cells across requests admitted together (on fake servers)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from proxy.core.admission import (
    CellNeed,
    cells_needed,
    check_reservations,
    free_estimate,
    own_tail,
)
from proxy.core.payload import KvSegment
from proxy.core.planner import Plan, Route
from proxy.server.coordinator import Coordinator, Lease, ServerState
from proxy.server.dataplane.kvctl import Cells
from tests.unit.test_coordinator import (
    LAYOUT,
    FakeSharing,
    coordinator,
    pool,
    rows,
    server,
    settle,
    sharing_server,
    toks,
)

pytestmark = pytest.mark.unit


def plan(route: Route, reuse: int = 0, host_from: int = 0, host_to: int = 0) -> Plan:
    return Plan(
        route, 0, reuse, 4 if route in (Route.S, Route.SH) else None, host_from, host_to, max(reuse, host_to)
    )


@pytest.mark.parametrize(
    ("case", "the_plan", "n_prompt", "n_predict", "n_ctx_slot", "need"),
    [
        ("prefill: the whole prompt", plan(Route.PREFILL), 400, 16, 4096, CellNeed(400, 16)),
        ("A: the slot keeps its prefix", plan(Route.A, reuse=300), 400, 16, 4096, CellNeed(100, 16)),
        ("S: an attach shares the owner's cells", plan(Route.S, reuse=203), 419, 16, 4096, CellNeed(216, 16)),
        # An import writes new cells: the imported prefix counts like a computed one.
        ("H: imported cells are new", plan(Route.H, host_to=300), 400, 16, 4096, CellNeed(400, 16)),
        (
            "A+H: only the kept base is not new",
            plan(Route.AH, 100, 100, 300),
            400,
            16,
            4096,
            CellNeed(300, 16),
        ),
        (
            "S+H: only the attached base is not new",
            plan(Route.SH, 100, 100, 300),
            400,
            16,
            4096,
            CellNeed(300, 16),
        ),
        ("the answer is clamped to the slot", plan(Route.PREFILL), 4000, 1000, 4096, CellNeed(4000, 96)),
        ("no answer fits", plan(Route.PREFILL), 4096, 16, 4096, CellNeed(4096, 0)),
    ],
)
def test_cells_needed(
    case: str, the_plan: Plan, n_prompt: int, n_predict: int, n_ctx_slot: int, need: CellNeed
) -> None:
    assert cells_needed(the_plan, n_prompt, n_predict, n_ctx_slot) == need, case


@pytest.mark.parametrize(
    ("n_cells", "held", "admitted", "expected"),
    [
        (1024, [], 0, 1024),
        (1024, [435, 0, 0, 0], 432, 157),  # a slot's cache and a whole reservation both count
        (1024, [435, 432], 864, -707),  # computed prompts counted twice: never more than there are
        (0, [10], 0, None),  # pool size unknown: no estimate
    ],
)
def test_free_estimate(n_cells: int, held: list[int], admitted: int, expected: int | None) -> None:
    assert free_estimate(n_cells, held, admitted) == expected


@pytest.mark.parametrize(
    ("held", "prompt", "tail"),
    [
        (toks(0, 435), toks(0, 419), 16),  # the same prompt again: only the old answer goes
        (toks(0, 435), np.concatenate([toks(0, 203), toks(9000, 216)]), 232),
        (toks(0, 435), toks(5000, 400), 435),  # nothing in common: the whole cache goes
        (toks(0, 0), toks(0, 400), 0),
    ],
)
def test_own_tail(held: np.ndarray, prompt: np.ndarray, tail: int) -> None:
    assert own_tail(held, prompt) == tail


@pytest.mark.parametrize(
    ("n_cells", "reserved", "admitted", "leases", "ok"),
    [
        (1024, 0, 0, [], True),
        (1024, 451, 867, [(435, 435), (16, 432)], True),
        (1024, 450, 867, [(435, 435), (16, 432)], False),  # the server's sum drifted from its leases
        (1024, 451, 866, [(435, 435), (16, 432)], False),
        (1024, 20, 10, [(20, 10)], False),  # more to fill than reserved
        (1024, 1299, 1299, [(435, 435), (432, 432), (432, 432)], False),  # oversubscribed
        (0, 5000, 5000, [(5000, 5000)], True),  # pool size unknown
    ],
)
def test_check_reservations(
    n_cells: int, reserved: int, admitted: int, leases: list[tuple[int, int]], ok: bool
) -> None:
    if ok:
        check_reservations(n_cells, reserved, admitted, leases)
    else:
        with pytest.raises(AssertionError):
            check_reservations(n_cells, reserved, admitted, leases)


# ---- the coordinator -------------------------------------------------------------------------


def pool_server(n_slots: int, n_cells: int) -> ServerState:
    """A server without sharing whose pool has ``n_cells``: its free count is the pool less what
    its slots hold (as the fake records them)."""
    s0 = server("s0", n_slots=n_slots)
    s0.n_cells = n_cells
    fake: Any = s0.backend
    fake.cells_asked = 0

    async def cells() -> Cells:
        fake.cells_asked += 1
        return pool(n_cells - sum(len(t) for t in fake.held.values()))

    fake.cells = cells
    return s0


def check(coord: Coordinator) -> None:
    coord.leases.check_invariants()
    for s in coord.servers:
        overdue = any(x.overdue for x in coord.leases.inflight.values() if x.server is s)
        assert s.n_cells <= 0 or overdue or s.reserved_cells <= s.n_cells


async def test_a_wave_without_sharing_is_admitted_only_as_far_as_the_pool_holds_it() -> None:
    """The capacity wave on a 1024-cell pool: two fit together, the third waits for room
    (it was sent at once before, and every active slot ran out of cells)."""
    s0 = pool_server(4, 1024)
    fake: Any = s0.backend
    coord = coordinator(s0)
    # No prefix in common: not a wave (waves.py), only the pool decides.
    prompts = [np.concatenate([toks(5000 * (i + 1), 203), toks(1000 * (i + 1), 216)]) for i in range(4)]
    leases = [await coord.acquire(f"p{i}", p) for i, p in enumerate(prompts)]
    await coord.restore(leases[0], 16)
    await coord.restore(leases[1], 16)
    assert s0.reserved_cells == 2 * 435 and fake.cells_asked == 0  # room on the books: no I/O
    check(coord)
    third = asyncio.ensure_future(coord.restore(leases[2], 16))
    await settle()
    assert not third.done() and s0.reserved_cells == 870  # 1024 - 870 < 435: not admitted
    # p0's prompt is computed: its cells show in the server's count, only its answer stays reserved.
    fake.held[0] = prompts[0].tolist()
    leases[0].prompt_computed()
    await settle()
    assert not third.done()  # 1024 - 419 measured free, 451 still to fill: no room for 435
    fake.held[0] = [*prompts[0].tolist(), *range(16)]
    leases[0].slot.tokens = np.asarray(fake.held[0], np.int32)
    coord.release(leases[0])  # p0 done; its idle slot is erased to make room for p2
    await asyncio.wait_for(third, 5)
    assert fake.erased == [0] and s0.reserved_cells == 435 + 435
    check(coord)
    for lease in leases[1:3]:
        coord.release(lease)
    coord.release(leases[3])
    assert s0.reserved_cells == 0 and s0.admitted_cells == 0
    check(coord)


async def test_a_host_import_reserves_the_cells_it_writes() -> None:
    s0 = sharing_server(1)
    sharing: FakeSharing = s0.sharing  # type: ignore[assignment]
    coord = coordinator(s0)
    held = toks(0, 300)
    coord.tree.insert(held, KvSegment.from_rows(0, LAYOUT, rows(held.tolist())))
    lease = await coord.acquire("h", toks(0, 400))
    assert lease.plan.route is Route.H and lease.plan.host_to == 300
    await coord.restore(lease, 16)
    assert sharing.asked == [400 + 16] and s0.reserved_cells == 416  # not 116: the import fills 300
    check(coord)
    coord.release(lease)
    check(coord)


async def test_the_books_are_checked_against_the_leases() -> None:
    s0 = pool_server(2, 1024)
    coord = coordinator(s0)
    lease: Lease = await coord.acquire("a", toks(0, 100))
    await coord.restore(lease, 16)
    check(coord)
    s0.reserved_cells += 1  # a reservation taken outside admission
    with pytest.raises(AssertionError):
        coord.leases.check_invariants()
    s0.reserved_cells -= 1
    coord.release(lease)
    check(coord)


async def test_the_leased_slots_own_cache_is_room_for_its_request() -> None:
    """A second wave on a pool full of the first one's caches: each request's slot drops its
    old KV when it starts, so that counts as room (else every request waited for the others)."""
    held = {0: list(range(5000, 5500)), 1: list(range(6000, 6500))}
    s0 = pool_server(2, 1024)
    fake: Any = s0.backend
    for slot_id, tokens in held.items():
        fake.held[slot_id] = tokens
        s0.slots[slot_id].tokens = np.asarray(tokens, np.int32)
    coord = coordinator(s0)
    a = await coord.acquire("a", toks(0, 400))
    b = await coord.acquire("b", toks(1000, 400))
    await asyncio.wait_for(coord.restore(a, 16), 5)  # 24 free + its slot's 500 >= 416
    assert s0.reserved_cells == 416 and fake.erased == []
    second = asyncio.ensure_future(coord.restore(b, 16))
    await settle()
    assert not second.done()  # 24 + 500 < 416 + 416: waits for a's prompt
    fake.held[a.slot.slot_id] = toks(0, 400).tolist()  # a's prompt replaced its slot's cache
    a.prompt_computed()
    await asyncio.wait_for(second, 5)  # 124 free + b's slot's 500 >= 416 + 16
    assert s0.reserved_cells == 16 + 416
    check(coord)
    coord.release(a)
    coord.release(b)
    check(coord)


async def test_without_sharing_a_request_past_the_queue_deadline_is_sent_not_refused() -> None:
    """The books count a prompt being computed twice (measured and reserved): a long prefill
    in flight must not turn into a 503 for a request the server can serve; the server decides."""
    s0 = pool_server(2, 1024)
    coord = coordinator(s0, queue_timeout_s=0.1)
    a = await coord.acquire("a", toks(0, 600))
    await coord.restore(a, 16)
    b = await coord.acquire("b", toks(5000, 500))
    await asyncio.wait_for(coord.restore(b, 16), 5)  # waited the deadline, then admitted
    assert s0.reserved_cells == 616 + 516 and b.overdue and not a.overdue
    check(coord)  # the books may exceed the pool only by an overdue request
    assert coord.metrics.room_overdue._value.get() == 1
    assert coord.metrics.rejected.labels("no_room")._value.get() == 0
    coord.release(b)
    coord.release(a)
    assert s0.reserved_cells == 0
    check(coord)


async def test_a_request_admitted_on_the_books_during_a_room_check_is_counted_by_it() -> None:
    """A room check waits for the server's count (the whole-server lock held); a request admitted
    meanwhile on the proxy's books (no lock) holds part of what the count shows free: the check
    counts its reservation as it is after the measurement, so the two never oversubscribe."""
    s0 = pool_server(3, 1024)
    fake: Any = s0.backend
    fake.held[2] = toks(9000, 300).tolist()  # an idle cache, erased for room
    s0.slots[2].tokens = toks(9000, 300)
    measure, gate = fake.cells, asyncio.Event()

    async def slow_second_count() -> Cells:
        if fake.cells_asked == 1:  # the count after the erase waits on the server's main loop
            await gate.wait()
        return await measure()

    fake.cells = slow_second_count
    coord = coordinator(s0)
    a = await coord.acquire("a", toks(0, 800))
    b = await coord.acquire("b", toks(5000, 500))
    assert 2 not in (a.slot.slot_id, b.slot.slot_id)
    first = asyncio.ensure_future(coord.restore(a, 16))  # 816 > 1024 - 300 on the books
    await settle()
    assert fake.erased == [2] and not first.done()
    second = asyncio.ensure_future(coord.restore(b, 16))  # then it waits for a's restore
    await settle()
    assert s0.reserved_cells == 516  # 516 <= 1024 on the books: admitted at once
    gate.set()
    await settle()
    assert not first.done()  # 1024 measured free, 516 of it b's: no room for 816
    check(coord)
    coord.release(b)  # b is done: a gets its room
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert s0.reserved_cells == 816
    check(coord)
    coord.release(a)
    check(coord)
