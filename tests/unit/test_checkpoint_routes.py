"""Whole-state checkpoints in the coordinator (servers with moves off, recurrent or hybrid
memory), on fakes of the server: saved after an answer where the server took them, restored
whole as route H on any slot, a refusal falling back to prefill, route A priced as the server's
own checkpoints allow, and the health checks following what a restarted server says."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from proxy.core.planner import Route
from proxy.errors import FallbackCause, KvMoveError
from proxy.server.coordinator import ServerState
from proxy.server.dataplane.kvctl import SeqInfo, Slots
from proxy.server.dataplane.kvctl_moves import CheckpointReply, RestoreReply
from proxy.server.ops.health import HealthMonitor
from tests.unit.test_coordinator import FakeServer, check, coordinator, server, toks

pytestmark = pytest.mark.unit

COMPAT_ID = "c0ffee"


class RecurrentServer(FakeServer):
    """A server that takes context checkpoints while it computes a prompt (4 tokens before its
    end, here) and exports and restores whole states."""

    def __init__(self, n_slots: int) -> None:
        super().__init__(n_slots)
        self.layout = None  # moves off
        self.bytes_per_token = 0
        self.ckpts: dict[int, tuple[int, ...]] = {i: () for i in range(n_slots)}
        self.exported: list[tuple[int, int]] = []
        self.restored: list[tuple[int, int]] = []
        self.refuse_export: set[int] = set()
        self.fail_restore = False

    def answered(self, slot: int, prompt: np.ndarray, answer: int = 5) -> None:
        self.held[slot] = prompt.tolist() + list(range(90000, 90000 + answer))
        self.ckpts[slot] = (len(prompt) - 4, len(prompt) - 4 - 50)

    async def slots(self, tokens: bool = False) -> Slots:
        base = await super().slots(tokens)
        return Slots(
            tuple(
                SeqInfo(e.id, e.n_tokens, e.pos_min, e.pos_max, e.n_cells, e.busy, e.tokens, self.ckpts[e.id])
                for e in base.slots
            ),
            (),
        )

    async def checkpoint(self, slot: int, tokens: np.ndarray) -> CheckpointReply:
        n = len(tokens)
        if n in self.refuse_export:
            raise KvMoveError(FallbackCause.EXPORT, "exceeds the inline limit")
        assert self.held[slot][:n] == tokens.tolist()  # the server's expect_sha256 check
        self.exported.append((slot, n))
        return CheckpointReply(size=4, n_tokens=n, data=b"CK%02d" % (n % 100), t_ms=None)

    async def restore(self, slot: int, tokens: np.ndarray, data: bytes, lora: Any = None) -> RestoreReply:
        if self.fail_restore:
            self.held[slot], self.ckpts[slot] = [], ()
            raise KvMoveError(FallbackCause.IMPORT, "the checkpoint payload is corrupt")
        self.restored.append((slot, len(tokens)))
        self.held[slot], self.ckpts[slot] = tokens.tolist(), ()
        return RestoreReply(slot=slot, n_tokens=len(tokens), bytes=len(data), t_ms=None)


def recurrent_server(name: str = "s0", n_slots: int = 2) -> tuple[ServerState, RecurrentServer]:
    state = server(name, n_slots)
    fake = RecurrentServer(n_slots)
    state.backend = state.mover = fake
    state.moves_off = ("hybrid memory: a recurrent state cannot be cut at a position",)
    state.checkpoints, state.compat_id = True, COMPAT_ID
    return state, fake


async def answer(coord: Any, fake: RecurrentServer, request_id: str, prompt: np.ndarray) -> Any:
    lease = await coord.acquire(request_id, prompt)
    await coord.restore(lease, 16)
    fake.answered(lease.slot.slot_id, prompt)
    await coord.finish(lease)
    return lease


async def test_an_answer_keeps_the_servers_checkpoints_and_another_slot_restores_one() -> None:
    s0, fake = recurrent_server()
    coord = coordinator(s0, min_restore_tokens=32)
    first = toks(0, 200)
    lease = await answer(coord, fake, "a", first)
    assert lease.route == Route.PREFILL
    # Both checkpoints the server took, newest first; the store has them under their tokens.
    assert fake.exported == [(lease.slot.slot_id, 196), (lease.slot.slot_id, 146)]
    assert coord.checkpoints.find("", COMPAT_ID, first[:196]) is not None
    assert coord.metrics.checkpoint_saves._value.get() == 2
    # Two other conversations take both slots.
    await answer(coord, fake, "b", toks(1000, 120))
    await answer(coord, fake, "c", toks(2000, 120))
    second = np.concatenate([first, toks(5000, 30)])
    lease = await coord.acquire("a2", second)
    assert lease.route == Route.H and lease.plan.host_to == 196 and lease.checkpoint is not None
    assert lease.host is None  # not the tree's KV: a whole state
    await coord.restore(lease, 16)
    assert fake.restored == [(lease.slot.slot_id, 196)]
    assert lease.slot.tokens.tolist() == first[:196].tolist() and lease.route == Route.H
    assert coord.metrics.checkpoint_restores._value.get() == 1
    coord.release(lease)
    check(coord)


async def test_a_refused_restore_falls_back_to_prefill_and_is_counted() -> None:
    s0, fake = recurrent_server()
    coord = coordinator(s0, min_restore_tokens=32)
    first = toks(0, 200)
    await answer(coord, fake, "a", first)
    await answer(coord, fake, "b", toks(1000, 120))
    await answer(coord, fake, "c", toks(2000, 120))
    fake.fail_restore = True
    lease = await coord.acquire("a2", np.concatenate([first, toks(5000, 30)]))
    planned = lease.plan.route
    assert planned == Route.H
    await coord.restore(lease, 16)
    assert lease.route == Route.PREFILL and lease.fallback == FallbackCause.IMPORT
    assert len(lease.slot.tokens) == 0
    assert coord.metrics.fallbacks.labels(FallbackCause.IMPORT)._value.get() == 1
    coord.release(lease)
    check(coord)


async def test_one_refused_export_does_not_stop_the_others() -> None:
    s0, fake = recurrent_server()
    coord = coordinator(s0, min_restore_tokens=32)
    fake.refuse_export = {196}
    first = toks(0, 200)
    await answer(coord, fake, "a", first)
    assert [n for _, n in fake.exported] == [146]
    assert coord.checkpoints.find("", COMPAT_ID, first[:146]) is not None
    assert coord.metrics.fallbacks.labels(FallbackCause.EXPORT)._value.get() == 1


async def test_a_checkpoint_is_never_combined_with_the_slots_prefix() -> None:
    """The conversation's own slot parts from the next turn inside the answer: the server goes
    back to its checkpoint at 196, so route A is worth 196 tokens, not the common prefix; a
    stored checkpoint at the same place adds nothing, and no A+H is ever planned."""
    s0, fake = recurrent_server()
    coord = coordinator(s0, min_restore_tokens=32)
    first = toks(0, 200)
    lease = await answer(coord, fake, "a", first)
    slot = lease.slot.slot_id
    # The next prompt repeats the answer's first 3 tokens, then parts (re-tokenized text).
    nxt = np.concatenate([first, np.arange(90000, 90003, dtype=np.int32), toks(7000, 40)])
    again = await coord.acquire("a2", nxt)
    assert again.route == Route.A and again.slot.slot_id == slot
    assert again.plan.reuse_len == 196  # the server's own checkpoint, not the 203 in common
    assert again.checkpoint is None
    coord.release(again)
    check(coord)


class Caps:
    def __init__(self, checkpoints: bool, compat_id: str = COMPAT_ID) -> None:
        self.checkpoints, self.compat_id = checkpoints, compat_id
        self.checkpoints_off = () if checkpoints else ("the server takes no context checkpoints",)


def test_the_health_checks_follow_a_restarted_servers_checkpoints() -> None:
    s0, _ = recurrent_server()
    coord = coordinator(s0)
    monitor = HealthMonitor(coord, 1.0, 1.0)
    monitor._follow_checkpoints(s0, Caps(False))  # type: ignore[arg-type]
    assert s0.checkpoints is False
    assert coord.metrics.server_checkpoints.labels("s0")._value.get() == 0
    monitor._follow_checkpoints(s0, Caps(True))  # type: ignore[arg-type]
    assert s0.checkpoints is True
    monitor._follow_checkpoints(s0, Caps(True, compat_id="other"))
    assert s0.checkpoints is False


async def test_an_identical_prompt_is_priced_at_an_earlier_checkpoint() -> None:
    """The slot holds exactly the prompt (an answer of one token is not in the KV): the server
    needs one token to compute, so it goes back to its checkpoint before the end."""
    s0, fake = recurrent_server(n_slots=1)
    coord = coordinator(s0, min_restore_tokens=32)
    prompt = toks(0, 200)
    first = await coord.acquire("a", prompt)
    fake.answered(first.slot.slot_id, prompt, answer=0)
    await coord.finish(first)
    again = await coord.acquire("a2", prompt)
    assert again.route == Route.A and again.plan.reuse_len == 196
    coord.release(again)


def test_a_server_that_moves_kv_joining_later_keeps_checkpoints_to_their_share() -> None:
    s0, _ = recurrent_server()
    coord = coordinator(s0)
    assert coord.checkpoints.budget_bytes == coord.tree.budget_bytes  # nothing else uses the tree
    coord.add_server(server("s1"))
    assert coord.checkpoints.budget_bytes == coord.tree.budget_bytes // 4
