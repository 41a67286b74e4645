"""The disk tier's pure parts: the segment file format and the index (proxy/core/diskindex.py),
and the host tree's eviction hook that feeds it."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

import numpy as np
import pytest

from proxy.core.diskindex import (
    HEADER_BYTES,
    DiskEntry,
    DiskEntryError,
    DiskIndex,
    DropCause,
    EntryHeader,
    decode_header,
    encode_header,
    make_header,
    ns_digest,
    prefix_digests,
    tokens_digest,
    verify_entry,
)
from proxy.core.payload import KvLayout, KvSegment
from proxy.core.radix import RadixTree, Spill

KEY = b"k" * 32
SECRET = b"s" * 32
ROW = 8


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, ROW), dtype=np.uint8)


def file_bytes(path: list[int], start: int, key: bytes = KEY, ns: str = "") -> bytes:
    data = rows(len(path) - start, seed=len(path))
    header, toks = make_header(key, ns, np.asarray(path, np.int32), start, data)
    return encode_header(header, SECRET) + toks.tobytes() + data.tobytes()


# ---- the file format -----------------------------------------------------------------------


def test_a_file_round_trips() -> None:
    path = list(range(100, 140))
    raw = file_bytes(path, 10)
    header, toks, data = verify_entry(raw, KEY, SECRET)
    assert (header.start, header.n, header.row_bytes) == (10, 30, ROW)
    assert toks.tolist() == path[10:]
    assert np.array_equal(data, rows(30, seed=40))
    assert header.prefix == tokens_digest(path[:10]) and len(raw) == header.size
    assert header.name == decode_header(raw[:HEADER_BYTES], SECRET).name  # the name follows the content


def _flip(at: int) -> Callable[[bytes], bytes]:
    def f(raw: bytes) -> bytes:
        b = bytearray(raw)
        b[at if at >= 0 else len(b) + at] ^= 0x01
        return bytes(b)

    return f


@pytest.mark.parametrize(
    ("what", "mutate", "cause"),
    [
        ("magic byte", _flip(0), DropCause.HEADER),
        ("start field", _flip(80), DropCause.HEADER),
        ("header MAC", _flip(HEADER_BYTES - 1), DropCause.HEADER),
        ("a token id", _flip(HEADER_BYTES + 5), DropCause.TOKENS),
        ("a KV byte", _flip(-1), DropCause.CHECKSUM),
        ("cut inside the header", lambda r: r[: HEADER_BYTES - 3], DropCause.TRUNCATED),
        ("cut inside the data", lambda r: r[:-1], DropCause.TRUNCATED),
        ("a byte too many", lambda r: r + b"\0", DropCause.TRUNCATED),
        ("empty file", lambda r: b"", DropCause.TRUNCATED),
    ],
)
def test_every_damage_is_found_with_its_cause(
    what: str, mutate: Callable[[bytes], bytes], cause: DropCause
) -> None:
    raw = mutate(file_bytes(list(range(50)), 20))
    with pytest.raises(DiskEntryError) as err:
        verify_entry(raw, KEY, SECRET)
    assert err.value.cause == cause, what


def test_an_entry_whose_sums_were_recomputed_without_the_secret_is_refused() -> None:
    """Issue 31 item 8: with unkeyed sums, another entry's KV under this entry's tokens, with
    every sum recomputed, passed every check (and answered another prompt's answer)."""
    raw = file_bytes(list(range(50)), 20)
    header = decode_header(raw[:HEADER_BYTES], SECRET)
    other = rows(30, seed=999)  # some other prompt's KV, same size
    forged_header = dataclasses.replace(header, data=hashlib.sha256(other.tobytes()).digest())
    body = raw[HEADER_BYTES : HEADER_BYTES + 4 * header.n] + other.tobytes()
    for guess in (b"", b"s" * 31, b"t" * 32):  # the forger does not know the secret
        forged = encode_header(forged_header, guess) + body
        with pytest.raises(DiskEntryError) as err:
            verify_entry(forged, KEY, SECRET)
        assert err.value.cause == DropCause.HEADER
    verify_entry(encode_header(forged_header, SECRET) + body, KEY, SECRET)  # only the secret signs


def test_a_version_1_entry_is_refused() -> None:
    raw = bytearray(file_bytes(list(range(50)), 20))
    raw[8:12] = (1).to_bytes(4, "little")
    head = bytes(raw[: HEADER_BYTES - 32])
    raw[HEADER_BYTES - 32 : HEADER_BYTES] = hashlib.sha256(head).digest()  # version 1's plain sum
    with pytest.raises(DiskEntryError) as err:
        verify_entry(bytes(raw), KEY, SECRET)
    assert err.value.cause == DropCause.HEADER


def test_another_key_is_foreign_and_another_header_is_refused() -> None:
    raw = file_bytes(list(range(50)), 20)
    with pytest.raises(DiskEntryError) as err:
        verify_entry(raw, b"x" * 32, SECRET)
    assert err.value.cause == DropCause.FOREIGN_KEY
    want = dataclasses.replace(decode_header(raw[:HEADER_BYTES], SECRET), start=21)
    with pytest.raises(DiskEntryError) as err:
        verify_entry(raw, KEY, SECRET, want)
    assert err.value.cause == DropCause.HEADER


def test_prefix_digests_equal_one_shot_hashes() -> None:
    toks = np.arange(300, dtype=np.int32)
    got = prefix_digests(toks, [0, 7, 7, 150, 300])
    assert got == {p: tokens_digest(toks[:p]) for p in (0, 7, 150, 300)}


# ---- the index -----------------------------------------------------------------------------


def entry(path: list[int], start: int, ns: str = "", nbytes_rows: int = ROW) -> DiskEntry:
    p = np.asarray(path, np.int32)
    header = EntryHeader(
        key=KEY,
        ns=ns_digest(ns),
        start=start,
        n=len(path) - start,
        row_bytes=nbytes_rows,
        prefix=tokens_digest(p[:start]),
        tokens=tokens_digest(p[start:]),
        data=b"\0" * 32,
    )
    return DiskEntry(header, p[start:].copy())


A = list(range(10, 20))  # 10 tokens
B = A[:6] + list(range(50, 56))  # shares A's first 6, then its own 6
C = A + list(range(70, 75))  # goes on after A


@pytest.mark.parametrize(
    ("case", "filed", "query", "start", "reach", "pieces"),
    [
        ("one entry from 0", [(A, 0)], A + [1, 2], 0, 10, [(0, 0, 10)]),
        ("part of an entry", [(A, 0)], A[:4] + [99], 0, 4, [(0, 0, 4)]),
        ("a chain of two", [(A, 0), (C, 10)], C + [5], 0, 15, [(0, 0, 10), (1, 10, 15)]),
        ("RAM holds the first entry", [(C, 10)], C, 10, 15, [(0, 10, 15)]),
        ("RAM ends inside an entry", [(A, 0)], A, 4, 10, [(0, 4, 10)]),
        ("a branch below a partial match", [(A, 0), (B, 6)], B, 0, 12, [(0, 0, 6), (1, 6, 12)]),
        ("the other branch", [(A, 0), (B, 6)], A, 0, 10, [(0, 0, 10)]),
        ("prefix hash differs", [(C, 10)], [0] * 10 + C[10:], 10, 10, []),
        ("nothing past RAM's match", [(A, 0)], A, 10, 10, []),
        ("entries start past the match", [(C, 10)], C, 5, 5, []),
        ("empty index", [], A, 0, 0, []),
    ],
)
def test_walk(
    case: str,
    filed: list[tuple[list[int], int]],
    query: list[int],
    start: int,
    reach: int,
    pieces: list[tuple[int, int, int]],
) -> None:
    index = DiskIndex(1 << 30)
    made = [entry(p, s) for p, s in filed]
    for e in made:
        assert index.add(e)
    index.check_invariants()
    found = index.walk(np.asarray(query, np.int32), "", start)
    assert found.reach == reach, case
    assert [(made.index(p.entry), p.a, p.b) for p in found.pieces] == pieces, case
    assert found.gain == reach - start


def test_walk_stays_in_its_namespace() -> None:
    index = DiskIndex(1 << 30)
    index.add(entry(A, 0, ns="tenant-1"))
    q = np.asarray(A, np.int32)
    assert index.walk(q, "tenant-1", 0).reach == 10
    assert index.walk(q, "", 0).reach == 0 and index.walk(q, "tenant-2", 0).reach == 0


def test_lru_eviction_skips_pinned_and_follows_use() -> None:
    es = [entry(list(range(i * 100, i * 100 + 10)), 0) for i in range(4)]
    size = es[0].nbytes
    index = DiskIndex(4 * size)
    for e in es:
        index.add(e)
    assert not index.add(entry(list(range(0, 10)), 0))  # known: a touch, not a second entry
    index.touch([es[1]])  # order of use now: 2, 3, 0, 1
    index.pin([es[2]])
    gone = index.evict_for(2 * size)
    assert gone == [es[3], es[0]]  # 2 is pinned
    index.check_invariants()
    index.unpin([es[2]])
    assert index.evict_for(3 * size) == [es[2]]
    assert [e.alive for e in es] == [False, True, False, False]
    index.check_invariants()
    assert index.stats().entries == 1 and index.stats().bytes == size
    with pytest.raises(ValueError):
        index.unpin([es[1]])


def test_set_budget_and_remove_keep_the_tables_consistent() -> None:
    index = DiskIndex(1 << 30)
    made = [entry(A, 0), entry(B, 6), entry(C, 10)]
    for e in made:
        index.add(e)
    index.remove(made[1])
    index.remove(made[1])  # twice: a no-op
    index.check_invariants()
    assert index.walk(np.asarray(B, np.int32), "", 0).reach == 6
    assert index.set_budget(made[2].nbytes) == [made[0]]
    index.check_invariants()


# ---- the host tree's side: what it evicts reaches the tier ----------------------------------

LAYOUT = KvLayout(1, (1,), (4,), (1,), False, (4,), (0,), (0,))


def seg(p0: int, n: int, fill: int) -> KvSegment:
    return KvSegment.from_rows(p0, LAYOUT, np.full((n, 8), fill, dtype=np.uint8))


def test_the_tree_hands_each_evicted_leaf_to_on_evict_with_its_whole_path() -> None:
    tree = RadixTree(budget_bytes=3000, layout=LAYOUT)  # a and b (2376 bytes) fit, a third does not
    spilled: list[Spill] = []
    tree.on_evict = spilled.append
    a = np.arange(1, 41, dtype=np.int32)
    b = np.concatenate([a[:10], np.arange(500, 530, dtype=np.int32)])
    c = np.arange(900, 940, dtype=np.int32)
    tree.insert(a, seg(0, 40, 1))
    tree.insert(b, seg(10, 30, 2))  # splits a at 10
    assert spilled == []
    tree.insert(c, seg(0, 40, 3))  # evicts the least recently used leaf: a's own part [10, 40)
    tree.check_invariants()
    assert len(spilled) == 1
    s = spilled[0]
    assert s.ns == "" and s.start == 10 and np.array_equal(s.path, a)
    assert s.segment.n == 30 and int(s.segment.rows()[0, 0]) == 1
    order = [(x.start, x.segment.p1, int(x.segment.rows()[0, 0])) for x in tree.spill_all()]
    assert order == [(10, 40, 2), (0, 10, 1), (0, 40, 3)]  # oldest first, a child before its parent
    tree.check_invariants()
