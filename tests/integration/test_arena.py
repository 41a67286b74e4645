"""The KV arena on a real patched server (issue 28 items 1-2): exports land in arena blocks
and stay there as the tree's segments (no proxy copy), imports read whole blocks in place and
stage only partial ones, failures free or quarantine blocks, and a full arena falls back to
payload files. Every move is checked byte for byte by exporting again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from proxy.config import Config
from proxy.core.arena import chunk_bounds
from proxy.core.payload import KvLayout, KvSegment, build_blob
from proxy.errors import FallbackCause, KvMoveError
from proxy.native.launch import ServerProcess
from proxy.server.dataplane.arena import Arena, ArenaBlock
from proxy.server.dataplane.backend import ServerClient
from proxy.server.dataplane.mover import KvMover
from proxy.server.metrics import Metrics
from tests.helpers import ProxyThread, ServerFactory, prefill_slot, proxy_config, request

PROMPT = (
    "The survey ship mapped the reef one sounding at a time: depth, bottom, current, and the "
    "colour of the water at noon. The charts it left were used for a century. "
) * 12
CHUNK = 64


@pytest.fixture(scope="module")
def server(start_server: ServerFactory, patched_bin: Any) -> ServerProcess:
    return start_server(patched_bin, threads=1)


def _held(server: ServerProcess, slot: int) -> list[int]:
    return prefill_slot(server, slot, PROMPT)


@asynccontextmanager
async def _mover(server: ServerProcess, capacity: int) -> AsyncIterator[tuple[KvMover, Arena, Metrics]]:
    assert server.spec.kvctl_dir is not None
    arena = Arena.create(server.spec.kvctl_dir, capacity)
    try:
        async with aiohttp.ClientSession() as session:
            backend = ServerClient(server.url, session, server.spec.kvctl_key)
            caps = await backend.caps()
            assert caps.export_chunks
            compat = dict(caps.compat)
            metrics = Metrics(CollectorRegistry(), ("s0",))
            mover = KvMover(
                backend,
                KvLayout.from_caps(compat),
                compat,
                server.spec.kvctl_dir,
                metrics,
                arena=arena,
                chunk_tokens=CHUNK,
            )
            yield mover, arena, metrics
            mover.close()
    finally:
        arena.close()


def _moved(metrics: Metrics, direction: str, path: str) -> float:
    return metrics.value("radix_arena_move_bytes_total", direction=direction, path=path)


def test_exports_stay_in_arena_blocks_and_imports_read_them_in_place(server: ServerProcess) -> None:
    tokens = _held(server, 0)
    n = len(tokens)
    assert n > 3 * CHUNK

    async def run() -> None:
        async with _mover(server, 64 << 20) as (mover, arena, metrics):
            head = await mover.export({"slot": 0}, 0, tokens[:100])
            tail = await mover.export({"slot": 0}, 100, tokens)  # p0 not on a chunk boundary
            run = head + tail
            assert [(s.p0, s.p1) for s in tail] == chunk_bounds(100, n, CHUNK)
            # Every segment is the whole KV of its own arena block: nothing was copied out.
            blocks = [arena.whole_block(s) for s in run]
            assert all(isinstance(b, ArenaBlock) for b in blocks)
            assert len({id(b) for b in blocks}) == len(run)
            assert _moved(metrics, "export", "in_place") == sum(s.nbytes for s in run)
            assert _moved(metrics, "export", "file") == 0

            # Whole blocks: imported in place, no staging.
            await mover.import_(1, 0, tokens, run)
            assert _moved(metrics, "import", "staged") == 0
            again = await mover.export({"slot": 1}, 0, tokens)
            assert build_blob(again) == build_blob(run)  # byte for byte

            # A path split inside a block (as a tree edge split leaves it): the partial pieces
            # are staged, the rest read in place, and the slot holds the same bytes.
            cut = tail[1].p0 + 10
            pieces = [
                *head,
                tail[0],
                tail[1].slice(tail[1].p0, cut),
                tail[1].slice(cut, tail[1].p1),
                *tail[2:],
            ]
            await mover.import_(2, 0, tokens, pieces)
            staged = _moved(metrics, "import", "staged")
            assert staged == tail[1].nbytes
            assert build_blob(await mover.export({"slot": 2}, 0, tokens)) == build_blob(run)

    asyncio.run(run())


def test_failed_moves_free_their_blocks_and_unanswered_ones_are_quarantined(server: ServerProcess) -> None:
    tokens = _held(server, 0)

    async def run() -> None:
        async with _mover(server, 32 << 20) as (mover, arena, metrics):
            assert arena.stats()["used"] == 0
            # Refused (slot 1 does not hold these tokens): answered, so its blocks are free.
            with pytest.raises(KvMoveError) as err:
                await mover.export({"slot": 1}, 0, tokens[::-1])
            assert err.value.cause == FallbackCause.CONFLICT
            assert arena.stats() == {"capacity": arena.capacity, "used": 0, "quarantined": 0}
            run = await mover.export({"slot": 0}, 0, tokens)
            used = arena.stats()["used"]
            with pytest.raises(KvMoveError):  # slot 3 does not hold [0, 50): refused
                await mover.import_(3, 50, tokens, [s for s in _from(run, 50)])
            assert arena.stats()["used"] == used and arena.stats()["quarantined"] == 0
            # Cancelled before its answer (at its first wait, on the way to the server): the server
            # may still get it and write the blocks.
            task = asyncio.ensure_future(mover.export({"slot": 0}, 0, tokens))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert arena.stats()["quarantined"] > 0
            del run
            assert arena.stats()["used"] == arena.stats()["quarantined"]
            # More than an eighth of the arena kept for one server: its moves use files now.
            assert arena.stats()["quarantined"] > arena.capacity // 8
            again = await mover.export({"slot": 0}, 0, tokens)
            assert _moved(metrics, "export", "file") == sum(s.nbytes for s in again)
            assert arena.stats()["used"] == arena.stats()["quarantined"]
            await mover.import_(1, 0, tokens, again)
            assert _moved(metrics, "import", "file") > 0
            # The server as a new process (what it never answered is gone): the arena again.
            mover.new_instance()
            assert arena.stats()["quarantined"] == 0
            last = await mover.export({"slot": 0}, 0, tokens)
            assert all(arena.whole_block(s) is not None for s in last)
            assert build_blob(last) == build_blob(again)

    asyncio.run(run())


def _from(run: list[KvSegment], p0: int) -> list[KvSegment]:
    return [s.slice(max(s.p0, p0), s.p1) for s in run if s.p1 > p0]


def test_a_full_arena_falls_back_to_payload_files(server: ServerProcess) -> None:
    tokens = _held(server, 0)

    async def run() -> None:
        async with _mover(server, 1 << 20) as (mover, _, metrics):  # smaller than one chunk's blob
            (seg,) = await mover.export({"slot": 0}, 0, tokens)
            assert metrics.value("radix_arena_full_total", direction="export") == 1
            assert _moved(metrics, "export", "file") == seg.nbytes
            await mover.import_(1, 0, tokens, [seg])
            assert metrics.value("radix_arena_full_total", direction="import") == 1
            assert build_blob(await mover.export({"slot": 1}, 0, tokens)) == build_blob([seg])

    asyncio.run(run())


def test_the_proxy_keeps_its_tree_in_the_arena_and_restores_from_it(
    server: ServerProcess, stock_server: ServerProcess
) -> None:
    config = proxy_config(server, cache_ram_mib=128, kv_arena_chunk=CHUNK)
    assert Config.kv_arena and config.kv_arena
    thread = ProxyThread(config).start()
    try:
        body = {
            "prompt": PROMPT + " What did the ship map?",
            "n_predict": 8,
            "temperature": 0,
            "cache_prompt": True,
        }
        first = request(thread.url + "/v1/completions", "POST", body, timeout=300)
        assert first.status == 200, first.body
        thread.settle()  # saved into the arena, and the slot's KV released (--cache-idle-release)
        again = request(thread.url + "/v1/completions", "POST", body, timeout=300)
        assert again.status == 200 and again.body["choices"][0]["text"] == first.body["choices"][0]["text"]
        want = request(stock_server.url + "/v1/completions", "POST", body, timeout=300)
        assert want.body["choices"][0]["text"] == first.body["choices"][0]["text"]

        def facts(rt: Any) -> dict[str, Any]:
            tree = rt.coordinator.tree
            owners = [type(n.segment.owner).__mro__[1] for n in tree._iter_nodes()]
            return {
                "arena": rt.arena is not None and rt.arena.capacity == 128 << 20,
                "in_arena": owners.count(ArenaBlock),
                "nodes": len(owners),
                "in_place": rt.metrics.value(
                    "radix_arena_move_bytes_total", direction="import", path="in_place"
                ),
            }

        got = thread.call(facts)
        assert got["arena"] and got["nodes"] > 1 and got["in_arena"] == got["nodes"]
        assert got["in_place"] > 0
    finally:
        thread.stop()
