"""The arena file (proxy/server/dataplane/arena.py): made and mapped at startup, blocks freed when the
last view of them goes, quarantine, stale arenas of dead proxies, a clear error when there is
no room."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from proxy.core.payload import KvLayout, KvSegment, build_blob, parse_blob
from proxy.core.radix import RadixTree
from proxy.errors import FallbackCause, KvMoveError
from proxy.server.dataplane.arena import ARENA_PREFIX, Arena, is_shared_memory, page_note, sweep_stale_arenas
from proxy.server.dataplane.paydir import make_private_dir

LAYOUT = KvLayout(2, (1, 1), (8, 8), (1, 1), False, (8, 8), (0, 0), (0, 0))
MIB = 1 << 20


@pytest.fixture
def shm() -> Iterator[Path]:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    path = make_private_dir(Path("/dev/shm"), "radix-arena-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _arena_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith(ARENA_PREFIX))


def test_the_arena_is_made_whole_and_removed_on_close(shm: Path) -> None:
    arena = Arena.create(shm, 4 * MIB)
    (name,) = _arena_files(shm)
    assert name == arena.name and os.stat(shm / name).st_size == 4 * MIB
    assert os.stat(shm / name).st_blocks * 512 >= 4 * MIB  # every page allocated up front
    assert is_shared_memory(shm) and "pages" in arena.note
    arena.close()
    assert _arena_files(shm) == []


def test_a_block_is_free_once_nothing_views_it(shm: Path) -> None:
    arena = Arena.create(shm, 1 * MIB)
    seg = KvSegment.from_rows(0, LAYOUT, np.full((30, LAYOUT.bytes_per_token), 7, np.uint8))
    blob = build_blob([seg])
    blocks = arena.take([len(blob)])
    assert blocks is not None
    block: Any = blocks.pop()
    np.frombuffer(block, np.uint8, count=len(blob))[...] = np.frombuffer(blob, np.uint8)
    view = parse_blob(np.frombuffer(block, np.uint8, count=block.blob_size), LAYOUT, view=True)
    block.kv_nbytes = view.nbytes
    # The mapping holds what the view reads.
    assert bytes(arena.mm[block.offset : block.offset + len(blob)]) == blob
    assert arena.whole_block(view) is block and arena.whole_block(view.slice(0, 10)) is None
    assert arena.whole_block(seg) is None  # heap memory: not ours
    del block
    gc.collect()
    assert arena.stats()["used"] > 0  # the view keeps it
    del view
    assert arena.stats()["used"] == 0
    arena.close()


def test_take_is_all_or_none_and_asks_for_room(shm: Path) -> None:
    arena = Arena.create(shm, 1 * MIB)
    held = arena.take([400_000, 400_000])
    assert held is not None and arena.take([400_000]) is None
    calls = []

    def make_room() -> bool:
        calls.append(1)
        if held:
            held.pop()
            return True
        return False

    got = arena.take([400_000, 400_000], make_room)
    assert got is not None and len(calls) == 2
    assert arena.take([2 * MIB], make_room) is None  # never fits: gives up once nothing is left
    del got
    assert arena.stats()["used"] == 0
    arena.close()


def test_quarantined_blocks_are_never_reused(shm: Path) -> None:
    arena = Arena.create(shm, 1 * MIB)
    blocks = arena.take([600_000])
    assert blocks is not None
    arena.quarantine(blocks)
    del blocks
    assert arena.take([600_000]) is None
    assert arena.stats()["quarantined"] == 602_112  # whole pages
    arena.close()


def test_arenas_of_dead_proxies_are_removed_live_ones_kept(shm: Path) -> None:
    live = Arena.create(shm, 1 * MIB)
    # A proxy that died: its file is there, its lock gone with its process.
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from proxy.server.dataplane.arena import Arena; from pathlib import Path; Arena.create(Path({str(shm)!r}), 1 << 20)",
        ],
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert len(_arena_files(shm)) == 2
    again = Arena.create(shm, 1 * MIB)
    assert _arena_files(shm) == sorted([live.name, again.name])
    live.close()
    again.close()


def test_no_room_is_a_startup_error_naming_the_size_and_the_fix(shm: Path) -> None:
    # A file size limit below the arena (as a full or small tmpfs would): posix_fallocate fails.
    code = (
        "import resource, signal; from pathlib import Path; from proxy.server.dataplane.arena import Arena\n"
        "from proxy.errors import ConfigError\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        f"try:\n    Arena.create(Path({str(shm)!r}), 64 << 20)\n"
        "except ConfigError as e:\n    print(e.message, '|', e.fix)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    ).stdout
    assert "64 MiB KV arena" in out and "--kv-arena off" in out and "--cache-ram" in out
    assert _arena_files(shm) == []  # nothing left behind


def test_the_page_note_names_the_file_system() -> None:
    assert "not shared memory" in page_note(Path("/proc")) or "pages" in page_note(Path("/proc"))
    assert "pages" in page_note(Path("/dev/shm"))


def test_the_trees_own_copies_go_into_blocks_of_their_own(shm: Path) -> None:
    arena = Arena.create(shm, 1 * MIB)
    tree = RadixTree(1 * MIB, LAYOUT)
    tree.copier = arena.copy
    seg = KvSegment.from_rows(
        0, LAYOUT, np.arange(40 * LAYOUT.bytes_per_token, dtype=np.uint8).reshape(40, -1)
    )
    a, b = (
        np.arange(40, dtype=np.int32),
        np.concatenate([np.arange(20), np.arange(500, 520)]).astype(np.int32),
    )
    tree.insert(a, seg)
    # A second prompt that shares 20 tokens splits the edge (two views of one buffer) ...
    tree.insert(b, KvSegment.from_rows(0, LAYOUT, np.zeros((40, LAYOUT.bytes_per_token), np.uint8)))
    # ... and evicting the lower half copies the upper one out: into the arena.
    tree.evict_lru_leaf()
    tree.evict_lru_leaf()
    (upper,) = tree.segments(tree.match(a[:20]), 0, 20)
    assert arena.whole_block(upper) is not None and upper == seg.slice(0, 20)
    tree.check_invariants()
    assert arena.stats()["used"] > 0
    del upper
    tree.clear()
    assert arena.stats()["used"] == 0
    arena.close()


def test_a_new_server_process_frees_what_its_old_one_never_answered(shm: Path) -> None:
    arena = Arena.create(shm, 1 * MIB)
    mine, other = object(), object()
    for whose in (mine, other):
        blocks = arena.take([100_000])
        assert blocks is not None
        arena.quarantine_unanswered(TimeoutError(), blocks, whose)  # not a KvMoveError: unanswered
        del blocks
    answered = arena.take([100_000])
    assert answered is not None
    arena.quarantine_unanswered(KvMoveError(FallbackCause.CONFLICT, "409"), answered, mine)
    del answered
    assert arena.stats()["quarantined"] == 2 * 102_400 == arena.stats()["used"]
    arena.release_quarantine(mine)
    assert arena.stats()["quarantined"] == 102_400 == arena.stats()["used"]
    arena.close()


def _shmem_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1])
    return 0


def test_closing_gives_the_memory_back_even_while_views_live(shm: Path) -> None:
    before = _shmem_kib()
    arena = Arena.create(shm, 64 * MIB)
    assert _shmem_kib() - before >= 60 * 1024  # faulted in at startup, counted once
    blocks = arena.take([MIB])
    assert blocks is not None
    view = np.frombuffer(cast(Any, blocks[0]), np.uint8)
    view[:] = 7
    arena.close()  # the view keeps the mapping, but not its memory
    assert _shmem_kib() - before < 4 * 1024
    assert _arena_files(shm) == []
    assert int(view[0]) == 0  # reads as a hole, never faults


def test_up_sweeps_the_arenas_of_killed_runs_in_their_own_directories(shm: Path) -> None:
    dead, live, other, empty = (
        make_private_dir(shm, p) for p in ("radix-0-1-", "radix-0-2-", "keep-", "radix-0-3-")
    )
    code = "from proxy.server.dataplane.arena import Arena; from pathlib import Path; import sys; Arena.create(Path(sys.argv[1]), 1 << 20)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    for path in (dead, other):  # a proxy that died there
        subprocess.run([sys.executable, "-c", code, str(path)], check=True, env=env)
    running = Arena.create(live, MIB)
    sweep_stale_arenas(shm, "radix-0-")
    assert not dead.exists()  # its arena gone, and the emptied directory with it
    assert _arena_files(live) == [running.name]
    assert len(_arena_files(other)) == 1  # not ours by name: untouched
    assert empty.exists()  # a live proxy's without an arena (--kv-arena off) is left alone
    running.close()


def test_a_quarantined_move_keeps_its_memory_at_close(shm: Path) -> None:
    before = _shmem_kib()
    arena = Arena.create(shm, 16 * MIB)
    blocks = arena.take([MIB])
    assert blocks is not None
    np.frombuffer(cast(Any, blocks[0]), np.uint8)[:] = 7
    arena.quarantine(blocks)  # a server may still read it: never punched out under it
    keep = blocks[0]
    arena.close()
    assert _shmem_kib() - before >= 15 * 1024 and int(np.frombuffer(cast(Any, keep), np.uint8)[0]) == 7


def test_disk_promotions_are_read_into_blocks_one_per_chunk(shm: Path, tmp_path: Path) -> None:
    """KV read back from the disk tier lands in arena blocks cut as an export's chunks (whole
    blocks: imported in place later, and counted in the arena); with no room, in ordinary
    memory, counted under promote."""
    from proxy.server.tiers.disk import DiskTier
    from tests.unit.test_disk_io import opened

    full: list[int] = []

    async def tier(arena: Arena) -> DiskTier:
        return await opened(
            tmp_path / "tier",
            layout=LAYOUT,
            arena=arena,
            chunk_tokens=16,
            on_arena_full=lambda: full.append(1),
        )

    async def main() -> None:
        arena = Arena.create(shm, MIB)
        tokens = np.arange(100, 140, dtype=np.int32)
        rows = np.random.default_rng(9).integers(0, 256, (40, LAYOUT.bytes_per_token), dtype=np.uint8)
        kv = KvSegment.from_rows(0, LAYOUT, rows)
        first = await tier(arena)
        old = RadixTree(budget_bytes=1 << 20, layout=LAYOUT)
        old.insert(tokens, kv)
        await first.close(old, 10)  # written to disk at shutdown

        again = await tier(arena)
        tree = RadixTree(budget_bytes=1 << 20, layout=LAYOUT)
        arena.make_room = tree.evict_lru_leaf
        assert await again.promote(tree, tokens, "") == 40
        segs = tree.segments(tree.match(tokens))
        assert [(s.p0, s.p1) for s in segs] == [(0, 16), (16, 32), (32, 40)]
        assert all(arena.whole_block(s) is not None for s in segs)
        assert KvSegment.concat(segs) == kv and not full
        used = arena.stats()["used"]
        assert used >= 3 * 4096

        # A damaged entry: nothing inserted, and the read's blocks are free at once (not when
        # the collector finds the traceback that views them).
        (entry,) = (tmp_path / "tier").iterdir()
        raw = bytearray(entry.read_bytes())
        raw[-2] ^= 0xFF
        entry.write_bytes(bytes(raw))
        damaged = RadixTree(budget_bytes=1 << 20, layout=LAYOUT)
        gc.disable()
        try:
            assert await again.promote(damaged, tokens, "") == 0
            assert arena.stats()["used"] == used and damaged.match(tokens).length == 0
        finally:
            gc.enable()
        entry.write_bytes(bytes(raw[:-2]) + bytes([raw[-2] ^ 0xFF, raw[-1]]))  # as it was
        again.index.check_invariants()

        again = await tier(arena)  # the damaged entry was deleted: index it again
        other = RadixTree(budget_bytes=1 << 20, layout=LAYOUT)
        arena.make_room = None
        hog = arena.take([arena.capacity - used])  # nothing left, nothing evictable
        assert hog is not None
        assert await again.promote(other, tokens, "") == 40
        (seg,) = other.segments(other.match(tokens))
        assert arena.whole_block(seg) is None and seg == kv and full == [1]
        await again.close(None, 10)
        del segs, seg, hog
        tree.check_invariants()
        arena.close()

    asyncio.run(main())


def test_a_server_may_keep_at_most_an_eighth_of_the_arena_quarantined(shm: Path) -> None:
    arena = Arena.create(shm, MIB)
    hung, other = object(), object()
    blocks = arena.take([MIB // 16] * 2)
    assert blocks is not None
    arena.quarantine(blocks[:1], hung)
    assert arena.may_move(hung) and arena.quarantined_by(hung) == MIB // 16
    arena.quarantine(blocks[1:], hung)  # now an eighth: no more moves through the arena
    assert not arena.may_move(hung) and arena.may_move(other)
    arena.release_quarantine(hung)
    assert arena.may_move(hung) and arena.stats()["quarantined"] == 0
    del blocks
    arena.close()


def test_evictions_that_free_nothing_stop_at_the_bytes_asked_for(shm: Path) -> None:
    """An evicted edge a disk write still holds (or one in ordinary memory) frees no range:
    a reservation evicts at most as many bytes as it asked for, then gives up."""
    arena = Arena.create(shm, MIB)
    hog = arena.take([MIB])
    assert hog is not None
    calls: list[int] = []

    def make_room() -> int:
        calls.append(1)
        return 25 * 4096  # an edge of that size evicted, its block still viewed elsewhere

    assert arena.take([75 * 4096], make_room) is None
    assert len(calls) == 3
    del hog
    arena.close()


def test_a_block_quarantined_twice_counts_once(shm: Path) -> None:
    arena = Arena.create(shm, MIB)
    server = object()
    blocks = arena.take([4096, 8192])
    assert blocks is not None
    arena.quarantine(blocks[:1], server)
    arena.quarantine(blocks, server)  # a hot prefix's block named again by another unanswered import
    assert arena.quarantined_by(server) == 3 * 4096 == arena.stats()["quarantined"]
    arena.quarantine(blocks[1:], None)  # another server's move named it too: still its bytes once
    assert arena.stats()["quarantined"] == 3 * 4096
    arena.release_quarantine(server)
    assert arena.stats()["quarantined"] == 8192
    del blocks
    arena.close()


def test_with_a_disk_tier_the_arena_holds_the_demotion_queue_too(tmp_path: Path) -> None:
    """Edges the tree evicted wait for their disk write in their blocks: outside the tree's
    budget, so the arena is --cache-ram plus the queue."""
    from proxy.config import Config
    from proxy.server.ops.startup import arena_bytes

    plain = Config(backends=("http://x",), cache_ram_mib=512)
    assert arena_bytes(plain) == plain.cache_bytes == 512 << 20
    disk = Config(backends=("http://x",), cache_ram_mib=512, cache_disk=tmp_path, cache_disk_queue_mib=64)
    assert arena_bytes(disk) == (512 + 64) << 20
