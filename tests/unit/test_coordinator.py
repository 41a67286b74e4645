"""The coordinator on fake servers: queue fairness, cancellation, server choice, fan-out wait,
saving after an answer, and each request's common prefixes computed once.

The fakes stand in for llama-server only where these rules are decided on pure data; the
real KV moves are covered by the integration suites against the patched server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from proxy.config import Config
from proxy.core.payload import KvLayout, KvSegment
from proxy.core.planner import Route
from proxy.core.prefix import common_prefix
from proxy.core.radix import RadixTree, Spill
from proxy.errors import FallbackCause, KvMoveError, RejectReason, TooManyRequests, Unavailable
from proxy.server.coordinator import Coordinator, Lease, RestoreAbandoned, ServerState, SlotState
from proxy.server.coordinator import scan as scan_module
from proxy.server.dataplane.kvctl import Cells, SeqInfo, Slots
from proxy.server.dataplane.kvctl_moves import CheckpointReply, EraseReply, ReleaseReply, RestoreReply
from proxy.server.metrics import REJECT_REASONS, DiskMetrics, Metrics
from proxy.server.tiers.disk import DiskTier

pytestmark = pytest.mark.unit

LAYOUT = KvLayout(1, (1,), (4,), (1,), False, (4,), (0,), (0,))  # 8 bytes per token


def rows(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray([[t % 256] * 8 for t in tokens], dtype=np.uint8).reshape(-1, 8)


def pool(free: int, owner: int = 0, owner_only: int = 0) -> Cells:
    """A /kvctl/cells reply with these counts (the rest: 0)."""
    return Cells(0, 0, free, 0, owner, owner_only, 0, {})


class FakeServer:
    """What the coordinator asks a server for (ports.KvServer and ports.Mover, as one object):
    slot contents, erase, export and import of KV."""

    def __init__(self, n_slots: int) -> None:
        self.url = "http://fake"
        self.layout: KvLayout | None = LAYOUT
        self.compat: dict[str, Any] = {}
        self.bytes_per_token = LAYOUT.bytes_per_token
        self.chunk_tokens = 512
        self.prefills: list[tuple[int, int]] = []  # (slot, tokens) of each prefix step
        self.shm_dir: Path | None = None  # as a mover: inline payloads
        self.held: dict[int, list[int]] = {i: [] for i in range(n_slots)}
        self.fail_export = False
        self.fail_erase = False
        self.imports: list[tuple[int, int, int]] = []
        self.erased: list[int] = []
        self.erased_cells: list[int] = []  # what each erased slot held (sharing_server)
        self.new_instances = 0  # as a mover: told the server is a new process

    async def prefill(self, slot: int, tokens: np.ndarray, lora: Any = None) -> tuple[int, float]:
        """The slot computes the tokens on top of the prefix it shares with them."""
        self.prefills.append((slot, len(tokens)))
        held = self.held[slot]
        keep = next((i for i, (a, b) in enumerate(zip(held, tokens, strict=False)) if a != int(b)), None)
        keep = min(len(held), len(tokens)) if keep is None else keep
        self.held[slot] = [int(t) for t in tokens]
        return len(tokens) - keep, 1.0

    async def erase(self, slot: int) -> EraseReply:
        if self.fail_erase:
            raise KvMoveError(FallbackCause.ERASE, "refused")
        self.erased.append(slot)
        n, self.held[slot] = len(self.held[slot]), []
        return EraseReply(slot, n)

    async def slots(self, tokens: bool = False) -> Slots:
        return Slots(
            tuple(
                SeqInfo(i, len(t), 0 if t else -1, len(t) - 1, len(t), False, np.asarray(t, np.int32))
                for i, t in self.held.items()
            ),
            (),
        )

    async def cells(self) -> Cells:
        raise AssertionError("not measured in these tests")

    async def release(self, owner: int) -> ReleaseReply:
        raise AssertionError("no owners here")

    async def publish(self, slot: int, owner: int, n: int, expect_sha256: str) -> SeqInfo:
        raise AssertionError("no owners here")

    async def attach(self, owner: int, slot: int, m: int, expect_sha256: str, lora: Any = None) -> SeqInfo:
        raise AssertionError("no owners here")

    async def checkpoint(self, slot: int, tokens: np.ndarray) -> CheckpointReply:
        raise AssertionError("KV models here: no whole-state checkpoints")

    async def restore(self, slot: int, tokens: np.ndarray, data: bytes, lora: Any = None) -> RestoreReply:
        raise AssertionError("KV models here: no whole-state checkpoints")

    def new_instance(self) -> None:
        self.new_instances += 1

    def close(self) -> None:
        pass

    async def export(
        self,
        seq: dict[str, int],
        p0: int,
        tokens: Sequence[int] | np.ndarray,
        hold: contextlib.AbstractAsyncContextManager[Any] | None = None,
    ) -> list[KvSegment]:
        async with hold or contextlib.nullcontext():  # the mover holds the lock for the server's part
            if self.fail_export:
                raise KvMoveError(FallbackCause.EXPORT, "refused")
            held = self.held[seq["slot"]]
            if list(held[: len(tokens)]) != [int(t) for t in tokens]:  # the server's expect_sha256 check
                raise KvMoveError(FallbackCause.CONFLICT, "the slot holds other tokens")
        return [KvSegment.from_rows(p0, LAYOUT, rows(held[p0 : len(tokens)]))]

    async def import_(
        self,
        slot: int,
        p0: int,
        tokens: Sequence[int],
        segments: Sequence[KvSegment],
        hold: contextlib.AbstractAsyncContextManager[Any] | None = None,
        lora: Any = None,
        media: Any = (),
    ) -> None:
        async with hold or contextlib.nullcontext():
            self.imports.append((slot, p0, len(tokens)))
            self.held[slot] = list(tokens)


def server(name: str, n_slots: int = 2, held: dict[int, list[int]] | None = None) -> ServerState:
    fake = FakeServer(n_slots)
    for slot_id, tokens in (held or {}).items():
        fake.held[slot_id] = tokens
    slots = [SlotState(i, np.asarray(fake.held[i], np.int32)) for i in range(n_slots)]
    return ServerState(name, fake, fake, slots, n_ctx_slot=4096)


def coordinator(*servers: ServerState, **config: Any) -> Coordinator:
    # Slots keep their KV after an answer here (what most tests plan around: route A); the
    # default, idle release, has its own tests below.
    base = {"min_restore_tokens": 8, "idle_release": False}
    cfg = Config(backends=tuple(s.name for s in servers), **{**base, **config})
    metrics = Metrics(CollectorRegistry(), tuple(s.name for s in servers))
    return Coordinator(cfg, list(servers), RadixTree(1 << 24), metrics)


def toks(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def gate_erases(fake: FakeServer) -> asyncio.Event:
    """Hold the fake server's erases until the returned event is set (a slow main loop)."""
    gate = asyncio.Event()
    erase = fake.erase

    async def slow_erase(slot: int) -> EraseReply:
        await gate.wait()
        return await erase(slot)

    fake.erase = slow_erase  # type: ignore[method-assign]
    return gate


def check(coord: Coordinator) -> None:
    """Invariants after every step: no slot leased twice, busy flags match the leases, tree sane."""
    coord.tree.check_invariants()
    coord.leases.check_invariants()
    leased = [(lease.server.name, lease.slot.slot_id) for lease in coord.leases.inflight.values()]
    assert len(leased) == len(set(leased))
    busy = [(s.name, slot.slot_id) for s in coord.servers for slot in s.slots if slot.busy]
    assert sorted(busy) == sorted(leased)


async def test_waiters_are_served_first_in_first_out() -> None:
    coord = coordinator(server("s0", n_slots=2))
    first = [await coord.acquire(f"r{i}", toks(100 * i, 20)) for i in range(2)]
    tasks = [asyncio.create_task(coord.acquire(f"w{i}", toks(1000 + 100 * i, 20))) for i in range(3)]
    await settle()
    assert coord.leases.queued() == 3 and not any(t.done() for t in tasks)
    coord.release(first[0])
    await settle()
    assert [t.done() for t in tasks] == [True, False, False]
    check(coord)
    coord.release(first[1])
    await settle()
    assert [t.done() for t in tasks] == [True, True, False]
    coord.release(tasks[0].result())
    await settle()
    assert tasks[2].done() and tasks[2].result().request_id == "w2"
    check(coord)


async def test_a_newcomer_does_not_overtake_the_queue() -> None:
    coord = coordinator(server("s0", n_slots=1))
    held = await coord.acquire("r0", toks(0, 20))
    queued = asyncio.create_task(coord.acquire("w0", toks(500, 20)))
    await settle()
    late = asyncio.create_task(coord.acquire("late", toks(900, 20)))
    await settle()
    coord.release(held)
    await settle()
    assert queued.done() and not late.done()
    coord.release(queued.result())
    await settle()
    assert late.done()
    coord.release(late.result())
    check(coord)


async def test_cancelled_while_queued_leaves_the_queue() -> None:
    coord = coordinator(server("s0", n_slots=1))
    held = await coord.acquire("r0", toks(0, 20))
    gone = asyncio.create_task(coord.acquire("gone", toks(500, 20)))
    stays = asyncio.create_task(coord.acquire("stays", toks(900, 20)))
    await settle()
    gone.cancel()
    await settle()
    assert coord.leases.queued() == 1
    coord.release(held)
    await settle()
    assert stays.done() and stays.result().request_id == "stays"
    check(coord)


async def test_cancelled_after_the_grant_gives_the_slot_back() -> None:
    coord = coordinator(server("s0", n_slots=1))
    held = await coord.acquire("r0", toks(0, 20))
    granted = asyncio.create_task(coord.acquire("granted", toks(500, 20)))
    nxt = asyncio.create_task(coord.acquire("next", toks(900, 20)))
    await settle()
    coord.release(held)  # grants "granted" synchronously...
    granted.cancel()  # ...which is cancelled before it runs again
    await settle()
    assert granted.cancelled()
    assert nxt.done() and nxt.result().request_id == "next"
    check(coord)
    coord.release(nxt.result())
    assert not any(slot.busy for slot in coord.servers[0].slots)


async def test_the_server_holding_the_longer_prefix_wins() -> None:
    prompt = toks(0, 120)
    s0 = server("s0", held={0: toks(0, 40).tolist()})
    s1 = server("s1", held={1: toks(0, 90).tolist()})
    coord = coordinator(s0, s1)
    lease = await coord.acquire("r", prompt)
    assert (lease.server.name, lease.slot.slot_id, lease.route) == ("s1", 1, Route.A)
    assert lease.plan.predicted_cached == 90
    assert lease.why.best_slot_match == 90 and lease.why.source == "slot s1/1"
    check(coord)


async def test_on_a_tie_the_less_busy_server_wins() -> None:
    coord = coordinator(server("s0"), server("s1"))
    first = await coord.acquire("r0", toks(0, 30))
    second = await coord.acquire("r1", toks(5000, 30))
    assert {first.server.name, second.server.name} == {"s0", "s1"}
    check(coord)


async def test_a_next_turn_waits_for_the_turn_being_saved() -> None:
    coord = coordinator(server("s0", n_slots=2))
    turn = await coord.acquire("t1", toks(0, 200))
    turn.finishing = True  # the answer is done; its KV is being saved
    follow = asyncio.create_task(coord.acquire("t2", toks(0, 260)))
    await settle()
    assert not follow.done(), "the next turn should wait for the saving turn, not prefill elsewhere"
    coord.release(turn)
    await settle()
    assert follow.done()
    check(coord)


async def test_an_unrelated_request_does_not_wait() -> None:
    coord = coordinator(server("s0", n_slots=2))
    turn = await coord.acquire("t1", toks(0, 200))
    turn.finishing = True
    other = await asyncio.wait_for(coord.acquire("o", toks(9000, 200)), 1)
    assert other.slot is not turn.slot
    check(coord)


async def test_common_prefixes_are_computed_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = common_prefix

    def counting(a: np.ndarray, b: np.ndarray) -> int:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(scan_module, "common_prefix", counting)
    coord = coordinator(server("s0", n_slots=4), server("s1", n_slots=4))
    await coord.acquire("r", toks(0, 100))
    assert len(calls) == 8  # one per slot: shared by the fan-out check, the plan and the divergence


async def test_common_prefixes_are_computed_once_with_a_disk_tier(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With --cache-disk the promotion check runs on the scan the lease plans on (it scanned
    twice: once for the disk's floor, once for the plan); only a disk read scans again."""
    calls = []
    real = common_prefix

    def counting(a: np.ndarray, b: np.ndarray) -> int:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(scan_module, "common_prefix", counting)
    coord = coordinator(server("s0", n_slots=4), server("s1", n_slots=4))
    metrics = DiskMetrics(CollectorRegistry())
    tier = DiskTier(
        tmp_path / "tier",
        1 << 30,
        b"q" * 32,
        LAYOUT,
        metrics,
        min_tokens=8,
        queue_bytes=1 << 20,
        timeout_s=10,
    )
    await tier.open()
    coord.disk = tier
    lease = await coord.acquire("r", toks(0, 100))
    assert len(calls) == 8 and lease.plan.route is Route.PREFILL
    coord.release(lease)

    # A prefix only the disk holds: read into the tree, then planned (as H) on a new scan.
    held = toks(0, 60)
    tier.demote(Spill("", held, KvSegment.from_rows(0, LAYOUT, rows(held.tolist()))))
    while tier._queue or tier._queued:
        await asyncio.sleep(0.01)
    calls.clear()
    lease = await coord.acquire("h", toks(0, 100))
    assert len(calls) == 16 and lease.plan.route is Route.H and lease.plan.host_to == 60
    coord.release(lease)
    await tier.close(coord.tree, 10)
    check(coord)


async def test_finish_saves_what_the_slot_holds_and_releases() -> None:
    s0 = server("s0", n_slots=1)
    coord = coordinator(s0)
    lease = await coord.acquire("r", toks(0, 100))
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    fake.held[0] = toks(0, 120).tolist()  # prompt plus answer
    await coord.finish(lease)
    assert coord.tree.match(toks(0, 120)).length == 120
    assert not s0.slots[0].busy and len(s0.slots[0].tokens) == 120
    assert lease.done.is_set()
    check(coord)


async def test_a_failed_save_is_counted_and_still_releases() -> None:
    s0 = server("s0", n_slots=1)
    coord = coordinator(s0)
    lease = await coord.acquire("r", toks(0, 100))
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    fake.held[0] = toks(0, 100).tolist()
    fake.fail_export = True
    await coord.finish(lease)
    assert coord.tree.match(toks(0, 100)).length == 0
    assert coord.metrics.value("radix_fallbacks_total", cause="export") == 1
    assert not s0.slots[0].busy
    check(coord)


async def test_a_bug_in_a_save_is_counted_internal_and_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s0 = server("s0", n_slots=1)
    coord = coordinator(s0)
    lease = await coord.acquire("r", toks(0, 100))
    fake: FakeServer = s0.backend  # type: ignore[assignment]

    async def broken(tokens: bool = False) -> Slots:
        raise KeyError("a bug, not a server failure")

    fake.slots = broken  # type: ignore[method-assign]
    await coord.finish(lease)
    assert coord.metrics.value("radix_fallbacks_total", cause="internal") == 1
    assert coord.metrics.value("radix_fallbacks_total", cause="transport") == 0
    assert any(r.exc_info and "unexpectedly" in r.getMessage() for r in caplog.records)
    assert not s0.slots[0].busy
    check(coord)


async def test_a_host_restore_imports_and_unpins() -> None:
    s0 = server("s0", n_slots=1)
    coord = coordinator(s0)
    prompt = toks(0, 100)
    coord.tree.insert(prompt, KvSegment.from_rows(0, LAYOUT, rows(prompt.tolist())))
    lease = await coord.acquire("r", np.concatenate([prompt, toks(7000, 10)]))
    assert lease.route == Route.H and lease.host is not None
    await coord.restore(lease, 16)
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    assert fake.imports == [(0, 0, 100)]
    assert 0 < lease.import_s <= lease.restore_s
    assert coord.record_decision(lease, {"cache_n": 100, "prompt_n": 10}, 0.1, 200).import_s == lease.import_s
    assert lease.host is None and coord.tree.stats().pinned_nodes == 0
    assert len(s0.slots[0].tokens) == 100
    coord.release(lease)
    check(coord)


async def test_host_restores_into_different_slots_of_one_server_run_together() -> None:
    s0 = server("s0", n_slots=2)
    coord = coordinator(s0)
    for start in (0, 3000):
        prompt = toks(start, 100)
        coord.tree.insert(prompt, KvSegment.from_rows(0, LAYOUT, rows(prompt.tolist())))
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    plain_import = fake.import_
    inside: set[int] = set()
    both_inside = asyncio.Event()
    go = asyncio.Event()

    async def import_(slot: int, *args: Any, hold: Any = None, **kw: Any) -> None:
        async with hold or contextlib.nullcontext():  # the server's part, under the move lock
            inside.add(slot)
            if len(inside) == 2:
                both_inside.set()
            await go.wait()
        await plain_import(slot, *args, **kw)

    fake.import_ = import_  # type: ignore[method-assign]
    a = await coord.acquire("a", np.concatenate([toks(0, 100), toks(7000, 10)]))
    b = await coord.acquire("b", np.concatenate([toks(3000, 100), toks(8000, 10)]))
    assert (a.route, b.route) == (Route.H, Route.H) and a.slot is not b.slot
    restores = asyncio.gather(coord.restore(a, 16), coord.restore(b, 16))
    # Each in its server's part at once: one slot's hold does not keep the other slot waiting.
    await asyncio.wait_for(both_inside.wait(), 5)
    assert s0.move_lock.slots_held() == {a.slot.slot_id, b.slot.slot_id}
    go.set()
    await asyncio.wait_for(restores, 5)
    assert sorted(fake.imports) == [(0, 0, 100), (1, 0, 100)]
    assert not s0.move_lock.locked()
    coord.release(a)
    coord.release(b)
    check(coord)


async def test_a_server_with_moves_off_gets_no_host_restore_and_keeps_its_slots_kv() -> None:
    """Moves off (a sliding window, a recurrent state): the slot's own prefix and prefills only;
    nothing is exported, saved or released, even with idle release on and the tree holding more."""
    s0 = server("s0", n_slots=2)
    s0.moves_off = ("sliding-window attention",)
    coord = coordinator(s0, idle_release=True)
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    fake.shm_dir = Path("/dev/shm/payloads")
    other = toks(5000, 100)
    coord.tree.insert(other, KvSegment.from_rows(0, LAYOUT, rows(other.tolist())))
    lease = await coord.acquire("r", np.concatenate([other, toks(9000, 10)]))
    assert lease.route == Route.PREFILL and lease.host is None  # the tree's prefix is not imported
    fake.held[lease.slot.slot_id] = np.concatenate([other, toks(9000, 20)]).tolist()
    await coord.finish(lease)
    assert fake.imports == [] and fake.erased == []
    assert coord.tree.stats().unique_tokens == 100  # nothing saved
    assert len(s0.slots[lease.slot.slot_id].tokens) == 120  # the slot keeps its KV: route A next
    again = await coord.acquire("r2", np.concatenate([other, toks(9000, 30)]))
    assert again.route == Route.A and again.slot.slot_id == lease.slot.slot_id
    coord.release(again)
    check(coord)


@pytest.mark.parametrize(
    ("payload_dir", "held", "released"),
    [
        (True, 110, True),  # payload files: a restore is cheap, the slot is erased
        (False, 110, False),  # inline payloads: restores are slow and capped, the slot keeps its KV
        (True, 50, False),  # shorter than --min-restore-tokens: no host restore would bring it back
    ],
)
async def test_by_default_an_answered_slot_is_saved_then_released(
    payload_dir: bool, held: int, released: bool
) -> None:
    s0 = server("s0", n_slots=1)
    coord = coordinator(s0, idle_release=Config(backends=("x",)).idle_release, min_restore_tokens=64)
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    fake.shm_dir = Path("/dev/shm/payloads") if payload_dir else None
    lease = await coord.acquire("r", toks(0, held - 10))
    fake.held[0] = toks(0, held).tolist()
    await coord.finish(lease)
    assert coord.tree.match(toks(0, held)).length == held  # saved first, released or not
    assert fake.erased == ([0] if released else [])
    assert len(s0.slots[0].tokens) == (0 if released else held) and s0.slots[0].ns == ""
    assert coord.metrics.value("radix_idle_releases_total") == int(released)
    again = await coord.acquire("r2", toks(0, held + 10))
    # Its next turn: a host restore when released, else the slot's own prefix.
    assert again.route == (Route.H if released else Route.A)
    coord.release(again)
    check(coord)


async def test_a_request_queued_during_an_idle_release_plans_on_the_erased_slot() -> None:
    """The erase of an idle release can take long (the server's main loop busy, e.g. encoding an
    image); a request queued meanwhile is granted the slot when the erase ends, and must plan on
    what the slot holds then (nothing: a host restore), not on the tokens it held before (route A
    on KV the server no longer has: a 409 and a full prefill, as a bench of images showed)."""
    s0 = server("s0", n_slots=1)
    coord = coordinator(s0, idle_release=True, min_restore_tokens=64)
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    fake.shm_dir = Path("/dev/shm/payloads")
    gate = gate_erases(fake)
    lease = await coord.acquire("r", toks(0, 100))
    fake.held[0] = toks(0, 110).tolist()
    finishing = asyncio.create_task(coord.finish(lease))
    await settle()
    assert s0.slots[0].busy and not fake.erased  # saved, now erasing
    queued = asyncio.create_task(coord.acquire("r2", toks(0, 120)))
    await settle()
    assert not queued.done()  # the only slot is busy erasing
    gate.set()
    await finishing
    again = await queued
    assert fake.erased == [0]
    assert again.route == Route.H and again.plan.reuse_len == 0, again.plan
    coord.release(again)
    check(coord)


async def test_a_restore_waiting_on_a_server_taken_out_of_routing_gives_up() -> None:
    s0 = server("s0", n_slots=1)
    coord = coordinator(s0)
    prompt = toks(0, 100)
    coord.tree.insert(prompt, KvSegment.from_rows(0, LAYOUT, rows(prompt.tolist())))
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    hung = asyncio.Event()

    async def hang(*args: Any, hold: Any = None, **kw: Any) -> None:
        async with hold or contextlib.nullcontext():  # the server's part, under the move lock
            hung.set()
            await asyncio.sleep(3600)  # a stopped server: no answer before the move deadline

    fake.import_ = hang  # type: ignore[method-assign]
    lease = await coord.acquire("r", np.concatenate([prompt, toks(7000, 10)]))
    assert lease.route == Route.H
    restore = asyncio.create_task(coord.restore(lease, 16))
    await hung.wait()
    assert s0.move_lock.locked()
    coord.server_down(s0, "health check timed out")
    with pytest.raises(RestoreAbandoned):  # the request is planned again (routes.py)
        await asyncio.wait_for(restore, 5)
    assert not s0.move_lock.locked()  # the cancelled move let the lock go
    assert (lease.route, lease.fallback, lease.no_cache) == (Route.PREFILL, FallbackCause.DOWN, True)
    assert s0.slots[0].ns is None  # the server may still finish the import: erased before reuse
    assert coord.metrics.value("radix_fallbacks_total", cause="down") == 1
    assert coord.tree.stats().pinned_nodes == 0
    coord.release(lease)
    coord.server_up(s0, None)
    assert not s0.went_down.is_set()  # a new event for the next time it goes
    check(coord)


def test_decision_summary_has_the_admin_fields() -> None:
    async def run() -> dict[str, Any]:
        coord = coordinator(server("s0"))
        lease: Lease = await coord.acquire("r", toks(0, 50))
        return coord.record_decision(lease, {"cache_n": 0, "prompt_n": 50}, 0.1, 200).summary()

    summary = asyncio.run(run())
    assert summary["route"] == "prefill" and summary["prefilled"] == 50 and summary["fallback"] is None
    assert set(summary) >= {
        "time",
        "request_id",
        "server",
        "slot",
        "prompt_tokens",
        "predicted_cached",
        "cached",
        "ttft_s",
        "queued_s",
        "status",
        "host_match",
        "best_slot_match",
        "diverge_at",
        "diverge_source",
    }


def test_describe_decision_shows_the_divergence_as_text() -> None:
    from types import SimpleNamespace

    from proxy.server.coordinator import Decision, Divergence
    from proxy.server.ops.admin import describe_decision

    decode = SimpleNamespace(decode=lambda ids: "".join(chr(96 + i) for i in ids))
    runtime: Any = SimpleNamespace(
        local_tokenizer=decode, config=Config(backends=("x",), admin_show_text=True)
    )
    why = Divergence(
        host_match=4,
        best_slot_match=6,
        at=6,
        source="slot s0/1",
        ctx_from=2,
        request_ctx=(1, 2, 3, 4, 5, 6, 7),
        cached_ctx=(1, 2, 3, 4, 8, 9),
    )
    decision = Decision(
        time=0.0,
        request_id="r1",
        route=Route.A,
        server="s0",
        slot=1,
        prompt_tokens=15,
        predicted_cached=6,
        cached=6,
        prefilled=9,
        ttft_s=0.1,
        queued_s=0.0,
        fallback=None,
        status=200,
        why=why,
    )
    out = asyncio.run(describe_decision(runtime, decision))
    assert "request_ctx" not in out and "cached_ctx" not in out
    assert out["route"] == "A" and out["diverge_at"] == 6 and out["host_match"] == 4
    assert out["diverge"] == {
        "at": 6,
        "source": "slot s0/1",
        "complete": False,
        "before": "abcd",
        "request": "efg",
        "cached": "hi",
    }
    host = Decision(**{**decision.__dict__, "why": Divergence(4, 0, 4, "host", 0, (1, 2, 3, 4, 5), None)})
    assert asyncio.run(describe_decision(runtime, host))["diverge"]["cached"] is None
    # Without the operator's opt-in, no prompt text leaves the proxy.
    runtime.config = Config(backends=("x",))
    assert asyncio.run(describe_decision(runtime, decision))["diverge"] == {
        "at": 6,
        "source": "slot s0/1",
        "complete": False,
    }


# ---- cache isolation: requests with different keys never reuse each other's KV ----------------


async def test_another_namespace_sees_nothing_cached() -> None:
    s0 = server("s0", n_slots=1, held={0: toks(0, 100).tolist()})
    coord = coordinator(s0)
    coord.tree.insert(toks(0, 100), KvSegment.from_rows(0, LAYOUT, rows(toks(0, 100).tolist())))
    lease = await coord.acquire("r", toks(0, 120), ns="tenant-b")
    assert lease.route == Route.PREFILL and lease.plan.predicted_cached == 0
    assert lease.why.host_match == 0 and lease.why.best_slot_match == 0
    assert lease.erase_first  # the slot holds the default namespace's KV: cleared before use
    await coord.restore(lease, 16)
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    assert fake.erased == [0] and not lease.no_cache and s0.slots[0].ns == "tenant-b"
    fake.held[0] = toks(0, 130).tolist()
    await coord.finish(lease)
    assert coord.tree.match(toks(0, 130), ns="tenant-b").length == 130
    assert coord.tree.match(toks(0, 130)).length == 100  # the default namespace's copy is its own
    check(coord)
    again = await coord.acquire("r2", toks(0, 140), ns="tenant-b")
    assert again.route == Route.A and not again.erase_first
    coord.release(again)


async def test_a_failed_erase_turns_the_servers_reuse_off() -> None:
    s0 = server("s0", n_slots=1, held={0: toks(0, 100).tolist()})
    coord = coordinator(s0)
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    fake.fail_erase = True
    lease = await coord.acquire("r", toks(0, 120), ns="tenant-b")
    await coord.restore(lease, 16)
    assert lease.no_cache and lease.fallback == FallbackCause.ERASE
    await coord.finish(lease)
    assert s0.slots[0].ns is None and len(s0.slots[0].tokens) == 0  # unknown: erased before any reuse
    assert coord.tree.match(toks(0, 120), ns="tenant-b").length == 0
    fake.fail_erase = False
    nxt = await coord.acquire("r2", toks(0, 120))
    assert nxt.erase_first
    coord.release(nxt)


async def test_no_fan_out_wait_across_namespaces() -> None:
    coord = coordinator(server("s0", n_slots=2))
    turn = await coord.acquire("t1", toks(0, 200), ns="a")
    turn.finishing = True
    other = await asyncio.wait_for(coord.acquire("t2", toks(0, 260), ns="b"), 1)
    assert other.why.best_slot_match == 0
    coord.release(other)
    coord.release(turn)
    check(coord)


# ---- admission, deadlines, servers that go away ---------------------------------------------


async def test_a_full_queue_answers_429() -> None:
    coord = coordinator(server("s0", n_slots=1), max_queue=2)
    held = await coord.acquire("r0", toks(0, 20))
    queued = [asyncio.create_task(coord.acquire(f"w{i}", toks(100 * (i + 1), 20))) for i in range(2)]
    await settle()
    with pytest.raises(TooManyRequests):
        await coord.acquire("over", toks(900, 20))
    assert coord.metrics.value("radix_rejected_requests_total", reason="queue_full") == 1
    coord.release(held)
    await settle()
    coord.release(queued[0].result())
    await settle()
    coord.release(queued[1].result())
    check(coord)


async def test_a_queued_request_gives_up_after_the_queue_timeout() -> None:
    coord = coordinator(server("s0", n_slots=1), queue_timeout_s=0.05)
    held = await coord.acquire("r0", toks(0, 20))
    with pytest.raises(Unavailable, match="no slot became free"):
        await coord.acquire("late", toks(500, 20))
    assert coord.leases.queued() == 0
    coord.release(held)
    assert not coord.servers[0].slots[0].busy
    check(coord)


async def test_rejections_are_counted_by_reject_reason() -> None:
    # Every refusal names a RejectReason (the label set the metric is pre-created with).
    coord = coordinator(server("s0", n_slots=1), max_queue=1, queue_timeout_s=0.05)
    seen: list[object] = []
    counted = coord.leases.on_reject

    def on_reject(reason: RejectReason) -> None:
        seen.append(reason)
        counted(reason)

    coord.leases.on_reject = on_reject
    held = await coord.acquire("r0", toks(0, 20))
    waiting = asyncio.create_task(coord.acquire("w", toks(100, 20)))
    await settle()
    with pytest.raises(TooManyRequests):
        await coord.acquire("over", toks(900, 20))
    with pytest.raises(Unavailable):
        await waiting
    coord.close()
    with pytest.raises(Unavailable):
        await coord.acquire("late", toks(500, 20))
    assert seen == [RejectReason.QUEUE_FULL, RejectReason.QUEUE_TIMEOUT, RejectReason.SHUTTING_DOWN]
    assert all(isinstance(r, RejectReason) for r in seen)
    assert tuple(RejectReason) == REJECT_REASONS
    for reason in RejectReason:
        expected = 1 if reason in seen else 0
        assert coord.metrics.value("radix_rejected_requests_total", reason=reason) == expected
    coord.release(held)


async def test_requests_arriving_together_compute_their_prefix_once() -> None:
    """Without sharing, a request whose long prefix another request is still computing waits
    for that answer (its KV is saved right after) and then restores it, when waiting is
    shorter than computing the prefix side by side (2,000 tokens at the calibrated CPU rate:
    10 s; the blocker's 16-token answer adds half a second)."""
    coord = coordinator(server("s0", n_slots=2))
    first = await coord.acquire("g0", toks(0, 2000), n_predict=16)
    second = asyncio.create_task(coord.acquire("g1", toks(0, 2050), n_predict=16))
    await settle()
    assert not second.done(), "the second request should wait for the first one's prefix"
    assert coord.leases.waiting() == 1
    coord.release(first)
    await settle()
    lease = second.result()
    assert lease.prefix_wait_s > 0
    coord.release(lease)
    check(coord)


@pytest.mark.parametrize(
    ("n_predict", "prefill_s_per_token", "why"),
    [
        (4096, 1 / 200, "an answer of up to 4,096 tokens takes longer than computing the prefix"),
        (0, 1 / 200, "an answer of unknown length"),
        (64, 1 / 20_000, "measured fast prefill (a GPU): computing the prefix is quicker"),
    ],
)
async def test_no_wait_for_a_prefix_that_is_quicker_to_compute(
    n_predict: int, prefill_s_per_token: float, why: str
) -> None:
    s0 = server("s0", n_slots=2)
    s0.rates.prefill_s_per_token = prefill_s_per_token
    coord = coordinator(s0)
    first = await coord.acquire("g0", toks(0, 2000), n_predict=n_predict)
    first.splittable = False  # sent already: only its answer can be waited for (no prefix step)
    second = await asyncio.wait_for(coord.acquire("g1", toks(0, 2050), n_predict=16), 1)
    assert second.slot is not first.slot and second.prefix_wait_s < 0.5, why
    coord.release(second)
    coord.release(first)
    check(coord)


async def test_the_wait_for_a_computing_prefix_follows_its_speed_within_the_queue_timeout() -> None:
    """A blocker slower than its estimate (an overloaded server: computing the prefix now
    would be as slow) is waited for longer than the first estimate (twice 30 ms), but never
    past --queue-timeout (here 0.3 s); then the waiter computes it."""
    s0 = server("s0", n_slots=2)
    s0.rates.prefill_s_per_token, s0.rates.decode_s_per_token = 1e-5, 1e-7
    coord = coordinator(s0, queue_timeout_s=0.3)
    first = await coord.acquire("g0", toks(0, 2000), n_predict=16)  # ...and it never ends
    first.splittable = False  # sent already: no prefix step
    second = await asyncio.wait_for(coord.acquire("g1", toks(0, 2050), n_predict=16), 3)
    assert second.slot is not first.slot
    assert 0.2 <= second.prefix_wait_s < 1.0, second.prefix_wait_s
    coord.release(second)
    coord.release(first)
    check(coord)


async def test_an_idle_server_computes_the_prefix_rather_than_wait() -> None:
    """With a second server idle, computing the prefix there runs at full speed (10 s): not
    worth waiting for the first request's 10 s prefill and answer on the busy one."""
    coord = coordinator(server("s0", n_slots=2), server("s1", n_slots=2))
    first = await coord.acquire("g0", toks(0, 2000), n_predict=16)
    second = await asyncio.wait_for(coord.acquire("g1", toks(0, 2050), n_predict=16), 1)
    assert second.server is not first.server
    coord.release(second)
    coord.release(first)
    check(coord)


async def test_answers_teach_the_server_its_rates() -> None:
    s0 = server("s0", n_slots=1)
    coord = coordinator(s0)
    lease = await coord.acquire("r", toks(0, 100))
    before = s0.rates.prefill_s_per_token
    timings = {"cache_n": 0, "prompt_n": 1000, "prompt_ms": 10.0, "predicted_n": 50, "predicted_ms": 500.0}
    coord.record_decision(lease, timings, 0.1, 200)
    assert s0.rates.prefill_s_per_token < before
    coord.release(lease)


async def test_the_prefix_wait_is_bounded() -> None:
    coord = coordinator(server("s0", n_slots=2), fanout_wait_s=0.05)
    turn = await coord.acquire("t1", toks(0, 200))
    turn.finishing = True  # ...and it never ends
    follow = await asyncio.wait_for(coord.acquire("t2", toks(0, 260)), 2)
    assert follow.slot is not turn.slot
    coord.release(follow)
    coord.release(turn)
    check(coord)


async def test_shutdown_answers_the_queue_503() -> None:
    coord = coordinator(server("s0", n_slots=1))
    held = await coord.acquire("r0", toks(0, 20))
    queued = asyncio.create_task(coord.acquire("w", toks(500, 20)))
    await settle()
    coord.close()
    await settle()
    with pytest.raises(Unavailable, match="shutting down"):
        queued.result()
    with pytest.raises(Unavailable, match="shutting down"):
        await coord.acquire("new", toks(900, 20))
    coord.release(held)
    check(coord)


async def test_a_down_server_gets_no_lease_and_a_returning_one_serves_the_queue() -> None:
    s0, s1 = server("s0", n_slots=1), server("s1", n_slots=1)
    coord = coordinator(s0, s1)
    coord.server_down(s0, "killed")
    first = await coord.acquire("r0", toks(0, 20))
    assert first.server is s1
    waiting = asyncio.create_task(coord.acquire("r1", toks(500, 20)))
    await settle()
    assert not waiting.done()  # s0 is down, s1 busy
    coord.server_up(s0, None)
    await settle()
    assert waiting.done() and waiting.result().server is s0
    coord.release(first)
    coord.release(waiting.result())
    check(coord)


async def test_a_restarted_server_forgets_its_slots_but_the_tree_stays() -> None:
    s0 = server("s0", n_slots=2, held={0: toks(0, 100).tolist()})
    coord = coordinator(s0)
    coord.server_up(s0, "first")
    coord.tree.insert(toks(0, 100), KvSegment.from_rows(0, LAYOUT, rows(toks(0, 100).tolist())))
    busy = await coord.acquire("r", toks(5000, 50))
    assert busy.slot.slot_id == 1
    coord.server_down(s0, "killed")
    coord.server_up(s0, "second")
    assert len(s0.slots[0].tokens) == 0 and s0.epoch == 1
    assert isinstance(s0.mover, FakeServer) and s0.mover.new_instances == 1  # arena quarantine freed
    busy.slot.tokens = toks(5000, 50)  # what the proxy believed when the old process ran it
    await coord.finish(busy)  # nothing saved from a dead instance; the slot is reset on release
    assert len(s0.slots[1].tokens) == 0 and coord.tree.match(toks(5000, 50)).length == 0
    again = await coord.acquire("r2", toks(0, 120))
    assert again.route == Route.H and again.plan.host_to == 100  # the host tree warms the new process
    coord.release(again)
    check(coord)


async def test_a_save_past_its_deadline_releases_the_slot_as_unknown() -> None:
    s0 = server("s0", n_slots=1)
    coord = coordinator(s0, finish_timeout_s=0.05)
    lease = await coord.acquire("r", toks(0, 100))
    fake: FakeServer = s0.backend  # type: ignore[assignment]

    async def hang(tokens: bool = False) -> Slots:
        await asyncio.sleep(10)
        return Slots((), ())

    fake.slots = hang  # type: ignore[method-assign]
    await asyncio.wait_for(coord.finish(lease), 2)
    assert not s0.slots[0].busy and s0.slots[0].ns is None
    assert coord.metrics.value("radix_fallbacks_total", cause="timeout") == 1
    check(coord)


async def test_a_lease_whose_erase_never_ran_leaves_the_slot_unknown() -> None:
    # Tenant B gets a slot holding the default namespace's KV; the client goes away before the
    # erase ran. What the slot holds must not be filed under B, nor reused by anyone.
    s0 = server("s0", n_slots=1, held={0: toks(0, 100).tolist()})
    coord = coordinator(s0)
    lease = await coord.acquire("r", toks(0, 120), ns="tenant-b")
    assert lease.erase_first and s0.slots[0].ns is None
    await coord.finish(lease)  # no restore: cancelled before it
    assert s0.slots[0].ns is None and len(s0.slots[0].tokens) == 0
    assert coord.tree.match(toks(0, 100), ns="tenant-b").length == 0
    for ns in ("", "tenant-b"):
        nxt = await coord.acquire("n", toks(0, 120), ns=ns)
        assert nxt.erase_first and nxt.plan.predicted_cached == 0
        coord.release(nxt)
    check(coord)


async def test_an_empty_slot_takes_the_namespace_of_the_request_it_serves() -> None:
    s0 = server("s0", n_slots=1)
    coord = coordinator(s0)
    lease = await coord.acquire("r", toks(0, 100), ns="tenant-a")
    assert not lease.erase_first
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    fake.held[0] = toks(0, 110).tolist()
    await coord.finish(lease)
    assert s0.slots[0].ns == "tenant-a"
    shared = await coord.acquire("r2", toks(0, 120))  # no key: must not see tenant A's slot
    assert shared.plan.predicted_cached == 0 and shared.erase_first
    coord.release(shared)
    check(coord)


class FakeSharing:
    """Owners that give no cells; the pool has ``free`` cells plus what erased slots held."""

    def __init__(self, fake: FakeServer, free: int = 1 << 30) -> None:
        from proxy.core.resident import ResidentIndex

        self.index = ResidentIndex(range(4, 8), 0)
        self.asked: list[int] = []
        self.fake, self.free = fake, free
        self.headroom = 0
        self.last_cells: Cells | None = None

    async def ensure_free(self, need: int) -> bool:
        self.asked.append(need)
        self.last_cells = pool(self.free + sum(self.fake.erased_cells))
        return need + self.headroom <= self.last_cells.free


def sharing_server(
    n_slots: int, free: int = 1 << 30, held: dict[int, list[int]] | None = None
) -> ServerState:
    s0 = server("s0", n_slots=n_slots, held=held)
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    real_erase = fake.erase

    async def erase(slot: int) -> EraseReply:
        fake.erased_cells.append(len(fake.held[slot]))
        return await real_erase(slot)

    fake.erase = erase  # type: ignore[method-assign]
    s0.sharing = FakeSharing(fake, free)  # type: ignore[assignment]
    return s0


async def test_cells_are_reserved_across_requests_admitted_together() -> None:
    s0 = sharing_server(2)
    sharing: FakeSharing = s0.sharing  # type: ignore[assignment]
    coord = coordinator(s0)
    a = await coord.acquire("a", toks(0, 100))
    b = await coord.acquire("b", toks(5000, 300))
    await coord.restore(a, 50)
    await coord.restore(b, 10_000)  # the answer is clamped to what the slot can hold
    assert sharing.asked == [150, 150 + (300 + (4096 - 300))]
    assert s0.reserved_cells == 150 + 4096
    coord.release(a)
    assert s0.reserved_cells == 4096
    coord.release(b)
    assert s0.reserved_cells == 0
    check(coord)


async def test_room_is_made_by_erasing_idle_slots_least_recently_used_first() -> None:
    held = {0: list(range(1000, 1400)), 1: list(range(2000, 2300)), 2: []}
    s0 = sharing_server(3, free=250, held=held)
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    s0.slots[0].last_used, s0.slots[1].last_used = 2.0, 1.0  # slot 1 is the older cache
    coord = coordinator(s0)
    lease = await coord.acquire("a", toks(0, 500))
    assert lease.slot.slot_id == 2
    await coord.restore(lease, 16)  # 516 cells: 250 free, slot 1 gives 300 more
    assert fake.erased == [1] and len(s0.slots[1].tokens) == 0 and len(s0.slots[0].tokens) == 400
    assert s0.reserved_cells == 516 and not s0.slots[1].busy
    assert coord.metrics.room_erases._value.get() == 1
    coord.release(lease)
    check(coord)


async def test_a_request_queued_while_a_slot_is_erased_for_room_takes_it_afterwards() -> None:
    """A slot erased for another request's room is busy meanwhile; a request that queued then
    (every slot busy) is served as soon as the room is made, not at some later release."""
    held = {0: list(range(1000, 1400)), 1: list(range(2000, 2300)), 2: []}
    s0 = sharing_server(3, free=250, held=held)
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    s0.slots[0].last_used, s0.slots[1].last_used = 2.0, 1.0
    coord = coordinator(s0)
    x = await coord.acquire("x", toks(1000, 400))  # slot 0's own prefix: slot 0 stays leased
    a = await coord.acquire("a", toks(0, 500))
    assert (x.slot.slot_id, a.slot.slot_id) == (0, 2)
    gate = gate_erases(fake)
    restoring = asyncio.ensure_future(coord.restore(a, 16))  # 516 cells: slot 1 is erased for them
    await settle()
    assert s0.slots[1].busy and not fake.erased
    c = asyncio.ensure_future(coord.acquire("c", toks(7000, 50)))
    await settle()
    assert not c.done()  # every slot busy
    gate.set()
    await asyncio.wait_for(restoring, 5)
    granted = await asyncio.wait_for(c, 5)  # x and a still hold theirs
    assert fake.erased == [1] and granted.slot.slot_id == 1 and granted.plan.reuse_len == 0
    for lease in (x, a, granted):
        coord.release(lease)
    check(coord)


async def test_a_slot_leased_while_room_is_made_is_not_erased() -> None:
    """The idle slots are listed before the first erase; one leased while that erase runs (its
    own prefix, no queue) belongs to its request: it is skipped, its KV and namespace kept."""
    held = {0: list(range(1000, 1400)), 1: list(range(2000, 2300)), 2: []}
    s0 = sharing_server(3, free=100, held=held)
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    s0.slots[0].last_used, s0.slots[1].last_used = 2.0, 1.0  # slot 1 first, then slot 0
    coord = coordinator(s0)
    a = await coord.acquire("a", toks(0, 800))
    assert a.slot.slot_id == 2
    gate = gate_erases(fake)
    restoring = asyncio.ensure_future(coord.restore(a, 16))  # 816 cells: both idle slots short
    await settle()
    assert s0.slots[1].busy and not fake.erased
    r = await coord.acquire("r", toks(1000, 420))  # slot 0's own prefix, leased meanwhile
    assert r.slot.slot_id == 0 and r.plan.reuse_len == 400
    gate.set()
    await asyncio.wait_for(restoring, 5)  # 400 cells at most: nothing in flight, a goes ahead
    assert fake.erased == [1] and len(fake.held[0]) == 400
    assert s0.slots[0].busy and len(s0.slots[0].tokens) == 400 and s0.slots[0].ns == r.ns
    check(coord)
    for lease in (a, r):
        coord.release(lease)
    check(coord)


async def test_a_request_queued_during_an_erase_for_room_is_served_when_measuring_fails() -> None:
    """Measuring the pool after an erase fails (the lease goes ahead as a prefill): the slot
    erased meanwhile is idle and empty, and a request queued during the erase takes it."""
    held = {0: list(range(1000, 1400)), 1: list(range(2000, 2300)), 2: []}
    s0 = sharing_server(3, free=100, held=held)
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    sharing: FakeSharing = s0.sharing  # type: ignore[assignment]
    s0.slots[0].last_used, s0.slots[1].last_used = 2.0, 1.0
    coord = coordinator(s0)
    x = await coord.acquire("x", toks(1000, 400))  # slot 0's own prefix: slot 0 stays leased
    a = await coord.acquire("a", toks(0, 500))
    gate = gate_erases(fake)
    measure = sharing.ensure_free

    async def fails_after_an_erase(need: int) -> bool:
        if fake.erased:
            raise KvMoveError(FallbackCause.TIMEOUT, "timed out")
        return await measure(need)

    sharing.ensure_free = fails_after_an_erase  # type: ignore[method-assign]
    restoring = asyncio.ensure_future(coord.restore(a, 16))
    await settle()
    c = asyncio.ensure_future(coord.acquire("c", toks(7000, 50)))
    await settle()
    assert not c.done()  # every slot busy
    gate.set()
    await asyncio.wait_for(restoring, 5)
    assert a.route is Route.PREFILL and a.fallback is FallbackCause.TIMEOUT
    granted = await asyncio.wait_for(c, 5)  # x and a still hold theirs
    assert fake.erased == [1] and granted.slot.slot_id == 1
    for lease in (x, a, granted):
        coord.release(lease)
    check(coord)


async def test_a_request_without_room_waits_for_one_in_flight() -> None:
    s0 = sharing_server(2, free=600)
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    coord = coordinator(s0)
    a = await coord.acquire("a", toks(0, 400))
    await coord.restore(a, 100)  # reserves 500 of the 600
    b = await coord.acquire("b", toks(5000, 300))
    waiting = asyncio.ensure_future(coord.restore(b, 100))  # 400 more: not before a is done
    await settle()
    assert not waiting.done() and s0.reserved_cells == 500
    fake.held[a.slot.slot_id] = toks(0, 500).tolist()  # a's answer filled its 500 cells
    a.slot.tokens = toks(0, 500)
    s0.sharing.free = 100  # type: ignore[union-attr]
    coord.release(a)  # a's reservation ends; its idle slot is erased for b
    await asyncio.wait_for(waiting, 5)
    assert fake.erased == [a.slot.slot_id] and s0.reserved_cells == 400
    coord.release(b)
    check(coord)


async def test_no_room_and_nothing_in_flight_goes_ahead() -> None:
    s0 = sharing_server(1, free=10)
    coord = coordinator(s0)
    lease = await coord.acquire("a", toks(0, 100))
    await asyncio.wait_for(coord.restore(lease, 16), 5)  # the server will say no room itself
    assert s0.reserved_cells == 116
    coord.release(lease)
    check(coord)


async def test_moves_in_flight_count_against_the_tree_budget() -> None:
    s0 = server("s0", n_slots=1)
    coord = coordinator(s0)
    coord.tree.set_budget(40_000)
    for i in range(20):  # fill the tree with small prompts
        t = toks(10_000 * (i + 1), 100)
        coord.tree.insert(t, KvSegment.from_rows(0, LAYOUT, rows(t.tolist())))
    before = coord.tree.stats().bytes
    held = coord.tree.reserve(30_000)
    coord.tree.check_invariants()  # evicted to make room for the 30 kB held outside the tree
    assert coord.tree.stats().bytes <= 40_000 - 30_000 < before
    coord.tree.release(held)
    coord.tree.check_invariants()
    with pytest.raises(ValueError):
        coord.tree.release(1)


async def test_requests_go_only_to_servers_of_their_model_and_queue_per_model() -> None:
    a, b = server("s0", n_slots=1), server("s1", n_slots=1)
    a.model, b.model = "smol", "other"
    coord = coordinator(a, b)
    held = await coord.acquire("r0", toks(0, 20), model="smol")
    assert held.server is a
    # A second smol request waits for smol's slot; it never takes the idle server of "other".
    waiting = asyncio.create_task(coord.acquire("r1", toks(100, 20), model="smol"))
    await settle()
    assert not waiting.done()
    # A request for "other" is not stuck behind it.
    other = await asyncio.wait_for(coord.acquire("r2", toks(200, 20), model="other"), 1)
    assert other.server is b
    check(coord)
    coord.release(held)
    got = await asyncio.wait_for(waiting, 1)
    assert got.server is a
    for lease in (got, other):
        coord.release(lease)
    check(coord)


async def test_session_affinity_breaks_ties_but_never_beats_a_longer_prefix() -> None:
    s0, s1 = server("s0", n_slots=2), server("s1", n_slots=2)
    coord = coordinator(s0, s1)
    # alice lands on s1 while s0 is busy; once both are idle, fresh prompts cost the same
    # everywhere and her last server takes them (without affinity: s0, the lower index).
    other = await coord.acquire("r0", toks(0, 40))
    first = await coord.acquire("r1", toks(2000, 40), session="alice")
    assert (other.server, first.server) == (s0, s1)
    for lease in (other, first):
        coord.release(lease)
    s1.slots[first.slot.slot_id].tokens = np.zeros(0, np.int32)  # nothing reusable anywhere
    again = await coord.acquire("r1b", toks(1000, 40), session="alice")
    assert again.server is s1
    coord.release(again)
    s0.slots[0].tokens = np.zeros(0, np.int32)
    # A long prefix held on s0 wins over alice's affinity to s1.
    s0.slots[1].tokens = toks(5000, 200)
    moved = await coord.acquire("r2", toks(5000, 220), session="alice")
    assert moved.server is s0 and moved.plan.route == Route.A
    coord.release(moved)
    # Equal prompts, one server busier: a new session goes to the idler one.
    busy = await coord.acquire("r3", toks(3000, 40))
    assert busy.server is s0
    nxt = await coord.acquire("r4", toks(4000, 40), session="bob")
    assert nxt.server is s1
    for lease in (busy, nxt):
        coord.release(lease)
    check(coord)


async def test_the_affinity_map_keeps_a_digest_of_each_session_id() -> None:
    coord = coordinator(server("s0", n_slots=2))
    raw = "session-" + "x" * 8000  # a client may send up to 8 KB
    lease = await coord.acquire("r1", toks(0, 40), session=raw)
    coord.release(lease)
    (kept,) = coord.leases._affinity
    assert len(kept) == 32 and "session" not in kept
    again = await coord.acquire("r2", toks(100, 40), session=raw)
    assert list(coord.leases._affinity) == [kept]  # the same session finds its entry
    coord.release(again)
    check(coord)


async def test_a_slot_saving_its_answer_is_not_counted_as_load() -> None:
    s0, s1 = server("s0", n_slots=2), server("s1", n_slots=2)
    coord = coordinator(s0, s1)
    saving = await coord.acquire("r0", toks(0, 40))
    assert saving.server is s0
    saving.finishing = True  # its answer is complete; the slot is being exported
    running = await coord.acquire("r1", toks(1000, 40))
    assert running.server is s0  # s0 runs nothing: lower index
    nxt = await coord.acquire("r2", toks(2000, 40))
    assert nxt.server is s1  # s0 now runs one request
    for lease in (saving, running, nxt):
        coord.release(lease)
    check(coord)


async def test_move_lock_serves_restores_before_queued_saves() -> None:
    from proxy.server.coordinator.movelock import MoveLock

    lock = MoveLock()
    order: list[str] = []

    async def hold(name: str, first: bool) -> None:
        async with lock.first() if first else lock:
            order.append(name)
            await asyncio.sleep(0)

    await lock.acquire()  # a save in progress
    tasks = [
        asyncio.ensure_future(hold("save-1", False)),
        asyncio.ensure_future(hold("save-2", False)),
        asyncio.ensure_future(hold("restore-1", True)),
        asyncio.ensure_future(hold("restore-2", True)),
    ]
    cancelled = asyncio.ensure_future(hold("restore-cancelled", True))
    await settle()
    cancelled.cancel()
    await settle()
    lock.release()
    await asyncio.gather(*tasks)
    assert order == ["restore-1", "restore-2", "save-1", "save-2"]
    assert not lock.locked()


async def test_move_lock_passes_on_when_a_waiter_is_cancelled_after_the_handover() -> None:
    from proxy.server.coordinator.movelock import MoveLock

    lock = MoveLock()
    await lock.acquire()
    waiter = asyncio.ensure_future(lock.acquire(first=True))
    other = asyncio.ensure_future(lock.acquire())
    await settle()
    lock.release()  # handed to `waiter`, which is cancelled before it runs
    waiter.cancel()
    await asyncio.wait_for(other, 5)  # the lock went on to the next one
    assert lock.locked()
    lock.release()
    assert not lock.locked()


async def test_restore_time_and_lock_wait_are_recorded() -> None:
    s0 = sharing_server(2)
    coord = coordinator(s0)
    lease = await coord.acquire("a", toks(0, 100))
    await s0.move_lock.acquire()  # a save holds the lock
    restoring = asyncio.ensure_future(coord.restore(lease, 16))
    await asyncio.sleep(0.05)
    s0.move_lock.release()
    await restoring
    assert lease.lock_wait_s >= 0.04 and lease.restore_s >= lease.lock_wait_s
    decision = coord.record_decision(lease, {"cache_n": 0, "prompt_n": 100}, 0.1, 200)
    assert decision.lock_wait_s == lease.lock_wait_s
    coord.release(lease)
    check(coord)


async def test_no_room_within_the_queue_deadline_is_a_503() -> None:
    s0 = sharing_server(2, free=600)
    coord = coordinator(s0, queue_timeout_s=0.2)
    a = await coord.acquire("a", toks(0, 400))
    await coord.restore(a, 100)
    b = await coord.acquire("b", toks(5000, 300))
    with pytest.raises(Unavailable, match="no room"):
        await coord.restore(b, 100)
    assert s0.reserved_cells == 500 and b.reserved_cells == 0
    assert coord.metrics.rejected.labels("no_room")._value.get() == 1
    coord.release(b)
    coord.release(a)
    check(coord)


async def test_a_request_is_sent_after_the_restores_pending_on_its_server() -> None:
    s0 = server("s0", n_slots=2)
    coord = coordinator(s0)
    t = toks(0, 200)
    coord.tree.insert(t, KvSegment.from_rows(0, LAYOUT, rows(t.tolist())))
    first = await coord.acquire("a", toks(5000, 50))  # nothing to restore: sent at once...
    other = await coord.acquire("b", toks(0, 210))  # ...unless this one's host import is pending
    assert other.host is not None
    await s0.move_lock.acquire()  # a save holds the lock: b's import waits behind it
    importing = asyncio.ensure_future(coord.restore(other, 16))
    sending = asyncio.ensure_future(coord.restore(first, 16))
    await settle()
    assert not sending.done()  # waits for b's restore, so that both prefills run together
    s0.move_lock.release()
    await asyncio.wait_for(asyncio.gather(importing, sending), 5)
    assert other.route == Route.H or other.plan.host_to == 200
    coord.release(first)
    coord.release(other)
    check(coord)


async def test_only_the_answer_stays_reserved_once_the_prompt_is_computed() -> None:
    s0 = sharing_server(2, free=600)
    coord = coordinator(s0)
    a = await coord.acquire("a", toks(0, 400))
    await coord.restore(a, 100)
    assert s0.reserved_cells == 500
    a.prompt_computed()  # the first token came: the prompt's 400 cells show in the free count
    assert s0.reserved_cells == 100 and a.reserved_cells == 100
    a.prompt_computed()
    assert s0.reserved_cells == 100
    coord.release(a)
    assert s0.reserved_cells == 0
    check(coord)


async def test_requests_arriving_together_are_sent_after_each_others_restores() -> None:
    s0 = server("s0", n_slots=2)
    coord = coordinator(s0)
    t = toks(0, 200)
    coord.tree.insert(t, KvSegment.from_rows(0, LAYOUT, rows(t.tolist())))
    sent: list[str] = []

    async def handle(name: str, tokens: np.ndarray) -> Lease:
        lease = await coord.acquire(name, tokens)
        await coord.restore(lease, 16)
        sent.append(name)
        return lease

    await s0.move_lock.acquire()  # b's import will wait behind a save
    # a has nothing to restore and runs first, b's import is not pending yet when a is done
    tasks = [
        asyncio.ensure_future(handle("a", toks(5000, 50))),
        asyncio.ensure_future(handle("b", toks(0, 210))),
    ]
    await settle()
    assert sent == []  # a waits for b's restore
    s0.move_lock.release()
    leases = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert sorted(sent) == ["a", "b"]
    for lease in leases:
        coord.release(lease)
    check(coord)


async def test_a_short_headroom_alone_does_not_hold_a_request() -> None:
    s0 = sharing_server(2, free=950)
    sharing: FakeSharing = s0.sharing  # type: ignore[assignment]
    sharing.headroom = 100
    coord = coordinator(s0, queue_timeout_s=0.2)
    a = await coord.acquire("a", toks(0, 400))
    await coord.restore(a, 100)  # 500 + 100 headroom fit
    b = await coord.acquire("b", toks(5000, 300))
    await asyncio.wait_for(coord.restore(b, 100), 5)  # 900 fit in 950, not with the headroom
    assert s0.reserved_cells == 900
    coord.release(b)
    coord.release(a)
    check(coord)


async def test_a_promotion_the_tree_refuses_is_skipped_not_failed() -> None:
    """A disk promotion that raises (the tree cleared during the read, a refused segment)
    leaves the request planned without it: a prefill, never an error."""

    class RefusingDisk:
        calls = 0

        def would_promote(self, tree: RadixTree, tokens: np.ndarray, ns: str, floor: int = 0) -> bool:
            return True

        async def promote(self, tree: RadixTree, tokens: np.ndarray, ns: str, floor: int = 0) -> int:
            RefusingDisk.calls += 1
            raise ValueError("segment starts at 120, the tree's path ends at 0")

    coord = coordinator(server("s0"))
    coord.disk = RefusingDisk()  # type: ignore[assignment]
    lease = await coord.acquire("r0", toks(0, 200))
    assert RefusingDisk.calls == 1
    assert lease.plan.route == Route.PREFILL and lease.host is None
    coord.release(lease)
    check(coord)
