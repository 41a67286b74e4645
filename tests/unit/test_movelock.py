"""The move lock: a slot's moves exclude each other, different slots' moves run together, a
whole-server holder excludes everyone, restores go first, nobody starves."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.server.coordinator.movelock import WHOLE, MoveLock


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def start(lock: MoveLock, slot: int | None, first: bool = False) -> asyncio.Future[None]:
    return asyncio.ensure_future(lock.acquire(first=first, slot=slot))


async def test_moves_into_different_slots_hold_it_together() -> None:
    lock = MoveLock()
    await lock.acquire(slot=0)
    other = start(lock, 1, first=True)
    await settle()
    assert other.done() and lock.slots_held() == {0, 1}
    lock.release(0)
    lock.release(1)
    assert not lock.locked()


async def test_a_slots_moves_wait_for_each_other() -> None:
    lock = MoveLock()
    await lock.acquire(slot=0)
    same = start(lock, 0, first=True)
    await settle()
    assert not same.done()
    lock.release(0)
    await asyncio.wait_for(same, 5)
    assert lock.slots_held() == {0}


async def test_the_whole_server_waits_for_every_slot_and_holds_off_later_ones() -> None:
    lock = MoveLock()
    await lock.acquire(slot=0)
    whole = start(lock, WHOLE, first=True)
    later = start(lock, 1, first=True)  # would fit beside slot 0, but queued behind the whole server
    await settle()
    assert not whole.done() and not later.done()
    lock.release(0)
    await asyncio.wait_for(whole, 5)
    await settle()
    assert not later.done()
    lock.release()
    await asyncio.wait_for(later, 5)
    assert lock.slots_held() == {1}


async def test_a_slot_waiter_behind_a_busy_slot_lets_other_slots_pass() -> None:
    lock = MoveLock()
    await lock.acquire(slot=0)
    again = start(lock, 0)
    then_same = start(lock, 0)
    other = start(lock, 2)
    await settle()
    assert other.done() and not again.done() and not then_same.done()
    lock.release(0)
    await settle()
    assert again.done() and not then_same.done()  # a slot's own waiters keep their order


async def test_restores_go_before_queued_saves_on_a_slot() -> None:
    lock = MoveLock()
    order: list[str] = []

    async def hold(name: str, slot: int | None, first: bool) -> None:
        async with lock.held(slot, first=first):
            order.append(name)
            await asyncio.sleep(0)

    await lock.acquire(slot=0)
    tasks = [
        asyncio.ensure_future(hold("save", 0, False)),
        asyncio.ensure_future(hold("publish", WHOLE, False)),
        asyncio.ensure_future(hold("restore", 0, True)),
    ]
    await settle()
    lock.release(0)
    await asyncio.gather(*tasks)
    assert order == ["restore", "save", "publish"]
    assert not lock.locked()


async def test_a_cancelled_whole_server_waiter_lets_the_slots_behind_it_in() -> None:
    lock = MoveLock()
    await lock.acquire(slot=0)
    whole = start(lock, WHOLE)
    behind = start(lock, 1)
    await settle()
    assert not behind.done()
    whole.cancel()
    await asyncio.wait_for(behind, 5)
    assert lock.slots_held() == {0, 1}


async def test_a_slot_handed_over_then_cancelled_is_passed_on() -> None:
    lock = MoveLock()
    await lock.acquire(slot=3)
    waiter = start(lock, 3, first=True)
    other = start(lock, 3)
    await settle()
    lock.release(3)  # handed to `waiter`, cancelled before it runs
    waiter.cancel()
    await asyncio.wait_for(other, 5)
    assert lock.slots_held() == {3}
    lock.release(3)
    assert not lock.locked()


# A random schedule of holders (a slot or the whole server, restore or save), each holding for
# a few turns of the loop; some cancelled while queued. Exclusion is checked at every step, and
# everyone not cancelled gets the lock in the end.
HOLDERS = st.lists(
    st.tuples(st.sampled_from([WHOLE, 0, 1, 2]), st.booleans(), st.integers(0, 3), st.booleans()),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(HOLDERS)
def test_exclusion_and_progress_under_any_schedule(holders: list[tuple[int | None, bool, int, bool]]) -> None:
    async def run() -> None:
        lock = MoveLock()
        inside: list[int | None] = []
        served: list[int] = []

        async def hold(i: int, slot: int | None, first: bool, turns: int) -> None:
            async with lock.held(slot, first=first):
                inside.append(slot)
                # Nobody beside a whole-server holder; no slot twice.
                assert inside.count(WHOLE) == 0 or len(inside) == 1
                assert len([s for s in inside if s is not WHOLE]) == len(
                    {s for s in inside if s is not WHOLE}
                )
                try:
                    for _ in range(turns):
                        await asyncio.sleep(0)
                finally:
                    inside.remove(slot)
            served.append(i)

        tasks = []
        for i, (slot, first, turns, _cancel) in enumerate(holders):
            tasks.append(asyncio.ensure_future(hold(i, slot, first, turns)))
            await asyncio.sleep(0)
        for task, (_slot, _first, _turns, cancel) in zip(tasks, holders, strict=True):
            if cancel:
                task.cancel()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
        errors = [
            o for o in outcomes if isinstance(o, Exception) and not isinstance(o, asyncio.CancelledError)
        ]
        assert not errors
        not_cancelled = {i for i, task in enumerate(tasks) if not task.cancelled()}
        assert not_cancelled <= set(served)
        assert not lock.locked()

    asyncio.run(run())
