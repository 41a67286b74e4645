"""The arena's bookkeeping: byte ranges of one shared-memory region, and the chunks of a move.

The host tree's KV lives in one region made and faulted in once at startup
(proxy/server/dataplane/arena.py). Same-host servers map it too: an export writes each chunk's payload
blob straight into a range the proxy reserved, and an import reads whole chunks from where
they lie, so a move is one copy (docs/design.md, "The arena"). This module is the pure part:
which ranges are free, and where a move's chunks start and end.

Chunks are cut at absolute positions that are multiples of the chunk size, so the chunks of
one prompt line up across exports, and an import of a prefix reads whole chunks except where
a radix-tree edge was split inside one (at most one partial chunk on each side of a split).

Pure: no I/O, no asyncio.
"""

from __future__ import annotations

import bisect

ARENA_ALIGN = 4096  # every range starts on a page: blobs are copied page by page


def chunk_bounds(p0: int, p1: int, chunk: int) -> list[tuple[int, int]]:
    """``[p0, p1)`` cut at the positions that are multiples of ``chunk`` (the server cuts an
    export with ``"chunk"`` the same way, docs/kvctl.md)."""
    if chunk <= 0 or p0 < 0 or p1 <= p0:
        raise ValueError(f"cannot cut [{p0},{p1}) into chunks of {chunk}")
    out, a = [], p0
    while a < p1:
        b = min(p1, (a // chunk + 1) * chunk)
        out.append((a, b))
        a = b
    return out


BLOCK_TARGET_BYTES = 16 << 20  # the KV of one block with --kv-arena-chunk 0 (auto)


def auto_chunk(bytes_per_token: int) -> int:
    """Tokens per block for about BLOCK_TARGET_BYTES of KV: a power of two in [16, 4096]. Each
    block costs the server a fixed ~0.1 ms per move on top of its copy (measured in
    docs/results/2026-12-04-arena/), so blocks of a fixed size keep that a small share of the
    copy, for any model; a split inside a block stages at most one block."""
    tokens = max(1, BLOCK_TARGET_BYTES // max(1, bytes_per_token))
    return min(4096, max(16, 1 << (tokens.bit_length() - 1)))


def aligned(nbytes: int) -> int:
    return -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN


class RangeAllocator:
    """First-fit allocation of page-aligned byte ranges in ``[0, capacity)``.

    Free ranges are kept coalesced (no two adjacent), sorted by start. Allocations are
    remembered by offset, so a double or foreign free is an error, never a corruption."""

    def __init__(self, capacity: int) -> None:
        if capacity < ARENA_ALIGN:
            raise ValueError(f"an arena of {capacity} bytes is smaller than one page")
        self.capacity = capacity - capacity % ARENA_ALIGN
        self._starts: list[int] = [0]  # sorted starts of the free ranges
        self._ends: dict[int, int] = {0: self.capacity}  # free range start -> end
        self._taken: dict[int, int] = {}  # allocated offset -> aligned size
        self.used = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return max((end - start for start, end in self._ends.items()), default=0)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a new range of at least ``nbytes``, or None when no free range fits."""
        size = aligned(max(nbytes, 1))
        for i, start in enumerate(self._starts):
            end = self._ends[start]
            if end - start < size:
                continue
            del self._ends[start]
            if end - start == size:
                del self._starts[i]
            else:
                self._starts[i] = start + size  # still sorted: the rest of the same range
                self._ends[start + size] = end
            self._taken[start] = size
            self.used += size
            return start
        return None

    def free(self, offset: int) -> int:
        """Give back the range allocated at ``offset``; returns its size."""
        size = self._taken.pop(offset, None)
        if size is None:
            raise ValueError(f"no range allocated at {offset}")
        self.used -= size
        start, end = offset, offset + size
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == end:  # merge with the next free range
            end = self._ends.pop(end)
            del self._starts[i]
        if i > 0 and self._ends[self._starts[i - 1]] == start:  # and with the previous one
            self._ends[self._starts[i - 1]] = end
        else:
            self._starts.insert(i, start)
            self._ends[start] = end
        return size

    def check_invariants(self) -> None:
        """Recompute from the ranges; raise AssertionError naming what broke."""
        assert self._starts == sorted(self._ends), "free starts out of step"
        spans = sorted(
            [(s, e, "free") for s, e in self._ends.items()]
            + [(o, o + n, "taken") for o, n in self._taken.items()]
        )
        pos = 0
        for (start, end, kind), nxt in zip(spans, [*spans[1:], None], strict=True):
            assert start == pos, f"gap or overlap at {pos}: next range starts at {start}"
            assert end > start and start % ARENA_ALIGN == 0, f"bad {kind} range [{start},{end})"
            if kind == "free" and nxt is not None:
                assert nxt[2] == "taken", f"free ranges [{start},{end}) and {nxt[:2]} not merged"
            pos = end
        assert pos == self.capacity, f"ranges end at {pos}, capacity {self.capacity}"
        assert self.used == sum(self._taken.values()), "used out of step"
