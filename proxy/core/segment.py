"""KV as the proxy holds it: a layout (what a payload must match) and segments of positions.

A segment keeps its KV in the server's own layout, part by part: per layer all K rows of its
tokens, then per layer all V rows (with `v_trans`, V element-major, as llama.cpp stores it),
each part one block of one buffer, tokens in POSITION order. That is the payload's data section
(proxy/core/payload.py) without its headers, so moving KV in or out of a payload file is one
block copy per part (near memcpy speed) instead of one small copy per token and layer; and a
position range of a segment (what the radix tree splits and slices) is a view of each part.

Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from proxy.errors import PayloadError

# Generous sanity bounds: a header outside them is garbage, not a real model.
_MAX_LAYERS = 4096
# Every payload cell has an i32 position, a u32 sequence count and (one sequence) an i32 id.
CELL_BASE_BYTES = 12
_MAX_CELL_EXT = 256
# KV caches of one model's memory whose sections a payload may hold (a full-size SWA model has two).
MAX_SECTIONS = 4
# Element size of ggml types that llama.cpp allows for transposed V (non-quantized only).
_V_TRANS_EL_BYTES = {0: 4, 1: 2, 30: 2}  # F32, F16, BF16


@dataclass(frozen=True)
class KvLayout:
    """Per-layer K/V types and row sizes: what a payload must match to be importable.

    `v_row_bytes[l]` is the per-token V size of layer l; with `v_trans` it equals
    `n_embd_v_gqa[l] * v_el_bytes[l]`. `v_el_bytes` / `n_embd_v_gqa` are 0 when not `v_trans`.
    `cell_ext_bytes` is the per-cell metadata beyond position, sequence count and sequence id
    (llama.cpp's `llama_kv_cell_ext`: M-RoPE's extra position axes and the token id, 12 bytes
    where the model uses them, else 0); the server reports it as `cell_meta_bytes` (12 more).
    `sections` is the number of layers of each KV cache of the model's memory when it has
    more than one (a full-size SWA cache: the full-attention layers, then the window layers);
    the payload holds one section per cache, each with every cell, and the per-layer fields
    run over the layers of all sections in order. Empty for one cache.
    """

    n_layer: int
    k_types: tuple[int, ...]
    k_row_bytes: tuple[int, ...]
    v_types: tuple[int, ...]
    v_trans: bool
    v_row_bytes: tuple[int, ...]
    v_el_bytes: tuple[int, ...]
    n_embd_v_gqa: tuple[int, ...]
    cell_ext_bytes: int = 0
    sections: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.n_layer <= _MAX_LAYERS:
            raise PayloadError(f"layout: n_layer {self.n_layer} out of range")
        if len(self.sections) == 1:
            object.__setattr__(self, "sections", ())  # one cache: the plain layout, equal to it
        if self.sections:
            if (
                len(self.sections) > MAX_SECTIONS
                or min(self.sections) < 1
                or sum(self.sections) != self.n_layer
            ):
                raise PayloadError(f"layout: sections {self.sections} do not divide {self.n_layer} layers")
            if not self.v_types:
                raise PayloadError("layout: a K-only cache has one section")
        # V: one entry per layer, or none at all (K-only: MLA keeps V as a view of K).
        n_v = len(self.v_types)
        for name in ("k_types", "k_row_bytes"):
            if len(getattr(self, name)) != self.n_layer:
                raise PayloadError(
                    f"layout: {name} has {len(getattr(self, name))} entries, not {self.n_layer}"
                )
        if n_v not in (0, self.n_layer):
            raise PayloadError(f"layout: v_types has {n_v} entries, not {self.n_layer} (or 0: K only)")
        for name in ("v_row_bytes", "v_el_bytes", "n_embd_v_gqa"):
            if len(getattr(self, name)) != n_v:
                raise PayloadError(f"layout: {name} has {len(getattr(self, name))} entries, not {n_v}")
        if min(self.k_row_bytes) <= 0 or min(self.v_row_bytes, default=1) <= 0:
            raise PayloadError("layout: row sizes must be positive")
        if not 0 <= self.cell_ext_bytes <= _MAX_CELL_EXT:
            raise PayloadError(f"layout: cell metadata of {self.cell_ext_bytes} extra bytes out of range")
        for il in range(n_v):
            el, emb = self.v_el_bytes[il], self.n_embd_v_gqa[il]
            if self.v_trans and (el <= 0 or emb <= 0 or el * emb != self.v_row_bytes[il]):
                raise PayloadError(f"layout: layer {il}: v_row_bytes != n_embd_v_gqa * v_el_bytes")
            if not self.v_trans and (el or emb):
                raise PayloadError(f"layout: layer {il}: v_el_bytes/n_embd_v_gqa set without v_trans")

    @property
    def bytes_per_token(self) -> int:
        """What a segment stores per token: K and V rows, and the cell's extra metadata."""
        return sum(self.k_row_bytes) + sum(self.v_row_bytes) + self.cell_ext_bytes

    @property
    def n_parts(self) -> int:
        """K of each layer, V of each layer, then the cells' extra metadata when there is any."""
        return self.n_layer + self.n_v + (1 if self.cell_ext_bytes else 0)

    @property
    def section_layers(self) -> tuple[int, ...]:
        """The layers of each section of a payload: one section unless `sections` says more."""
        return self.sections or (self.n_layer,)

    @property
    def n_v(self) -> int:
        """Layers with V rows: all of them, or 0 for a K-only (MLA) cache."""
        return len(self.v_types)

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
            "cell_meta_bytes": CELL_BASE_BYTES + self.cell_ext_bytes,
            "sections": list(self.section_layers),
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
            ext = int(compat.get("cell_meta_bytes", CELL_BASE_BYTES)) - CELL_BASE_BYTES
            secs = _ints(compat.get("sections", [n_layer]))
        except (KeyError, TypeError, ValueError) as e:
            raise PayloadError(f"compat: missing or bad field: {e}") from e
        if ext < 0:
            raise PayloadError(f"compat: cell_meta_bytes below the {CELL_BASE_BYTES} every cell has")
        if not v_trans:
            zeros = (0,) * len(v_types)  # no V rows at all when K-only
            return cls(n_layer, k_types, k_rows, v_types, False, v_rows, zeros, zeros, ext, secs)
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
        return cls(n_layer, k_types, k_rows, v_types, True, v_rows, els, embd, ext, secs)


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@dataclass(frozen=True, eq=False)
class KvSegment:
    """KV of positions [p0, p0+n) in the server's layout: `parts` holds `layout.n_parts` uint8
    blocks, K of layers 0..n_layer-1, then V of each layer, then (when the layout has any) the
    cells' extra metadata, (n, cell_ext_bytes), as the payload's cell table holds it. A K part, and a V part without
    `v_trans`, is (n, row bytes): one row per token. A V part with `v_trans` is element-major,
    (n_embd_v_gqa, n * el bytes): per V element the run of the tokens' values.

    The parts of a segment are views of one buffer (its `owner`), so the radix tree can tell
    when a slice keeps a larger buffer alive (`keeps_extra`). Build segments with `empty`,
    `zeros`, `from_rows` (per-token rows, as tests and simulators write them), the payload
    parser, `slice`, `concat` or `copy`; never from parts of different buffers."""

    p0: int
    layout: KvLayout
    parts: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        if self.p0 < 0:
            raise PayloadError(f"segment p0 {self.p0} < 0")
        lay = self.layout
        if len(self.parts) != lay.n_parts:
            raise PayloadError(f"segment has {len(self.parts)} parts, layout needs {lay.n_parts}")
        n = self.parts[0].shape[0] if self.parts[0].ndim == 2 else -1
        owner = _buffer_owner(self.parts[0])
        for i, part in enumerate(self.parts):
            want = part_shape(lay, i, n)
            if part.dtype != np.uint8 or part.shape != want or (part.size and part.strides[1] != 1):
                raise PayloadError(
                    f"segment part {i} must be uint8 {want} with contiguous rows, "
                    f"got {part.dtype} {part.shape}"
                )
            # One buffer: the tree's memory accounting (owner, keeps_extra) reads parts[0] only.
            if _buffer_owner(part) is not owner:
                raise PayloadError(f"segment part {i} views another buffer than part 0")

    # ---- construction

    @classmethod
    def empty(cls, p0: int, layout: KvLayout, n: int) -> KvSegment:
        """A segment of n positions over one new, uninitialized buffer."""
        return cls(p0, layout, _carve(layout, n, np.empty(n * layout.bytes_per_token, np.uint8)))

    @classmethod
    def zeros(cls, p0: int, layout: KvLayout, n: int) -> KvSegment:
        return cls(p0, layout, _carve(layout, n, np.zeros(n * layout.bytes_per_token, np.uint8)))

    @classmethod
    def from_rows(cls, p0: int, layout: KvLayout, rows: np.ndarray) -> KvSegment:
        """A segment (a copy) from per-token rows: uint8 (n, bytes_per_token), each row all
        layers' K rows of the token, then all layers' V rows (V elements in order)."""
        if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != layout.bytes_per_token:
            raise PayloadError(
                f"rows must be uint8 (n, {layout.bytes_per_token}), got {rows.dtype} {rows.shape}"
            )
        seg = cls.empty(p0, layout, rows.shape[0])
        seg.fill_rows(rows)
        return seg

    def fill_rows(self, rows: np.ndarray) -> None:
        """Copy per-token rows (``from_rows``' format, one row per position) into this
        segment's own memory (e.g. a view of an arena block)."""
        layout = self.layout
        if rows.dtype != np.uint8 or rows.shape != (self.n, layout.bytes_per_token):
            raise PayloadError(
                f"rows must be uint8 ({self.n}, {layout.bytes_per_token}), got {rows.dtype} {rows.shape}"
            )
        rows = np.ascontiguousarray(rows)  # a V element view needs contiguous rows
        for i, part in enumerate(self.parts):
            off, row = _row_span(layout, i)
            if _is_trans(layout, i):
                dt = el_dtype(layout.v_el_bytes[i - layout.n_layer])
                part.view(dt)[...] = rows[:, off : off + row].view(dt).T
            else:
                part[...] = rows[:, off : off + row]

    # ---- what it holds

    @property
    def n(self) -> int:
        return int(self.parts[0].shape[0])

    @property
    def p1(self) -> int:
        return self.p0 + self.n

    @property
    def nbytes(self) -> int:
        return self.n * self.layout.bytes_per_token

    @property
    def owner(self) -> object:
        """The object that owns the parts' memory (an ndarray, bytes, mmap, ...)."""
        return _buffer_owner(self.parts[0])

    def keeps_extra(self) -> bool:
        """True when the segment is a view that keeps a larger buffer alive than its own bytes.
        An owner with an int ``kv_nbytes`` holds a whole payload blob (headers and cell table
        besides the KV): only its KV bytes count."""
        owner = self.owner
        held = getattr(owner, "kv_nbytes", None)  # a payload's home (an arena block): its KV only
        if isinstance(held, int):
            return held > self.nbytes
        if isinstance(owner, np.ndarray):
            return owner.nbytes > self.nbytes
        try:
            with memoryview(owner) as mv:  # type: ignore[arg-type]
                return mv.nbytes > self.nbytes
        except TypeError:
            return True

    def rows(self) -> np.ndarray:
        """Per-token rows (a copy): uint8 (n, bytes_per_token), the inverse of `from_rows`."""
        lay = self.layout
        out = np.empty((self.n, lay.bytes_per_token), np.uint8)
        for i, part in enumerate(self.parts):
            off, row = _row_span(lay, i)
            if _is_trans(lay, i):
                dt = el_dtype(lay.v_el_bytes[i - lay.n_layer])
                out[:, off : off + row].view(dt)[...] = part.view(dt).T
            else:
                out[:, off : off + row] = part
        return out

    def store_bytes(self) -> np.ndarray:
        """The parts end to end in one contiguous uint8 array (a view when they already are)."""
        owner = self.owner
        if (
            isinstance(owner, np.ndarray)
            and owner.dtype == np.uint8
            and owner.nbytes == self.nbytes
            and owner.ndim == 1
            and owner.flags.c_contiguous
        ):
            return owner
        return self.copy().store_bytes()

    # ---- new segments

    def slice(self, a: int, b: int) -> KvSegment:
        """Positions [a, b) (absolute) as a VIEW of this segment's parts."""
        if not self.p0 <= a <= b <= self.p1:
            raise ValueError(f"slice [{a},{b}) outside segment [{self.p0},{self.p1})")
        i, j = a - self.p0, b - self.p0
        lay = self.layout
        parts = tuple(
            p[:, i * _el(lay, k) : j * _el(lay, k)] if _is_trans(lay, k) else p[i:j]
            for k, p in enumerate(self.parts)
        )
        return KvSegment(a, lay, parts)

    def copy(self) -> KvSegment:
        """The same KV in a new buffer of exactly its size."""
        out = KvSegment.empty(self.p0, self.layout, self.n)
        for dst, src in zip(out.parts, self.parts, strict=True):
            dst[...] = src
        return out

    @staticmethod
    def concat(segments: Sequence[KvSegment]) -> KvSegment:
        """One segment (a copy) from adjacent segments of the same layout."""
        check_run(segments)
        first = segments[0]
        out = KvSegment.empty(first.p0, first.layout, segments[-1].p1 - first.p0)
        for seg in segments:
            out.slice(seg.p0, seg.p1).assign(seg)
        return out

    def assign(self, other: KvSegment) -> None:
        """Copy `other`'s KV (same positions count and layout) into this segment's parts."""
        if other.layout != self.layout or other.n != self.n:
            raise PayloadError(f"cannot copy {other!r} into {self!r}")
        for dst, src in zip(self.parts, other.parts, strict=True):
            dst[...] = src

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KvSegment):
            return NotImplemented
        return (
            self.p0 == other.p0
            and self.layout == other.layout
            and self.n == other.n
            and all(np.array_equal(a, b) for a, b in zip(self.parts, other.parts, strict=True))
        )

    __hash__ = None  # type: ignore[assignment]  # mutable arrays inside: not hashable

    def __repr__(self) -> str:
        return f"KvSegment([{self.p0},{self.p1}), {self.layout.bytes_per_token} B/token)"


def check_run(segments: Sequence[KvSegment]) -> None:
    """A non-empty run of segments with one layout, each starting where the previous ends."""
    if not segments:
        raise PayloadError("no segments")
    first = segments[0]
    for prev, seg in zip(segments, segments[1:], strict=False):
        if seg.layout != first.layout:
            raise PayloadError("segments have different layouts")
        if seg.p0 != prev.p1:
            raise PayloadError(f"segments not adjacent: [{prev.p0},{prev.p1}) then [{seg.p0},{seg.p1})")


def el_dtype(el: int) -> np.dtype:
    """One V element as a single numpy item: a transpose then moves items, not bytes
    (about ten times faster than a byte-wise (n, embd, el) transpose)."""
    return np.dtype(f"<u{el}") if el in (1, 2, 4, 8) else np.dtype((np.void, el))


def _is_trans(lay: KvLayout, i: int) -> bool:
    return lay.v_trans and lay.n_layer <= i < lay.n_layer + lay.n_v


def _el(lay: KvLayout, i: int) -> int:
    return lay.v_el_bytes[i - lay.n_layer]


def part_bytes(lay: KvLayout, i: int) -> int:
    """Bytes of part i (K of layers 0.., then V of layers 0.., then cell metadata) per token."""
    if i < lay.n_layer:
        return lay.k_row_bytes[i]
    return lay.v_row_bytes[i - lay.n_layer] if i < lay.n_layer + lay.n_v else lay.cell_ext_bytes


def part_shape(lay: KvLayout, i: int, n: int) -> tuple[int, int]:
    """Shape of part i of a segment of n positions (element-major for a transposed V)."""
    if _is_trans(lay, i):
        il = i - lay.n_layer
        return (lay.n_embd_v_gqa[il], n * lay.v_el_bytes[il])
    return (n, part_bytes(lay, i))


def _row_span(lay: KvLayout, i: int) -> tuple[int, int]:
    """(offset, bytes) of part i inside a per-token row."""
    if i < lay.n_layer:
        return lay.k_offset(i), lay.k_row_bytes[i]
    if i == lay.n_layer + lay.n_v:
        return sum(lay.k_row_bytes) + sum(lay.v_row_bytes), lay.cell_ext_bytes
    il = i - lay.n_layer
    return lay.v_offset(il), lay.v_row_bytes[il]


def _carve(lay: KvLayout, n: int, buf: np.ndarray) -> tuple[np.ndarray, ...]:
    """The parts of n positions as consecutive blocks of `buf` (n * bytes_per_token bytes)."""
    parts, off = [], 0
    for i in range(lay.n_parts):
        size = n * part_bytes(lay, i)
        parts.append(buf[off : off + size].reshape(part_shape(lay, i, n)))
        off += size
    return tuple(parts)


def _buffer_owner(arr: np.ndarray) -> object:
    """The object that owns arr's memory (an ndarray, bytes, mmap, ...)."""
    owner: object = arr
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    return owner
