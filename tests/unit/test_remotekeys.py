"""The remote tier's pure parts (proxy/core/remotekeys.py): chunk spans, keys bound to the
model, namespace, secret and whole token path, every check on a value read back, and the
read pricing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.diskindex import HEADER_BYTES, DiskEntryError, DropCause, tokens_digest
from proxy.core.remotekeys import StoreRate, chunk_refs, chunk_spans, encode_chunk, verify_chunk

pytestmark = pytest.mark.unit

COMPAT = b"c" * 32
SECRET = b"s" * 32
ROW = 8
CHUNK = 4


def toks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int32)


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, ROW), dtype=np.uint8)


@pytest.mark.parametrize(
    ("start", "end", "chunk", "want"),
    [
        (0, 0, 4, []),
        (0, 3, 4, []),
        (0, 4, 4, [(0, 4)]),
        (0, 9, 4, [(0, 4), (4, 8)]),
        (5, 9, 4, [(4, 8)]),  # from the chunk that holds the start
        (8, 9, 4, []),
        (7, 16, 4, [(4, 8), (8, 12), (12, 16)]),
    ],
)
def test_chunk_spans_are_whole_aligned_chunks(
    start: int, end: int, chunk: int, want: list[tuple[int, int]]
) -> None:
    assert chunk_spans(start, end, chunk) == want


def test_chunk_spans_refuse_a_zero_chunk() -> None:
    with pytest.raises(ValueError):
        chunk_spans(0, 8, 0)


@given(st.integers(0, 200), st.integers(0, 200), st.integers(1, 64))
def test_chunk_spans_cover_the_range_from_the_starting_chunk(start: int, end: int, chunk: int) -> None:
    spans = chunk_spans(start, end, chunk)
    for a, b in spans:
        assert a % chunk == 0 and b - a == chunk and b <= end
    assert [a for a, _ in spans[1:]] == [b for _, b in spans[:-1]]
    if spans:
        assert spans[0][0] == (start // chunk) * chunk
        assert end - spans[-1][1] < chunk


def test_a_key_is_bound_to_model_namespace_secret_and_the_whole_path() -> None:
    t = toks(16)
    spans = chunk_spans(0, 16, CHUNK)
    base = [r.key for r in chunk_refs(t, "", COMPAT, SECRET, spans, "radix")]
    assert len(set(base)) == len(base) and all(k.startswith("radix:") for k in base)
    other_tail = t.copy()
    other_tail[-1] += 1  # only the last chunk's path changes
    keys = [r.key for r in chunk_refs(other_tail, "", COMPAT, SECRET, spans, "radix")]
    assert keys[:-1] == base[:-1] and keys[-1] != base[-1]
    other_head = t.copy()
    other_head[0] += 1  # every chunk's path changes
    keys = [r.key for r in chunk_refs(other_head, "", COMPAT, SECRET, spans, "radix")]
    assert not set(keys) & set(base)
    for variant in (
        chunk_refs(t, "tenant", COMPAT, SECRET, spans, "radix"),
        chunk_refs(t, "", b"d" * 32, SECRET, spans, "radix"),
        chunk_refs(t, "", COMPAT, b"t" * 32, spans, "radix"),
    ):
        assert not {r.key for r in variant} & set(base)


def test_a_chunk_written_is_read_back_exactly() -> None:
    t = toks(12)
    data = rows(12)
    refs = chunk_refs(t, "ns", COMPAT, SECRET, chunk_spans(0, 12, CHUNK), "radix")
    for ref in refs:
        value = encode_chunk(COMPAT, SECRET, "ns", t[: ref.b], data[ref.a : ref.b])
        assert len(value) == HEADER_BYTES + CHUNK * (4 + ROW)
        got = verify_chunk(value, ref, COMPAT, SECRET, "ns", ROW)
        assert np.array_equal(got, data[ref.a : ref.b])
        assert ref.tokens == tokens_digest(t[ref.a : ref.b])


def _flip(value: bytes, at: int) -> bytes:
    out = bytearray(value)
    out[at] ^= 1
    return bytes(out)


def _refused(
    t: np.ndarray, value: bytes, *, ns: str = "ns", row: int = ROW, secret: bytes = SECRET
) -> DropCause:
    ref = chunk_refs(t, "ns", COMPAT, SECRET, [(4, 8)], "radix")[0]
    with pytest.raises(DiskEntryError) as info:
        verify_chunk(value, ref, COMPAT, secret, ns, row)
    return info.value.cause


def test_every_forged_swapped_or_foreign_value_is_refused() -> None:
    t, data = toks(12), rows(12)
    good = encode_chunk(COMPAT, SECRET, "ns", t[:8], data[4:8])
    other = t.copy()
    other[1] += 1
    cases = {
        "a byte of the header": (_flip(good, 20), DropCause.HEADER),
        "a byte of the rows": (_flip(good, len(good) - 1), DropCause.CHECKSUM),
        "a token id": (_flip(good, HEADER_BYTES), DropCause.TOKENS),
        "cut short": (good[:-1], DropCause.TRUNCATED),
        "signed with another secret": (
            encode_chunk(COMPAT, b"x" * 32, "ns", t[:8], data[4:8]),
            DropCause.HEADER,
        ),
        "another model": (encode_chunk(b"d" * 32, SECRET, "ns", t[:8], data[4:8]), DropCause.FOREIGN_KEY),
        "another namespace": (encode_chunk(COMPAT, SECRET, "other", t[:8], data[4:8]), DropCause.HEADER),
        "another place": (encode_chunk(COMPAT, SECRET, "ns", t[:12], data[8:12]), DropCause.HEADER),
        "another path before it": (
            encode_chunk(COMPAT, SECRET, "ns", other[:8], data[4:8]),
            DropCause.HEADER,
        ),
        "garbage": (b"\0" * 40, DropCause.TRUNCATED),
    }
    for what, (value, cause) in cases.items():
        assert _refused(t, value) == cause, what
    assert _refused(t, good, row=ROW * 2) == DropCause.HEADER  # rows of another size


def test_another_chunk_swapped_under_a_key_is_refused() -> None:
    t, data = toks(12), rows(12)
    refs = chunk_refs(t, "", COMPAT, SECRET, chunk_spans(0, 12, CHUNK), "radix")
    values = [encode_chunk(COMPAT, SECRET, "", t[: r.b], data[r.a : r.b]) for r in refs]
    with pytest.raises(DiskEntryError):
        verify_chunk(values[1], refs[2], COMPAT, SECRET, "", ROW)


def test_a_read_is_taken_only_when_cheaper_than_computing_and_within_the_deadline() -> None:
    rate = StoreRate(bytes_per_s=100e6, round_trip_s=0.001)
    assert rate.worth(10_000_000, 1000, 1 / 200, 2.0)  # 0.1 s against 5 s
    assert not rate.worth(10_000_000, 10, 1 / 200, 2.0)  # 0.1 s against 0.05 s
    assert not rate.worth(1_000_000_000, 100_000, 1 / 200, 2.0)  # 10 s: past the deadline
    rate.observe(100, 1.0)  # a small read says little: ignored
    assert rate.seen == 0
    rate.observe(50_000_000, 5.0)  # 10 MB/s measured: the mean moves towards it
    assert rate.seen == 1 and 10e6 < rate.bytes_per_s < 100e6
