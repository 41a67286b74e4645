"""KV payload format, version 1 (see docs/kvctl.md, "Blob format").

A blob is llama.cpp's single-sequence state: a header, per-cell metadata in POOL order,
then per layer all K rows, then per layer all V rows (or, with `v_trans`, V element-major).
The proxy keeps KV as `KvSegment`s (proxy/core/segment.py) in that same per-layer layout,
tokens in POSITION order: a blob whose cells are in position order (the server sorts them)
parses with one block copy per layer part, and a blob is written the same way.

Pure: numpy, struct and hashlib only.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from proxy.core.segment import (
    MAX_SECTIONS,
    KvLayout,
    KvSegment,
    check_run,
    el_dtype,
    part_bytes,
    part_shape,
)
from proxy.errors import PayloadError

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "KvLayout",
    "KvSegment",
    "blob_size",
    "build_blob",
    "parse_blob",
    "tokens_sha256",
    "write_blob",
    "write_rows_blob",
]

if TYPE_CHECKING:
    import mmap

FORMAT_VERSION = 1
MAGIC = 0xAF143CD8

# u32 magic, i32 seq_id; then one section per KV cache of the model's memory (KvLayout.sections),
# each u32 n_stream, u32 cell_count (one stream: unified KV), the cells, the data header and data.
_HEAD = struct.Struct("<Ii")
_SECTION_HEAD = struct.Struct("<II")
# Per cell: i32 pos, u32 n_seq_id (always 1 for a one-sequence export), the model's extra cell
# metadata (`llama_kv_cell_ext`, `KvLayout.cell_ext_bytes`: M-RoPE positions and token id), i32 seq_id.


def _cell_dtype(ext: int) -> np.dtype:
    fields: list[tuple[str, Any]] = [("pos", "<i4"), ("n_seq", "<u4")]
    if ext:
        fields.append(("ext", f"V{ext}"))
    return np.dtype([*fields, ("seq", "<i4")])


def _cell_ext_view(cells: np.ndarray, ext: int) -> np.ndarray:
    """The cells' extra metadata as an (n, ext) uint8 view of the cell table (rows strided)."""
    raw = cells.view(np.uint8).reshape(len(cells), cells.dtype.itemsize)
    return raw[:, 8 : 8 + ext]


_DATA_HEAD = struct.Struct("<II")  # u32 v_trans, u32 n_layer
_ROW_HEAD = struct.Struct("<iQ")  # i32 type, u64 row bytes (K, and V when not transposed)
_TRANS_HEAD = struct.Struct("<iII")  # i32 v_type, u32 v_el_bytes, u32 n_embd_v_gqa

# Generous sanity bounds: a header outside them is garbage, not a real model.
_MAX_LAYERS = 4096
_MAX_TYPE = 256

Buffer: TypeAlias = "bytes | bytearray | memoryview | np.ndarray | mmap.mmap"


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


def parse_blob(
    buf: Buffer, expect: KvLayout | None = None, cell_ext_bytes: int | None = None, view: bool = False
) -> KvSegment:
    """Validate a payload and return its KV as one segment in position order.

    The cells must cover exactly [p0, p0+n) once each (any pool order). With `expect`,
    the blob's layout must equal it. The size of the cells' extra metadata cannot be read from
    the blob itself: it is `expect`'s, else `cell_ext_bytes` (default 0). Any violation raises
    PayloadError. The result owns its memory: `buf` (e.g. an mmap) may be closed right after;
    with `view`, when the cells are already in position order (the server sorts them), the
    segment's parts are views of `buf` instead (no copy: an arena block stays the KV's home).
    """
    if cell_ext_bytes is None:
        cell_ext_bytes = expect.cell_ext_bytes if expect is not None else 0
    try:
        return _parse(buf, expect, cell_ext_bytes, view)
    except PayloadError as e:
        err = PayloadError(e.message)
    # Raised outside the except block so no traceback frame keeps a numpy view of `buf`:
    # such a view makes mmap.close() in the caller's `with` fail with BufferError.
    raise err


def _parse(buf: Buffer, expect: KvLayout | None, ext: int, view: bool) -> KvSegment:
    raw = np.frombuffer(buf, dtype=np.uint8)
    rd = _Reader(raw)
    magic, _seq_id = rd.unpack(_HEAD, "header")
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic:#x}, expected {MAGIC:#x}")
    sections: list[_Section] = []
    while not sections or rd.off < len(raw):  # one section per KV cache, each with every cell
        if sections and len(raw) - rd.off < _SECTION_HEAD.size:
            break  # too short to start another section: trailing bytes
        if len(sections) == MAX_SECTIONS:
            raise PayloadError(f"more than {MAX_SECTIONS} sections")
        sections.append(_parse_section(rd, ext, sections[0] if sections else None))
    if rd.off != len(raw):
        raise PayloadError(f"{len(raw) - rd.off} trailing bytes after the last layer")
    first = sections[0]
    k_parts = [part for sec in sections for part in sec.k_parts]
    v_parts = [part for sec in sections for part in sec.v_parts]
    layout = _layout_of(
        len(k_parts), first.v_trans, k_parts, v_parts, ext, tuple(len(sec.k_parts) for sec in sections)
    )
    if expect is not None and layout != expect:
        raise PayloadError(f"payload layout differs from the expected one: {_diff(layout, expect)}")
    blocks = [(part, sec.order) for sec in sections for part in sec.k_parts]
    blocks += [(part, sec.order) for sec in sections for part in sec.v_parts]
    if ext:
        _check_same_ext(sections, ext)
        blocks.append(((0, ext, 0, 0, _cell_ext_view(first.cells, ext)), first.order))
    if view and all(sec.order is None for sec in sections):
        parts = tuple(
            blk.reshape(part_shape(layout, i, first.n)) for i, ((_, _, _, _, blk), _) in enumerate(blocks)
        )
        return KvSegment(first.p0, layout, parts)
    return _gather(layout, first.p0, first.n, blocks)


@dataclass
class _Section:
    """One KV cache's part of a payload: its cells (pool order) and its layers' blocks."""

    n: int
    p0: int
    order: np.ndarray | None  # permutation into position order, None when already sorted
    cells: np.ndarray
    v_trans: bool
    k_parts: list[_Part]
    v_parts: list[_Part]


def _parse_section(rd: _Reader, ext: int, first: _Section | None) -> _Section:
    n_stream, n = rd.unpack(_SECTION_HEAD, "header")
    if n_stream != 1:
        raise PayloadError(f"n_stream {n_stream}, expected 1 (unified KV)")
    if n == 0:
        raise PayloadError("payload holds no cells")
    if first is not None and n != first.n:
        raise PayloadError(f"a section holds {n} cells, the first {first.n}")
    # Sanity before allocating anything from n: the cell table and data header must fit.
    cell = _cell_dtype(ext)
    rd.need(n * cell.itemsize + _DATA_HEAD.size, f"{n} cells")
    cells = rd.take(n * cell.itemsize, "cells").view(cell)
    order, p0 = _parse_cells(cells)
    if first is not None and p0 != first.p0:
        raise PayloadError(
            f"a section holds positions [{p0},{p0 + n}), the first [{first.p0},{first.p0 + first.n})"
        )
    v_trans, n_layer = rd.unpack(_DATA_HEAD, "data header")
    if v_trans not in (0, 1):
        raise PayloadError(f"v_trans {v_trans}, expected 0 or 1")
    if first is not None and bool(v_trans) != first.v_trans:
        raise PayloadError("sections differ in v_trans")
    if not 1 <= n_layer <= _MAX_LAYERS:
        raise PayloadError(f"n_layer {n_layer} out of range")
    k_parts = [_read_rows(rd, n, f"K layer {il}") for il in range(n_layer)]
    if first is None and rd.off == len(rd.raw):  # K only: an MLA cache has no V tensors (V is a view of K)
        v_parts: list[_Part] = []
    elif v_trans:
        v_parts = [_read_trans(rd, n, f"V layer {il}") for il in range(n_layer)]
    else:
        v_parts = [_read_rows(rd, n, f"V layer {il}") for il in range(n_layer)]
    return _Section(n, p0, order, cells, bool(v_trans), k_parts, v_parts)


def _check_same_ext(sections: list[_Section], ext: int) -> None:
    """Every section's cells carry the same extra metadata per position (they are one sequence)."""
    first = _cell_ext_view(sections[0].cells, ext)
    first = first if sections[0].order is None else first[sections[0].order]
    for sec in sections[1:]:
        other = _cell_ext_view(sec.cells, ext)
        if not np.array_equal(first, other if sec.order is None else other[sec.order]):
            raise PayloadError("the sections' cells carry different metadata")


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


def _layout_of(
    n_layer: int, v_trans: bool, k: list[_Part], v: list[_Part], ext: int, sections: tuple[int, ...]
) -> KvLayout:
    return KvLayout(
        n_layer=n_layer,
        k_types=tuple(p[0] for p in k),
        k_row_bytes=tuple(p[1] for p in k),
        v_types=tuple(p[0] for p in v),
        v_trans=v_trans,
        v_row_bytes=tuple(p[1] for p in v),
        v_el_bytes=tuple(p[2] for p in v),
        n_embd_v_gqa=tuple(p[3] for p in v),
        cell_ext_bytes=ext,
        sections=sections,
    )


def _diff(got: KvLayout, want: KvLayout) -> str:
    names = [f for f in got.__dataclass_fields__ if getattr(got, f) != getattr(want, f)]
    return ", ".join(names)


def _rows(arr: np.ndarray, row: int) -> np.ndarray:
    """An (n, row) uint8 array whose rows are contiguous as (n, 1) items of `row` bytes:
    numpy then copies one memmove per row instead of looping over bytes (about twice as fast)."""
    return arr.view(np.dtype((np.void, row)))


def _gather(layout: KvLayout, p0: int, n: int, blocks: list[tuple[_Part, np.ndarray | None]]) -> KvSegment:
    """The segment in position order from the blob's per-layer, pool-order blocks, each with
    its section's cell order: one block copy per part when the cells are in position order."""
    seg = KvSegment.empty(p0, layout, n)
    for dst, ((_, row, el, embd, blk), order) in zip(seg.parts, blocks, strict=True):
        if order is None:
            dst[...] = blk.reshape(dst.shape)  # the cell metadata's view is already (n, ext)
        elif el == 0:
            _rows(dst, row)[...] = _rows(blk.reshape(n, row), row)[order]
        else:  # element-major (embd, n): reorder the columns, one item per element
            dt = el_dtype(el)
            dst.view(dt)[...] = blk.view(dt).reshape(embd, n)[:, order]
    return seg


# ---------------------------------------------------------------- build


def blob_size(layout: KvLayout, n: int) -> int:
    """Exact byte size of a blob holding n cells of this layout."""
    n_sec = len(layout.section_layers)
    per_layer_heads = layout.n_layer * _ROW_HEAD.size + layout.n_v * (
        _TRANS_HEAD.size if layout.v_trans else _ROW_HEAD.size
    )
    # The cells' extra metadata is in bytes_per_token (the segment holds it once) and in the
    # cell table of every section.
    return (
        _HEAD.size
        + n_sec * (_SECTION_HEAD.size + n * _cell_dtype(0).itemsize + _DATA_HEAD.size)
        + per_layer_heads
        + n * layout.bytes_per_token
        + (n_sec - 1) * n * layout.cell_ext_bytes
    )


def write_blob(segments: Sequence[KvSegment], out: Buffer, seq_id: int = 0) -> int:
    """Write the blob for a contiguous run of segments into `out` (writable buffer, e.g. an
    mmap of a payload file, at least `blob_size` bytes). Returns the bytes written."""
    try:
        return _write(segments, out, seq_id)
    except PayloadError as e:
        err = PayloadError(e.message)
    raise err  # outside the except block: see parse_blob


def _write(segments: Sequence[KvSegment], out: Buffer, seq_id: int) -> int:
    check_run(segments)
    layout = segments[0].layout
    p0, n = segments[0].p0, segments[-1].p1 - segments[0].p0
    whole, size, tables = _frame(layout, p0, n, out, seq_id)
    for seg in segments:
        whole.slice(seg.p0, seg.p1).assign(seg)
    _copy_cell_ext(tables, layout.cell_ext_bytes)
    return size


def write_rows_blob(p0: int, layout: KvLayout, rows: np.ndarray, out: Buffer, seq_id: int = 0) -> int:
    """Write the blob of positions [p0, p0 + len(rows)) from per-token rows
    (``KvSegment.from_rows``' format) into ``out``, with no segment in between: one copy.
    Returns the bytes written."""
    try:
        whole, size, tables = _frame(layout, p0, len(rows), out, seq_id)
        whole.fill_rows(rows)
        _copy_cell_ext(tables, layout.cell_ext_bytes)
        return size
    except PayloadError as e:
        err = PayloadError(e.message)
    raise err  # outside the except block: see parse_blob


def _frame(
    layout: KvLayout, p0: int, n: int, out: Buffer, seq_id: int
) -> tuple[KvSegment, int, list[np.ndarray]]:
    """Write a blob's headers and cell tables for positions [p0, p0 + n) into ``out``; return
    the segment viewing its (unwritten) KV data, the blob's size and the cell tables."""
    if n == 0:
        raise PayloadError("no cells to write")
    size = blob_size(layout, n)
    buf = np.frombuffer(out, dtype=np.uint8)
    if len(buf) < size:
        raise PayloadError(f"output buffer has {len(buf)} bytes, blob needs {size}")
    if not buf.flags.writeable:
        raise PayloadError("output buffer is read-only")
    off = _put(buf, 0, _HEAD.pack(MAGIC, seq_id))
    cell = _cell_dtype(layout.cell_ext_bytes)
    tables: list[np.ndarray] = []
    blocks = [0] * (layout.n_layer + layout.n_v)  # each part's offset, in part order
    il0 = 0
    for n_layer in layout.section_layers:  # one section per KV cache, each with every cell
        off = _put(buf, off, _SECTION_HEAD.pack(1, n))
        cells = buf[off : off + n * cell.itemsize].view(cell)
        cells["pos"] = np.arange(p0, p0 + n)
        cells["n_seq"] = 1
        cells["seq"] = seq_id
        tables.append(cells)
        off = _put(buf, off + n * cell.itemsize, _DATA_HEAD.pack(int(layout.v_trans), n_layer))
        # The section's data is the segment's parts of its layers end to end, each behind its header.
        for il in range(il0, il0 + n_layer):
            off = _put(buf, off, _ROW_HEAD.pack(layout.k_types[il], layout.k_row_bytes[il]))
            blocks[il] = off
            off += n * part_bytes(layout, il)
        for il in range(il0, min(il0 + n_layer, layout.n_v)):
            if layout.v_trans:
                head = _TRANS_HEAD.pack(layout.v_types[il], layout.v_el_bytes[il], layout.n_embd_v_gqa[il])
            else:
                head = _ROW_HEAD.pack(layout.v_types[il], layout.v_row_bytes[il])
            off = _put(buf, off, head)
            blocks[layout.n_layer + il] = off
            off += n * part_bytes(layout, layout.n_layer + il)
        il0 += n_layer
    assert off == size, (off, size)
    parts = _carve_at(buf, layout, n, blocks)
    ext = layout.cell_ext_bytes
    if ext:
        parts += (_cell_ext_view(tables[0], ext),)
    return KvSegment(p0, layout, parts), size, tables


def _copy_cell_ext(tables: list[np.ndarray], ext: int) -> None:
    for cells in tables[1:] if ext else []:  # every section's cells carry the metadata
        _cell_ext_view(cells, ext)[...] = _cell_ext_view(tables[0], ext)


def _carve_at(buf: np.ndarray, layout: KvLayout, n: int, offsets: list[int]) -> tuple[np.ndarray, ...]:
    """The parts of a segment of n positions as views of `buf`'s blocks at `offsets`."""
    return tuple(
        buf[off : off + n * part_bytes(layout, i)].reshape(part_shape(layout, i, n))
        for i, off in enumerate(offsets)  # the K and V blocks (not the cell metadata)
    )


def build_blob(segments: Sequence[KvSegment], seq_id: int = 0) -> bytes:
    """The blob for a contiguous run of segments, cells in position order."""
    check_run(segments)
    n = segments[-1].p1 - segments[0].p0
    out = np.empty(blob_size(segments[0].layout, n), dtype=np.uint8)
    write_blob(segments, out, seq_id)
    return out.tobytes()


def _put(buf: np.ndarray, off: int, raw: bytes) -> int:
    buf[off : off + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return off + len(raw)


def tokens_sha256(tokens: Sequence[int] | np.ndarray) -> str:
    """The ``expect_sha256`` of a KV move: sha256 of the token ids as little-endian int32,
    64 lowercase hex digits (docs/kvctl.md)."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()
