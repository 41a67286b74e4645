"""Waves (proxy/server/coordinator/waves.py): requests that arrive together sharing a prefix
nobody has computed have the first one compute it alone, then restore it from the tree."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from proxy.core.planner import Route
from proxy.errors import FallbackCause, KvMoveError
from proxy.server.coordinator import Coordinator, Lease
from tests.unit.test_coordinator import check, coordinator, server, settle, toks

pytestmark = pytest.mark.unit


def wave(n: int, shared: int = 600, own: int = 40) -> list[np.ndarray]:
    return [np.concatenate([toks(0, shared), toks(10_000 * (i + 1), own)]) for i in range(n)]


async def pair(
    n_slots: int, head_predict: int = 0, other_predict: int = 0, **fakes: Any
) -> tuple[Coordinator, Any, Lease, asyncio.Task[Lease]]:
    """A wave of two, the second planned while the head waits for it: the coordinator, the
    fake server (``fakes`` replace its methods), the head's lease and the second's acquire."""
    s0 = server("s0", n_slots=n_slots)
    fake: Any = s0.backend
    for name, fn in fakes.items():
        setattr(fake, name, fn)
    coord = coordinator(s0)
    prompts = wave(2)
    head = await coord.acquire("h", prompts[0], n_predict=head_predict)
    other = asyncio.create_task(coord.acquire("w", prompts[1], n_predict=other_predict))
    await settle()
    return coord, fake, head, other


async def test_a_wave_computes_its_shared_prefix_once() -> None:
    """The head holds its forward a moment; the others ask it for a prefix step and wait; it
    computes the shared 600 tokens alone, exports them into the tree, and the others restore
    them (route H) instead of computing them side by side."""
    s0 = server("s0", n_slots=4)
    fake: Any = s0.backend
    coord = coordinator(s0)
    prompts = wave(3)
    head = await coord.acquire("h", prompts[0], n_predict=16)
    assert head.route is Route.PREFILL and head.splittable
    others = [asyncio.create_task(coord.acquire(f"w{i}", p, n_predict=16)) for i, p in enumerate(prompts[1:])]
    await settle()
    assert not any(t.done() for t in others) and head.split_to == 600
    assert coord.leases.waiting() == 2
    await coord.restore(head, 16)  # the window, then the prefix step
    assert fake.prefills == [(head.slot.slot_id, 600)] and not head.splittable
    assert head.prefix_step_tokens == 600 and list(head.slot.tokens) == list(prompts[0][:600])
    assert coord.tree.match(prompts[0][:600]).length == 600
    leases = [await asyncio.wait_for(t, 5) for t in others]
    assert [x.route for x in leases] == [Route.H, Route.H]
    assert all(x.plan.predicted_cached == 600 and x.prefix_wait_s > 0 for x in leases)
    assert len({x.slot.slot_id for x in [head, *leases]}) == 3
    assert coord.metrics.value("radix_prefix_steps_total", outcome="done") == 1
    for x in [head, *leases]:
        coord.release(x)
    check(coord)


async def test_a_failed_prefix_step_wakes_the_wave_to_compute_it_themselves() -> None:
    async def refused(slot: int, tokens: np.ndarray, lora: object = None) -> tuple[int, float]:
        raise KvMoveError(FallbackCause.TRANSPORT, "the server went away")

    # An answer of unknown length: after the step the head is never waited for again.
    coord, _, head, other = await pair(3, other_predict=16, prefill=refused)
    assert not other.done() and head.split_to == 600
    await coord.restore(head, 16)
    lease = await asyncio.wait_for(other, 5)
    assert lease.route is Route.PREFILL and coord.tree.match(lease.tokens).length == 0
    assert len(head.slot.tokens) == 0  # what the slot holds is unknown: nothing reused from it
    assert coord.metrics.value("radix_prefix_steps_total", outcome="failed") == 1
    coord.release(head)
    coord.release(lease)
    check(coord)


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("sent", "the head is on its way to the server: only its answer could be waited for"),
        ("short", "the shared part is shorter than --min-restore-tokens"),
        ("idle", "another server is idle: computing the prefix there is quicker than the step"),
    ],
)
async def test_no_prefix_step(case: str, why: str) -> None:
    servers = [server("s0", n_slots=2)] + ([server("s1", n_slots=2)] if case == "idle" else [])
    coord = coordinator(*servers, min_restore_tokens=64)
    prompts = wave(2, shared=40 if case == "short" else 600)
    head = await coord.acquire("h", prompts[0], n_predict=0)
    if case == "sent":
        head.splittable = False
    other = await asyncio.wait_for(coord.acquire("w", prompts[1], n_predict=0), 1)
    assert head.split_to == 0 and other.prefix_wait_s < 0.5, why
    coord.release(other)
    coord.release(head)
    check(coord)


async def test_the_head_is_sent_after_the_restores_of_the_waiters_it_woke() -> None:
    """Their imports need the server's main loop: sent first, the head's suffix prefill would
    hold them (a restore planned counts from its plan, not from its import)."""
    coord, fake, head, other = await pair(3, 16, 16)
    gate = asyncio.Event()
    plain_import = fake.import_

    async def slow_import(*args: Any, **kw: Any) -> None:
        await gate.wait()
        await plain_import(*args, **kw)

    fake.import_ = slow_import
    sent = asyncio.create_task(coord.restore(head, 16))
    waiter = await asyncio.wait_for(other, 5)
    assert waiter.route is Route.H and waiter.planned_restore
    restoring = asyncio.create_task(coord.restore(waiter, 16))
    for _ in range(50):
        await asyncio.sleep(0)
    assert not sent.done() and not restoring.done()  # the head waits for the waiter's import
    gate.set()
    await asyncio.wait_for(asyncio.gather(sent, restoring), 5)
    assert not waiter.planned_restore and fake.imports
    coord.release(waiter)
    coord.release(head)
    check(coord)


async def test_a_server_going_down_during_the_step_abandons_the_head() -> None:
    from proxy.server.coordinator import RestoreAbandoned

    async def hangs(slot: int, tokens: np.ndarray, lora: object = None) -> tuple[int, float]:
        await asyncio.sleep(60)
        return 0, 0.0

    coord, _, head, other = await pair(2, prefill=hangs)
    sent = asyncio.create_task(coord.restore(head, 16))
    await asyncio.sleep(0.1)  # the window passed: the step hangs
    coord.server_down(head.server, "health check failed")
    with pytest.raises(RestoreAbandoned):
        await asyncio.wait_for(sent, 5)
    assert len(head.slot.tokens) == 0 and head.slot.ns is None  # unknown: erased before reuse
    other.cancel()
    coord.release(head)


async def test_no_window_where_no_step_can_happen() -> None:
    """Resident sharing waits for answers (fan-out), and a step nobody waits for any more is
    not run."""
    coord = coordinator(server("s0", n_slots=2), kv_share=True)
    head = await coord.acquire("h", wave(1)[0], n_predict=16)
    await asyncio.wait_for(coord.restore(head, 16), 0.02)  # no 50 ms window
    coord.release(head)

    coord, fake, head, other = await pair(2)
    assert head.split_to == 600 and head.split_waiters == 1
    other.cancel()
    await settle()
    assert head.split_waiters == 0
    await coord.restore(head, 16)
    assert fake.prefills == []  # nobody waits: no step
    coord.release(head)
    check(coord)
