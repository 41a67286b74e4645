"""KV payload format, version 1 (see docs/kvctl.md, "Blob format").

A blob is llama.cpp's single-sequence state: a header, per-cell metadata in POOL order,
then per layer all K rows, then per layer all V rows (or, with `v_trans`, V element-major).
The proxy keeps KV as `KvSegment`s: one uint8 row per token in POSITION order, each row =
all layers' K rows of that token followed by all layers' V rows (for `v_trans`, the
token's V elements of that layer, gathered). Position order plus per-token rows is what
lets the radix tree split and slice segments as plain numpy views.

Pure: numpy, struct and hashlib only.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from proxy.errors import PayloadError

if TYPE_CHECKING:
    import mmap

FORMAT_VERSION = 1
MAGIC = 0xAF143CD8

# u32 magic, i32 seq_id, u32 n_stream, u32 cell_count (one stream: unified KV).
_HEAD = struct.Struct("<IiII")
# Per cell: i32 pos, u32 n_seq_id (always 1 for a one-sequence export), i32 seq_id.
_CELL = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
_DATA_HEAD = struct.Struct("<II")  # u32 v_trans, u32 n_layer
_ROW_HEAD = struct.Struct("<iQ")  # i32 type, u64 row bytes (K, and V when not transposed)
_TRANS_HEAD = struct.Struct("<iII")  # i32 v_type, u32 v_el_bytes, u32 n_embd_v_gqa

# Generous sanity bounds: a header outside them is garbage, not a real model.
_MAX_LAYERS = 4096
_MAX_TYPE = 256
# Element size of ggml types that llama.cpp allows for transposed V (non-quantized only).
_V_TRANS_EL_BYTES = {0: 4, 1: 2, 30: 2}  # F32, F16, BF16

Buffer: TypeAlias = "bytes | bytearray | memoryview | np.ndarray | mmap.mmap"


@dataclass(frozen=True)
class KvLayout:
    """Per-layer K/V types and row sizes: what a payload must match to be importable.

    `v_row_bytes[l]` is the per-token V size of layer l; with `v_trans` it equals
    `n_embd_v_gqa[l] * v_el_bytes[l]`. `v_el_bytes` / `n_embd_v_gqa` are 0 when not `v_trans`.
    """

    n_layer: int
    k_types: tuple[int, ...]
    k_row_bytes: tuple[int, ...]
    v_types: tuple[int, ...]
    v_trans: bool
    v_row_bytes: tuple[int, ...]
    v_el_bytes: tuple[int, ...]
    n_embd_v_gqa: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.n_layer <= _MAX_LAYERS:
            raise PayloadError(f"layout: n_layer {self.n_layer} out of range")
        for name in ("k_types", "k_row_bytes", "v_types", "v_row_bytes", "v_el_bytes", "n_embd_v_gqa"):
            if len(getattr(self, name)) != self.n_layer:
                raise PayloadError(
                    f"layout: {name} has {len(getattr(self, name))} entries, not {self.n_layer}"
                )
        if min(self.k_row_bytes) <= 0 or min(self.v_row_bytes) <= 0:
            raise PayloadError("layout: row sizes must be positive")
        for il in range(self.n_layer):
            el, emb = self.v_el_bytes[il], self.n_embd_v_gqa[il]
            if self.v_trans and (el <= 0 or emb <= 0 or el * emb != self.v_row_bytes[il]):
                raise PayloadError(f"layout: layer {il}: v_row_bytes != n_embd_v_gqa * v_el_bytes")
            if not self.v_trans and (el or emb):
                raise PayloadError(f"layout: layer {il}: v_el_bytes/n_embd_v_gqa set without v_trans")

    @property
    def bytes_per_token(self) -> int:
        return sum(self.k_row_bytes) + sum(self.v_row_bytes)

    def k_offset(self, il: int) -> int:
        """Byte offset of layer il's K row inside a token row."""
        return sum(self.k_row_bytes[:il])

    def v_offset(self, il: int) -> int:
        """Byte offset of layer il's V row inside a token row (after all K rows)."""
        return sum(self.k_row_bytes) + sum(self.v_row_bytes[:il])

    def compat_dict(self) -> dict[str, Any]:
        """The layout part of `/kvctl/caps` `compat` (no fingerprint / rope: not in the blob)."""
        return {
            "n_layer": self.n_layer,
            "k_types": list(self.k_types),
            "v_types": list(self.v_types),
            "k_row_bytes": list(self.k_row_bytes),
            "v_row_bytes": list(self.v_row_bytes),
            "v_trans": self.v_trans,
        }

    @classmethod
    def from_caps(cls, compat: dict[str, Any]) -> KvLayout:
        """Build from `/kvctl/caps` `compat`. With `v_trans`, element sizes come from the V
        types (only F32/F16/BF16 can be transposed) unless `v_el_bytes` is given."""
        try:
            n_layer = int(compat["n_layer"])
            v_trans = bool(compat["v_trans"])
            k_types = _ints(compat["k_types"])
            v_types = _ints(compat["v_types"])
            k_rows = _ints(compat["k_row_bytes"])
            v_rows = _ints(compat["v_row_bytes"])
        except (KeyError, TypeError, ValueError) as e:
            raise PayloadError(f"compat: missing or bad field: {e}") from e
        if not v_trans:
            zeros = (0,) * n_layer
            return cls(n_layer, k_types, k_rows, v_types, False, v_rows, zeros, zeros)
        if "v_el_bytes" in compat:
            els = _ints(compat["v_el_bytes"])
        else:
            unknown = [t for t in v_types if t not in _V_TRANS_EL_BYTES]
            if unknown:
                raise PayloadError(f"compat: v_trans with V types {unknown} that cannot be transposed")
            els = tuple(_V_TRANS_EL_BYTES[t] for t in v_types)
        if len(els) != len(v_rows) or any(r % e for r, e in zip(v_rows, els, strict=True) if e > 0):
            raise PayloadError("compat: v_row_bytes not a multiple of the V element size")
        embd = tuple(r // e if e > 0 else 0 for r, e in zip(v_rows, els, strict=True))
        return cls(n_layer, k_types, k_rows, v_types, True, v_rows, els, embd)


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@dataclass(frozen=True, eq=False)
class KvSegment:
    """KV of positions [p0, p0+n): `data` is uint8 (n, bytes_per_token), position order."""

    p0: int
    layout: KvLayout
    data: np.ndarray

    def __post_init__(self) -> None:
        d = self.data
        if d.dtype != np.uint8 or d.ndim != 2 or d.shape[1] != self.layout.bytes_per_token:
            raise PayloadError(
                f"segment data must be uint8 (n, {self.layout.bytes_per_token}), got {d.dtype} {d.shape}"
            )
        if self.p0 < 0:
            raise PayloadError(f"segment p0 {self.p0} < 0")
        if d.shape[0] and d.strides[1] != 1:
            # Row-wise copies and strided views below assume each token row is contiguous.
            object.__setattr__(self, "data", np.ascontiguousarray(d))

    @property
    def n(self) -> int:
        return int(self.data.shape[0])

    @property
    def p1(self) -> int:
        return self.p0 + self.n

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def slice(self, a: int, b: int) -> KvSegment:
        """Positions [a, b) (absolute) as a VIEW of this segment's data."""
        if not self.p0 <= a <= b <= self.p1:
            raise ValueError(f"slice [{a},{b}) outside segment [{self.p0},{self.p1})")
        return KvSegment(a, self.layout, self.data[a - self.p0 : b - self.p0])

    @staticmethod
    def concat(segments: Sequence[KvSegment]) -> KvSegment:
        """One segment (a copy) from adjacent segments of the same layout."""
        _check_run(segments)
        return KvSegment(segments[0].p0, segments[0].layout, np.concatenate([s.data for s in segments]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KvSegment):
            return NotImplemented
        return self.p0 == other.p0 and self.layout == other.layout and np.array_equal(self.data, other.data)

    __hash__ = None  # type: ignore[assignment]  # mutable array inside: not hashable

    def __repr__(self) -> str:
        return f"KvSegment([{self.p0},{self.p1}), {self.layout.bytes_per_token} B/token)"


def _check_run(segments: Sequence[KvSegment]) -> None:
    """A non-empty run of segments with one layout, each starting where the previous ends."""
    if not segments:
        raise PayloadError("no segments")
    first = segments[0]
    for prev, seg in zip(segments, segments[1:], strict=False):
        if seg.layout != first.layout:
            raise PayloadError("segments have different layouts")
        if seg.p0 != prev.p1:
            raise PayloadError(f"segments not adjacent: [{prev.p0},{prev.p1}) then [{seg.p0},{seg.p1})")


# ---------------------------------------------------------------- parse


class _Reader:
    """Bounds-checked cursor over the blob; every overrun is a PayloadError."""

    def __init__(self, raw: np.ndarray) -> None:
        self.raw = raw
        self.off = 0

    def unpack(self, st: struct.Struct, what: str) -> tuple[Any, ...]:
        self.need(st.size, what)
        vals = st.unpack_from(self.raw.data, self.off)
        self.off += st.size
        return vals

    def take(self, n_bytes: int, what: str) -> np.ndarray:
        self.need(n_bytes, what)
        out = self.raw[self.off : self.off + n_bytes]
        self.off += n_bytes
        return out

    def need(self, n_bytes: int, what: str) -> None:
        if self.off + n_bytes > len(self.raw):
            raise PayloadError(
                f"truncated payload: {what} needs {n_bytes} bytes at {self.off}, have {len(self.raw)}"
            )


def parse_blob(buf: Buffer, expect: KvLayout | None = None) -> KvSegment:
    """Validate a payload and return its KV as one segment in position order.

    The cells must cover exactly [p0, p0+n) once each (any pool order). With `expect`,
    the blob's layout must equal it. Any violation raises PayloadError. The result owns
    its memory: `buf` (e.g. an mmap) may be closed right after.
    """
    try:
        return _parse(buf, expect)
    except PayloadError as e:
        err = PayloadError(e.message)
    # Raised outside the except block so no traceback frame keeps a numpy view of `buf`:
    # such a view makes mmap.close() in the caller's `with` fail with BufferError.
    raise err


def _parse(buf: Buffer, expect: KvLayout | None) -> KvSegment:
    raw = np.frombuffer(buf, dtype=np.uint8)
    rd = _Reader(raw)
    magic, _seq_id, n_stream, n = rd.unpack(_HEAD, "header")
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic:#x}, expected {MAGIC:#x}")
    if n_stream != 1:
        raise PayloadError(f"n_stream {n_stream}, expected 1 (unified KV)")
    if n == 0:
        raise PayloadError("payload holds no cells")
    # Sanity before allocating anything from n: the cell table and data header must fit.
    rd.need(n * _CELL.itemsize + _DATA_HEAD.size, f"{n} cells")
    order, p0 = _parse_cells(rd.take(n * _CELL.itemsize, "cells").view(_CELL))
    v_trans, n_layer = rd.unpack(_DATA_HEAD, "data header")
    if v_trans not in (0, 1):
        raise PayloadError(f"v_trans {v_trans}, expected 0 or 1")
    if not 1 <= n_layer <= _MAX_LAYERS:
        raise PayloadError(f"n_layer {n_layer} out of range")
    k_parts = [_read_rows(rd, n, f"K layer {il}") for il in range(n_layer)]
    if v_trans:
        v_parts = [_read_trans(rd, n, f"V layer {il}") for il in range(n_layer)]
    else:
        v_parts = [_read_rows(rd, n, f"V layer {il}") for il in range(n_layer)]
    if rd.off != len(raw):
        raise PayloadError(f"{len(raw) - rd.off} trailing bytes after the last layer")
    layout = _layout_of(n_layer, bool(v_trans), k_parts, v_parts)
    if expect is not None and layout != expect:
        raise PayloadError(f"payload layout differs from the expected one: {_diff(layout, expect)}")
    return KvSegment(p0, layout, _gather(layout, n, order, k_parts, v_parts))


def _parse_cells(cells: np.ndarray) -> tuple[np.ndarray | None, int]:
    """Return (permutation into position order or None when already sorted, p0)."""
    bad = np.flatnonzero(cells["n_seq"] != 1)
    if bad.size:
        raise PayloadError(f"cell {bad[0]}: n_seq_id {cells['n_seq'][bad[0]]}, expected 1")
    seq = cells["seq"]
    if seq[0] < 0 or np.any(seq != seq[0]):
        raise PayloadError("cells carry different or negative sequence ids")
    pos = cells["pos"].astype(np.int64)
    order: np.ndarray | None = None
    if np.any(pos[1:] < pos[:-1]):
        order = np.argsort(pos, kind="stable")
        pos = pos[order]
    p0 = int(pos[0])
    if p0 < 0 or not np.array_equal(pos, np.arange(p0, p0 + len(pos))):
        raise PayloadError(f"cell positions are not exactly [{p0},{p0 + len(pos)})")
    return order, p0


# One layer's part: (type, row bytes, el bytes, n_embd, raw bytes).
_Part = tuple[int, int, int, int, np.ndarray]


def _read_rows(rd: _Reader, n: int, what: str) -> _Part:
    typ, row = rd.unpack(_ROW_HEAD, what)
    _check_type(typ, what)
    if row <= 0:
        raise PayloadError(f"{what}: row size {row}")
    rd.need(n * row, what)  # before multiplying into an allocation
    return typ, row, 0, 0, rd.take(n * row, what)


def _read_trans(rd: _Reader, n: int, what: str) -> _Part:
    typ, el, embd = rd.unpack(_TRANS_HEAD, what)
    _check_type(typ, what)
    if el <= 0 or embd <= 0:
        raise PayloadError(f"{what}: element size {el}, n_embd_v_gqa {embd}")
    rd.need(n * el * embd, what)
    return typ, el * embd, el, embd, rd.take(n * el * embd, what)


def _check_type(typ: int, what: str) -> None:
    if not 0 <= typ < _MAX_TYPE:
        raise PayloadError(f"{what}: ggml type {typ} out of range")


def _layout_of(n_layer: int, v_trans: bool, k: list[_Part], v: list[_Part]) -> KvLayout:
    return KvLayout(
        n_layer=n_layer,
        k_types=tuple(p[0] for p in k),
        k_row_bytes=tuple(p[1] for p in k),
        v_types=tuple(p[0] for p in v),
        v_trans=v_trans,
        v_row_bytes=tuple(p[1] for p in v),
        v_el_bytes=tuple(p[2] for p in v),
        n_embd_v_gqa=tuple(p[3] for p in v),
    )


def _diff(got: KvLayout, want: KvLayout) -> str:
    names = [f for f in got.__dataclass_fields__ if getattr(got, f) != getattr(want, f)]
    return ", ".join(names)


def _el_dtype(el: int) -> np.dtype:
    """One V element as a single numpy item: a transpose then moves items, not bytes
    (about ten times faster than a byte-wise (n, embd, el) transpose)."""
    return np.dtype(f"<u{el}") if el in (1, 2, 4, 8) else np.dtype((np.void, el))


def _rows(arr: np.ndarray, row: int) -> np.ndarray:
    """An (n, row) uint8 array whose rows are contiguous as (n, 1) items of `row` bytes:
    numpy then copies one memmove per row instead of looping over bytes (about twice as fast)."""
    return arr.view(np.dtype((np.void, row)))


def _gather(layout: KvLayout, n: int, order: np.ndarray | None, k: list[_Part], v: list[_Part]) -> np.ndarray:
    """Per-token rows in position order from the blob's per-layer, pool-order blocks."""
    out = np.empty((n, layout.bytes_per_token), dtype=np.uint8)
    for il, (_, row, _, _, blk) in enumerate(k):
        rows = _rows(blk.reshape(n, row), row)
        off = layout.k_offset(il)
        _rows(out[:, off : off + row], row)[...] = rows if order is None else rows[order]
    for il, (_, row, el, embd, blk) in enumerate(v):
        off = layout.v_offset(il)
        if not layout.v_trans:
            rows = _rows(blk.reshape(n, row), row)
            _rows(out[:, off : off + row], row)[...] = rows if order is None else rows[order]
            continue
        # Element-major (embd, n) -> token-major (n, embd), one item per element.
        dt = _el_dtype(el)
        src = blk.view(dt).reshape(embd, n)
        out[:, off : off + row].view(dt)[...] = (src if order is None else src[:, order]).T
    return out


# ---------------------------------------------------------------- build


def blob_size(layout: KvLayout, n: int) -> int:
    """Exact byte size of a blob holding n cells of this layout."""
    per_layer_heads = layout.n_layer * (
        _ROW_HEAD.size + (_TRANS_HEAD.size if layout.v_trans else _ROW_HEAD.size)
    )
    return _HEAD.size + n * _CELL.itemsize + _DATA_HEAD.size + per_layer_heads + n * layout.bytes_per_token


def write_blob(segments: Sequence[KvSegment], out: Buffer, seq_id: int = 0) -> int:
    """Write the blob for a contiguous run of segments into `out` (writable buffer, e.g. an
    mmap of a payload file, at least `blob_size` bytes). Returns the bytes written."""
    try:
        return _write(segments, out, seq_id)
    except PayloadError as e:
        err = PayloadError(e.message)
    raise err  # outside the except block: see parse_blob


def _write(segments: Sequence[KvSegment], out: Buffer, seq_id: int) -> int:
    _check_run(segments)
    layout = segments[0].layout
    p0, n = segments[0].p0, segments[-1].p1 - segments[0].p0
    if n == 0:
        raise PayloadError("no cells to write")
    size = blob_size(layout, n)
    buf = np.frombuffer(out, dtype=np.uint8)
    if len(buf) < size:
        raise PayloadError(f"output buffer has {len(buf)} bytes, blob needs {size}")
    if not buf.flags.writeable:
        raise PayloadError("output buffer is read-only")
    off = _put(buf, 0, _HEAD.pack(MAGIC, seq_id, 1, n))
    cells = buf[off : off + n * _CELL.itemsize].view(_CELL)
    cells["pos"] = np.arange(p0, p0 + n)
    cells["n_seq"] = 1
    cells["seq"] = seq_id
    off = _put(buf, off + n * _CELL.itemsize, _DATA_HEAD.pack(int(layout.v_trans), layout.n_layer))
    for il in range(layout.n_layer):
        off = _put(buf, off, _ROW_HEAD.pack(layout.k_types[il], layout.k_row_bytes[il]))
        off = _put_rows(buf, off, segments, layout.k_offset(il), layout.k_row_bytes[il])
    for il in range(layout.n_layer):
        row = layout.v_row_bytes[il]
        if not layout.v_trans:
            off = _put(buf, off, _ROW_HEAD.pack(layout.v_types[il], row))
            off = _put_rows(buf, off, segments, layout.v_offset(il), row)
            continue
        el, embd = layout.v_el_bytes[il], layout.n_embd_v_gqa[il]
        off = _put(buf, off, _TRANS_HEAD.pack(layout.v_types[il], el, embd))
        dt = _el_dtype(el)
        dst = buf[off : off + n * row].view(dt).reshape(embd, n)
        col = layout.v_offset(il)
        for seg in segments:
            i0 = seg.p0 - p0
            dst[:, i0 : i0 + seg.n] = seg.data[:, col : col + row].view(dt).T
        off += n * row
    assert off == size, (off, size)
    return size


def build_blob(segments: Sequence[KvSegment], seq_id: int = 0) -> bytes:
    """The blob for a contiguous run of segments, cells in position order."""
    _check_run(segments)
    n = segments[-1].p1 - segments[0].p0
    out = np.empty(blob_size(segments[0].layout, n), dtype=np.uint8)
    write_blob(segments, out, seq_id)
    return out.tobytes()


def _put(buf: np.ndarray, off: int, raw: bytes) -> int:
    buf[off : off + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return off + len(raw)


def _put_rows(buf: np.ndarray, off: int, segments: Sequence[KvSegment], col: int, row: int) -> int:
    """One layer's rows, all segments in order, as one (n, row) block."""
    p0 = segments[0].p0
    n = segments[-1].p1 - p0
    dst = _rows(buf[off : off + n * row].reshape(n, row), row)
    for seg in segments:
        dst[seg.p0 - p0 : seg.p1 - p0] = _rows(seg.data[:, col : col + row], row)
    return off + n * row


def tokens_sha256(tokens: Sequence[int] | np.ndarray) -> str:
    """The ``expect_sha256`` of a KV move: sha256 of the token ids as little-endian int32,
    64 lowercase hex digits (docs/kvctl.md)."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()
