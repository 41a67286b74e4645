"""The arena's pure bookkeeping (proxy/core/arena.py) and the core's view of arena blocks:
chunk bounds, the range allocator, blobs parsed as views, the tree's accounting of them."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.arena import ARENA_ALIGN, RangeAllocator, aligned, auto_chunk, chunk_bounds
from proxy.core.payload import KvLayout, KvSegment, build_blob, parse_blob
from proxy.core.radix import RadixTree

LAYOUT = KvLayout(2, (1, 1), (8, 8), (1, 1), False, (8, 8), (0, 0), (0, 0))


@pytest.mark.parametrize(
    ("p0", "p1", "chunk", "want"),
    [
        (0, 10, 4, [(0, 4), (4, 8), (8, 10)]),
        (3, 10, 4, [(3, 4), (4, 8), (8, 10)]),
        (4, 8, 4, [(4, 8)]),
        (5, 6, 256, [(5, 6)]),
        (0, 512, 256, [(0, 256), (256, 512)]),
    ],
)
def test_chunks_are_cut_at_multiples_of_the_chunk(
    p0: int, p1: int, chunk: int, want: list[tuple[int, int]]
) -> None:
    assert chunk_bounds(p0, p1, chunk) == want


@given(st.integers(0, 5000), st.integers(1, 3000), st.integers(1, 700))
def test_chunks_cover_the_range_once_and_line_up(p0: int, n: int, chunk: int) -> None:
    bounds = chunk_bounds(p0, p0 + n, chunk)
    assert bounds[0][0] == p0 and bounds[-1][1] == p0 + n
    for (_, b), (c, _) in zip(bounds, bounds[1:], strict=False):
        assert b == c and b % chunk == 0
    assert all(0 < b - a <= chunk and a // chunk == (b - 1) // chunk for a, b in bounds)


@pytest.mark.parametrize(("p0", "p1", "chunk"), [(0, 0, 4), (5, 3, 4), (0, 4, 0), (-1, 4, 4)])
def test_bad_chunk_requests_are_errors(p0: int, p1: int, chunk: int) -> None:
    with pytest.raises(ValueError):
        chunk_bounds(p0, p1, chunk)


def test_the_allocator_reuses_and_merges_freed_ranges() -> None:
    alloc = RangeAllocator(10 * ARENA_ALIGN)
    a, b, c = (alloc.alloc(ARENA_ALIGN * 3) for _ in range(3))
    assert (a, b, c) == (0, 3 * ARENA_ALIGN, 6 * ARENA_ALIGN)
    assert alloc.alloc(2 * ARENA_ALIGN) is None  # one page left
    alloc.free(0)
    alloc.free(3 * ARENA_ALIGN)  # merged with the first: 6 pages in one range
    assert alloc.largest_free() == 6 * ARENA_ALIGN
    assert alloc.alloc(6 * ARENA_ALIGN) == 0
    alloc.check_invariants()
    with pytest.raises(ValueError):
        alloc.free(ARENA_ALIGN)  # not the start of an allocation
    assert alloc.alloc(1) == 9 * ARENA_ALIGN and alloc.used == 10 * ARENA_ALIGN


@settings(max_examples=200)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ARENA_ALIGN)), max_size=80))
def test_the_allocator_never_overlaps_and_accounts_exactly(ops: list[tuple[bool, int]]) -> None:
    alloc = RangeAllocator(40 * ARENA_ALIGN)
    live: dict[int, int] = {}
    for do_free, n in ops:
        if do_free and live:
            offset = sorted(live)[n % len(live)]
            assert alloc.free(offset) == live.pop(offset)
        else:
            got = alloc.alloc(n)
            if got is None:
                assert alloc.largest_free() < aligned(n)
            else:
                assert got % ARENA_ALIGN == 0 and got + aligned(n) <= alloc.capacity
                live[got] = aligned(n)
        spans = sorted((o, o + s) for o, s in live.items())
        assert all(e <= s2 for (_, e), (s2, _) in zip(spans, spans[1:], strict=False))
        assert alloc.used == sum(live.values())
        alloc.check_invariants()
    for offset in list(live):
        alloc.free(offset)
    assert alloc.largest_free() == alloc.capacity


def _segment(p0: int, n: int, seed: int = 1) -> KvSegment:
    rng = np.random.default_rng(seed)
    return KvSegment.from_rows(p0, LAYOUT, rng.integers(0, 60, (n, LAYOUT.bytes_per_token), dtype=np.uint8))


def test_a_sorted_blob_parses_as_views_of_its_buffer() -> None:
    seg = _segment(256, 40)
    raw = np.frombuffer(bytearray(build_blob([seg])), np.uint8)
    view = parse_blob(raw, LAYOUT, view=True)
    assert view == seg and view.owner is raw.base
    raw[-1] ^= 0xFF  # the view reads the buffer itself
    assert view != seg
    copied = parse_blob(raw, LAYOUT)
    assert copied.owner is not raw.base


def test_a_blob_out_of_position_order_is_copied_even_as_a_view() -> None:
    seg = _segment(0, 4)
    blob = bytearray(build_blob([seg]))
    # Swap the positions of cells 0 and 1 in the cell table (12 bytes per cell after 16 header bytes).
    cells = np.frombuffer(blob, np.uint8)[16 : 16 + 4 * 12].view("<i4").reshape(4, 3)
    cells[[0, 1], 0] = cells[[1, 0], 0]
    out = parse_blob(np.frombuffer(blob, np.uint8), LAYOUT, view=True)
    assert out.owner is not blob and out.n == 4


def test_a_whole_block_segment_keeps_nothing_extra_and_a_slice_does() -> None:
    seg = _segment(0, 32)
    blob = build_blob([seg])
    plain = parse_blob(np.frombuffer(bytearray(blob), np.uint8), LAYOUT, view=True)
    assert plain.keeps_extra()  # a plain buffer: its headers count against the segment

    # What the arena's blocks are (proxy/server/dataplane/arena.py): a ctypes array that knows its KV bytes.
    block_type: Any = type("Block", (ctypes.c_ubyte * len(blob),), {"kv_nbytes": -1})
    home: Any = block_type.from_buffer_copy(blob)
    view = parse_blob(np.frombuffer(home, np.uint8), LAYOUT, view=True)
    home.kv_nbytes = view.nbytes
    assert view.owner is home
    assert not view.keeps_extra() and view.slice(0, 16).keeps_extra()
    tree = RadixTree(1 << 20, LAYOUT)
    tree.insert(np.arange(32, dtype=np.int32), view)
    (kept,) = tree.segments(tree.match(np.arange(32, dtype=np.int32)), 0, 32)
    assert kept.owner is home  # stored as it is, not copied


def test_insert_run_stores_each_chunk_as_an_edge_and_stops_when_full() -> None:
    tokens = np.arange(100, 200, dtype=np.int32)
    run = [_segment(a, b - a, a) for a, b in chunk_bounds(0, 100, 32)]
    tree = RadixTree(1 << 20, LAYOUT)
    assert tree.insert_run(tokens, run) == 100
    assert tree.stats().nodes == 4
    assert tree.segments(tree.match(tokens), 0, 100) == run
    tree.check_invariants()
    small = RadixTree(40 * (LAYOUT.bytes_per_token + 4) + 2 * 512, LAYOUT)
    stored = small.insert_run(tokens, run)
    assert 32 <= stored < 100 and small.match(tokens).length == stored
    small.check_invariants()


def test_evict_lru_leaf_takes_the_oldest_unpinned_leaf() -> None:
    tree = RadixTree(1 << 20, LAYOUT)
    a, b = np.arange(10, dtype=np.int32), np.arange(50, 60, dtype=np.int32)
    tree.insert(a, _segment(0, 10))
    tree.insert(b, _segment(0, 10, 2))
    tree.pin(tree.match(a))
    assert tree.evict_lru_leaf()  # a is older but pinned: b goes
    assert tree.match(b).length == 0 and tree.match(a).length == 10
    assert not tree.evict_lru_leaf()
    tree.check_invariants()


@pytest.mark.parametrize(
    ("bytes_per_token", "tokens"),
    [
        (23_040, 512),  # SmolLM2-135M f16: 11.25 MiB blocks
        (524_288, 32),  # a 7B llama f16: 16 MiB
        (64, 4096),  # tiny: capped
        (8 << 20, 16),  # huge: floored
    ],
)
def test_auto_chunk_aims_at_16_mib_blocks(bytes_per_token: int, tokens: int) -> None:
    assert auto_chunk(bytes_per_token) == tokens
    assert tokens & (tokens - 1) == 0
