"""KV payload format: parse / build round trips and every malformed header."""

from __future__ import annotations

import mmap
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.payload import (
    MAGIC,
    KvLayout,
    KvSegment,
    blob_size,
    build_blob,
    parse_blob,
    write_blob,
    write_rows_blob,
)
from proxy.errors import PayloadError

pytestmark = pytest.mark.unit


def make_layout(
    v_trans: bool,
    n_layer: int = 3,
    el: int = 2,
    ext: int = 0,
    k_only: bool = False,
    sections: tuple[int, ...] = (),
) -> KvLayout:
    """`ext`: bytes of extra cell metadata (12 for M-RoPE's positions and token id); `k_only`:
    no V rows (an MLA cache); `sections`: the layers of each KV cache (a full-size SWA model)."""
    if sections:
        lay = make_layout(v_trans, sum(sections), el, ext)
        return KvLayout(**{**lay.__dict__, "sections": sections})
    if k_only:
        k_rows = tuple(8 + 4 * il for il in range(n_layer))
        return KvLayout(n_layer, (1,) * n_layer, k_rows, (), v_trans, (), (), (), ext)
    k_rows = tuple(8 + 4 * il for il in range(n_layer))  # per-layer sizes differ on purpose
    if not v_trans:
        v_rows = tuple(6 + 2 * il for il in range(n_layer))
        zeros = (0,) * n_layer
        return KvLayout(n_layer, (1,) * n_layer, k_rows, (1,) * n_layer, False, v_rows, zeros, zeros, ext)
    embd = tuple(3 + il for il in range(n_layer))
    v_rows = tuple(e * el for e in embd)
    return KvLayout(n_layer, (1,) * n_layer, k_rows, (1,) * n_layer, True, v_rows, (el,) * n_layer, embd, ext)


def random_segment(layout: KvLayout, p0: int, n: int, seed: int = 0) -> KvSegment:
    rng = np.random.default_rng(seed)
    return KvSegment.from_rows(p0, layout, rng.integers(0, 256, (n, layout.bytes_per_token), dtype=np.uint8))


def reference_fields(
    seg: KvSegment, order: np.ndarray | None = None, seq: int = 7, orders: list[np.ndarray] | None = None
) -> list[tuple[str, bytes]]:
    """An independent writer of llama.cpp's layout: named fields, cells in `order` (pool order),
    one section per KV cache (`orders`: each section's own pool order).

    Named pieces let the malformed-header tests corrupt one field at a time; the first section's
    fields are unprefixed, the others' start with `s1.`, `s2.`, ...; layers keep their index."""
    lay, n = seg.layout, seg.n
    plain = np.arange(n) if order is None else order
    f: list[tuple[str, bytes]] = [("magic", struct.pack("<I", MAGIC)), ("seq", struct.pack("<i", seq))]
    il0 = 0
    for s, n_layer in enumerate(lay.section_layers):
        pre = f"s{s}." if s else ""
        sec_order = orders[s] if orders is not None else plain
        f += [(f"{pre}n_stream", struct.pack("<I", 1)), (f"{pre}cell_count", struct.pack("<I", n))]
        f += _reference_cells(seg, sec_order, seq, pre)
        f += [
            (f"{pre}v_trans", struct.pack("<I", int(lay.v_trans))),
            (f"{pre}n_layer", struct.pack("<I", n_layer)),
        ]
        f += _reference_layers(seg, sec_order, range(il0, il0 + n_layer))
        il0 += n_layer
    return f


def _reference_cells(seg: KvSegment, order: np.ndarray, seq: int, pre: str) -> list[tuple[str, bytes]]:
    lay = seg.layout
    f: list[tuple[str, bytes]] = []
    ext_off = sum(lay.k_row_bytes) + sum(lay.v_row_bytes)  # the cell metadata ends a token row
    for i, idx in enumerate(order):
        f += [
            (f"{pre}cell{i}.pos", struct.pack("<i", seg.p0 + int(idx))),
            (f"{pre}cell{i}.n_seq", struct.pack("<I", 1)),
        ]
        if lay.cell_ext_bytes:
            f.append((f"{pre}cell{i}.ext", seg.rows()[idx, ext_off : ext_off + lay.cell_ext_bytes].tobytes()))
        f.append((f"{pre}cell{i}.seq", struct.pack("<i", seq)))
    return f


def _reference_layers(seg: KvSegment, order: np.ndarray, layers: range) -> list[tuple[str, bytes]]:
    lay = seg.layout
    f: list[tuple[str, bytes]] = []
    for il in layers:
        off, row = lay.k_offset(il), lay.k_row_bytes[il]
        f += [
            (f"k{il}.type", struct.pack("<i", lay.k_types[il])),
            (f"k{il}.row", struct.pack("<Q", row)),
            (f"k{il}.data", seg.rows()[order, off : off + row].tobytes()),
        ]
    for il in layers if lay.n_v else []:
        off, row = lay.v_offset(il), lay.v_row_bytes[il]
        rows = seg.rows()[order, off : off + row]
        if not lay.v_trans:
            f += [
                (f"v{il}.type", struct.pack("<i", lay.v_types[il])),
                (f"v{il}.row", struct.pack("<Q", row)),
                (f"v{il}.data", rows.tobytes()),
            ]
            continue
        el, embd = lay.v_el_bytes[il], lay.n_embd_v_gqa[il]
        elem_major = b"".join(rows[:, j * el : (j + 1) * el].tobytes() for j in range(embd))
        f += [
            (f"v{il}.type", struct.pack("<i", lay.v_types[il])),
            (f"v{il}.el", struct.pack("<I", el)),
            (f"v{il}.embd", struct.pack("<I", embd)),
            (f"v{il}.data", elem_major),
        ]
    return f


def join(fields: list[tuple[str, bytes]], **patch: bytes) -> bytes:
    unknown = set(patch) - {name for name, _ in fields}
    assert not unknown, unknown
    return b"".join(patch.get(name, raw) for name, raw in fields)


@pytest.mark.parametrize("ext", [0, 12])
@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_parse_matches_reference(v_trans: bool, shuffle: bool, ext: int) -> None:
    lay = make_layout(v_trans, ext=ext)
    seg = random_segment(lay, p0=40, n=23)
    order = np.random.default_rng(1).permutation(23) if shuffle else None
    parsed = parse_blob(join(reference_fields(seg, order)), expect=lay)
    assert parsed == seg
    assert parsed.p0 == 40 and parsed.p1 == 63 and parsed.nbytes == 23 * lay.bytes_per_token


@pytest.mark.parametrize("ext", [0, 12])
@pytest.mark.parametrize("v_trans", [False, True])
def test_build_equals_reference_and_round_trips(v_trans: bool, ext: int) -> None:
    lay = make_layout(v_trans, ext=ext)
    seg = random_segment(lay, p0=5, n=17)
    ref = join(reference_fields(seg, seq=7))
    assert build_blob([seg], seq_id=7) == ref
    assert build_blob([parse_blob(ref, lay)], seq_id=7) == ref
    assert parse_blob(build_blob([seg]), cell_ext_bytes=ext) == seg
    assert blob_size(lay, 17) == len(ref)


@pytest.mark.parametrize("ext", [0, 12])
@pytest.mark.parametrize("v_trans", [False, True])
def test_k_only_layout_round_trips(v_trans: bool, ext: int) -> None:
    """MLA: the cache holds K only (V is a view of it); the blob ends after the K rows."""
    lay = make_layout(v_trans, ext=ext, k_only=True)
    assert lay.n_v == 0 and lay.n_parts == lay.n_layer + (1 if ext else 0)
    seg = random_segment(lay, p0=3, n=11)
    order = np.random.default_rng(4).permutation(11)
    ref = join(reference_fields(seg, order))
    assert parse_blob(ref, lay) == seg
    blob = build_blob([seg], seq_id=7)
    assert blob == join(reference_fields(seg)) and len(blob) == blob_size(lay, 11)
    assert KvSegment.concat([seg.slice(3, 8), seg.slice(8, 14)]) == seg
    assert KvLayout.from_caps(lay.compat_dict()) == lay
    with pytest.raises(PayloadError):  # a K-only blob is never taken for a full layout, nor back
        parse_blob(blob, make_layout(v_trans, ext=ext))
    with pytest.raises(PayloadError):
        parse_blob(build_blob([random_segment(make_layout(v_trans, ext=ext), 0, 4)]), lay)


def test_cell_metadata_size_must_be_known() -> None:
    """A blob with 12 extra bytes per cell read as plain cells (what the proxy did before it took
    the size from caps) is refused, never misread as other K/V."""
    lay = make_layout(False, ext=12)
    blob = build_blob([random_segment(lay, p0=0, n=9)])
    with pytest.raises(PayloadError):
        parse_blob(blob)
    with pytest.raises(PayloadError):
        parse_blob(blob, make_layout(False))


@pytest.mark.parametrize("ext", [0, 12])
@pytest.mark.parametrize("v_trans", [False, True])
def test_build_from_several_segments_and_views(v_trans: bool, ext: int) -> None:
    lay = make_layout(v_trans, ext=ext)
    seg = random_segment(lay, p0=0, n=30)
    parts = [seg.slice(0, 7), seg.slice(7, 8), seg.slice(8, 30)]
    assert build_blob(parts) == build_blob([seg])
    assert KvSegment.concat(parts) == seg


@pytest.mark.parametrize("el", [1, 3, 4, 8])
def test_v_trans_element_sizes(el: int) -> None:
    lay = make_layout(True, el=el)
    seg = random_segment(lay, p0=3, n=9)
    order = np.random.default_rng(2).permutation(9)
    assert parse_blob(join(reference_fields(seg, order))) == seg
    assert build_blob([seg], seq_id=7) == join(reference_fields(seg, seq=7))


def test_write_blob_into_larger_writable_buffer() -> None:
    lay = make_layout(False)
    seg = random_segment(lay, p0=2, n=4)
    size = blob_size(lay, 4)
    out = bytearray(size + 10)
    assert write_blob([seg], memoryview(out)) == size
    assert bytes(out[:size]) == build_blob([seg])
    with pytest.raises(PayloadError, match="needs"):
        write_blob([seg], bytearray(size - 1))
    with pytest.raises(PayloadError, match="read-only"):
        write_blob([seg], bytes(size))


def test_build_rejects_bad_runs() -> None:
    lay = make_layout(False)
    seg = random_segment(lay, p0=0, n=10)
    with pytest.raises(PayloadError, match="no segments"):
        build_blob([])
    with pytest.raises(PayloadError, match="adjacent"):
        build_blob([seg.slice(0, 3), seg.slice(4, 10)])
    other = random_segment(make_layout(True), p0=10, n=2)
    with pytest.raises(PayloadError, match="layouts"):
        build_blob([seg, other])
    with pytest.raises(PayloadError, match="no cells"):
        build_blob([seg.slice(3, 3)])


def test_segment_slice_is_a_view_and_checks_bounds() -> None:
    seg = random_segment(make_layout(False), p0=10, n=10)
    part = seg.slice(12, 15)
    assert part.p0 == 12 and part.n == 3 and part.owner is seg.owner
    assert np.array_equal(part.rows(), seg.rows()[2:5])
    with pytest.raises(ValueError):
        seg.slice(9, 12)
    with pytest.raises(ValueError):
        seg.slice(15, 21)


def test_segment_validates_data() -> None:
    lay = make_layout(False)
    with pytest.raises(PayloadError):
        KvSegment.from_rows(0, lay, np.zeros((2, lay.bytes_per_token), np.int16))
    with pytest.raises(PayloadError):
        KvSegment.from_rows(0, lay, np.zeros((2, lay.bytes_per_token + 1), np.uint8))
    with pytest.raises(PayloadError):
        KvSegment.from_rows(-1, lay, np.zeros((2, lay.bytes_per_token), np.uint8))
    fortran = np.asfortranarray(np.arange(3 * lay.bytes_per_token, dtype=np.uint8).reshape(3, -1))
    seg = KvSegment.from_rows(0, lay, fortran)
    assert np.array_equal(seg.rows(), fortran)
    with pytest.raises(PayloadError, match="parts"):
        KvSegment(0, lay, seg.parts[:-1])
    with pytest.raises(PayloadError, match="part 1"):
        KvSegment(0, lay, (seg.parts[0], seg.parts[1][:2], *seg.parts[2:]))
    with pytest.raises(PayloadError, match="another buffer"):
        KvSegment(0, lay, (seg.parts[0], seg.parts[1].copy(), *seg.parts[2:]))
    trans = make_layout(True)
    rows = np.asfortranarray(np.arange(3 * trans.bytes_per_token, dtype=np.uint8).reshape(3, -1))
    assert np.array_equal(KvSegment.from_rows(0, trans, rows).rows(), rows)


@pytest.mark.parametrize("v_trans", [False, True])
def test_segment_parts_are_the_blob_data_section(v_trans: bool) -> None:
    """A segment holds the blob's data section (per layer all K rows, then all V rows or V
    element-major), tokens in position order: parsing and writing are block copies."""
    lay = make_layout(v_trans)
    seg = random_segment(lay, 5, 9, seed=3)
    blob = build_blob([seg])
    store = seg.store_bytes()
    assert store.size == seg.nbytes
    data = b"".join(v for k, v in reference_fields(seg) if k.endswith(".data"))
    assert store.tobytes() == data
    assert blob.endswith(data[-lay.v_row_bytes[-1] * 9 :])


@pytest.mark.parametrize("v_trans", [False, True])
def test_segment_slices_are_views_and_copies_compact(v_trans: bool) -> None:
    lay = make_layout(v_trans)
    seg = random_segment(lay, 10, 20, seed=4)
    mid = seg.slice(13, 17)
    assert mid.owner is seg.owner and mid.keeps_extra() and not seg.keeps_extra()
    assert np.array_equal(mid.rows(), seg.rows()[3:7])
    own = mid.copy()
    assert own == mid and own.owner is not seg.owner and not own.keeps_extra()
    assert own.store_bytes().size == own.nbytes
    assert mid.slice(15, 15).n == 0 and mid.slice(15, 15).rows().shape == (0, lay.bytes_per_token)
    joined = KvSegment.concat([seg.slice(10, 13), mid, seg.slice(17, 30)])
    assert joined == seg and joined.owner is not seg.owner
    with pytest.raises(PayloadError):
        own.assign(seg.slice(10, 15))


# ---------------------------------------------------------------- layouts from caps


def caps(v_trans: bool, **extra: object) -> dict[str, object]:
    c: dict[str, object] = {
        "fingerprint": "ab",
        "n_layer": 2,
        "k_types": [1, 1],
        "v_types": [1, 1],
        "k_row_bytes": [384, 384],
        "v_row_bytes": [384, 384],
        "v_trans": v_trans,
        "rope": "norm",
        "n_pos_per_embd": 1,
        "cell_meta_bytes": 12,
        "sections": [2],
    }
    c.update(extra)
    return c


def test_from_caps_plain_and_transposed() -> None:
    plain = KvLayout.from_caps(caps(False))
    assert plain.bytes_per_token == 4 * 384 and plain.v_el_bytes == (0, 0)
    trans = KvLayout.from_caps(caps(True))
    assert trans.v_el_bytes == (2, 2) and trans.n_embd_v_gqa == (192, 192)
    f32 = KvLayout.from_caps(caps(True, v_types=[0, 0]))
    assert f32.n_embd_v_gqa == (96, 96)
    for lay in (plain, trans, f32):
        assert KvLayout.from_caps(lay.compat_dict()) == lay
    assert set(plain.compat_dict()) <= set(caps(False))
    mrope = KvLayout.from_caps(caps(True, cell_meta_bytes=24))  # M-RoPE: 12 more bytes per cell
    assert mrope.cell_ext_bytes == 12 and mrope.bytes_per_token == trans.bytes_per_token + 12
    assert KvLayout.from_caps(mrope.compat_dict()) == mrope


@pytest.mark.parametrize(
    "extra",
    [
        {"n_layer": 3},  # lists shorter than n_layer
        {"n_layer": 0},
        {"k_row_bytes": [384, 0]},
        {"k_types": "x"},
        {"v_trans": True, "v_types": [2, 2]},  # quantized V cannot be transposed
        {"v_trans": True, "v_row_bytes": [385, 384]},  # not a multiple of 2
        {"cell_meta_bytes": 8},  # less than a cell's position, count and sequence id
        {"cell_meta_bytes": "x"},
        {"cell_meta_bytes": 4096},
    ],
)
def test_from_caps_rejects(extra: dict[str, object]) -> None:
    with pytest.raises(PayloadError):
        KvLayout.from_caps({**caps(False), **extra})


def test_from_caps_missing_field() -> None:
    c = caps(False)
    del c["k_types"]
    with pytest.raises(PayloadError, match="missing"):
        KvLayout.from_caps(c)


# ---------------------------------------------------------------- malformed payloads

u32, i32, u64 = (
    (lambda v: struct.pack("<I", v)),
    (lambda v: struct.pack("<i", v)),
    (lambda v: struct.pack("<Q", v)),
)

MALFORMED: list[tuple[str, bool, dict[str, bytes], str]] = [
    ("bad magic", False, {"magic": u32(0xDEADBEEF)}, "magic"),
    ("two streams", False, {"n_stream": u32(2)}, "n_stream"),
    ("zero cells", False, {"cell_count": u32(0)}, "no cells"),
    ("too many cells", False, {"cell_count": u32(10**6)}, "truncated"),
    ("cell count off by one", False, {"cell_count": u32(5)}, ""),
    ("n_seq_id 2", False, {"cell2.n_seq": u32(2)}, "n_seq_id"),
    ("n_seq_id 0", False, {"cell0.n_seq": u32(0)}, "n_seq_id"),
    ("negative seq", False, {"cell0.seq": i32(-1), "cell1.seq": i32(-1)}, "sequence"),
    ("mixed seq", False, {"cell3.seq": i32(8)}, "sequence"),
    ("duplicate position", False, {"cell1.pos": i32(10)}, "positions"),
    ("gap in positions", False, {"cell3.pos": i32(99)}, "positions"),
    ("negative position", False, {"cell0.pos": i32(-1)}, "positions"),
    ("v_trans 2", False, {"v_trans": u32(2)}, "v_trans"),
    ("v_trans flipped", False, {"v_trans": u32(1)}, ""),
    ("v_trans cleared", True, {"v_trans": u32(0)}, ""),
    ("zero layers", False, {"n_layer": u32(0)}, "n_layer"),
    ("huge n_layer", False, {"n_layer": u32(10**6)}, "n_layer"),
    ("one layer more", False, {"n_layer": u32(4)}, ""),
    ("one layer less", False, {"n_layer": u32(2)}, ""),
    ("negative k type", False, {"k1.type": i32(-1)}, "type"),
    ("huge k type", False, {"k1.type": i32(1000)}, "type"),
    ("zero k row", False, {"k0.row": u64(0)}, "row size"),
    ("k row too big", False, {"k0.row": u64(9)}, ""),
    ("huge k row", False, {"k0.row": u64(2**62)}, "truncated"),
    ("k row short", False, {"k2.row": u64(15)}, ""),
    ("bad v type", False, {"v0.type": i32(-5)}, "type"),
    ("zero v row", False, {"v2.row": u64(0)}, "row size"),
    ("v row too big", False, {"v2.row": u64(11)}, ""),
    ("trans zero el", True, {"v0.el": u32(0)}, "element size"),
    ("trans zero embd", True, {"v1.embd": u32(0)}, "element size"),
    ("trans embd too big", True, {"v1.embd": u32(5)}, ""),
    ("trans el mismatch", True, {"v1.el": u32(4)}, ""),
    ("trans huge el", True, {"v1.el": u32(2**31)}, "truncated"),
    ("truncated data", False, {"v2.data": b"\0"}, "truncated"),
]


@pytest.mark.parametrize(("case", "v_trans", "patch", "message"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_header_raises(case: str, v_trans: bool, patch: dict[str, bytes], message: str) -> None:
    seg = random_segment(make_layout(v_trans), p0=10, n=6)
    blob = join(reference_fields(seg), **patch)
    with pytest.raises(PayloadError, match=message or None):
        parse_blob(blob)


def test_trailing_byte_and_every_truncation_raise() -> None:
    for v_trans in (False, True):
        blob = build_blob([random_segment(make_layout(v_trans), p0=0, n=3)])
        with pytest.raises(PayloadError, match="trailing"):
            parse_blob(blob + b"\0")
        lay = make_layout(v_trans)
        k_end = (
            blob_size(lay, 3) - 3 * sum(lay.v_row_bytes) - lay.n_layer * 12
        )  # V headers: 12 bytes either way
        for cut in range(len(blob)):
            with pytest.raises(PayloadError):
                parse_blob(blob[:cut], expect=lay)  # how the proxy parses: against the server's layout
            if cut != k_end:  # cut right after K, the blob reads as a K-only (MLA) one
                with pytest.raises(PayloadError):
                    parse_blob(blob[:cut])


def test_expect_layout_mismatch() -> None:
    seg = random_segment(make_layout(False), p0=0, n=3)
    other = make_layout(False, n_layer=2)
    with pytest.raises(PayloadError, match="n_layer"):
        parse_blob(build_blob([seg]), expect=other)
    changed = KvLayout(**{**make_layout(False).__dict__, "k_types": (1, 0, 1)})
    with pytest.raises(PayloadError, match="k_types"):
        parse_blob(build_blob([seg]), expect=changed)


@settings(max_examples=150, deadline=None)
@given(
    v_trans=st.booleans(),
    p0=st.integers(0, 5000),
    n=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    shuffle=st.booleans(),
    ext=st.sampled_from([0, 4, 12]),
)
def test_round_trip_property(v_trans: bool, p0: int, n: int, seed: int, shuffle: bool, ext: int) -> None:
    lay = make_layout(v_trans, n_layer=1 + seed % 3, ext=ext)
    seg = random_segment(lay, p0, n, seed)
    order = np.random.default_rng(seed).permutation(n) if shuffle else None
    assert parse_blob(join(reference_fields(seg, order)), expect=lay) == seg
    assert parse_blob(build_blob([seg]), lay) == seg
    assert KvSegment.concat([seg.slice(p0, p0 + n // 2), seg.slice(p0 + n // 2, p0 + n)]) == seg


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_corruption_raises_only_payload_error(data: st.DataObject) -> None:
    """Flipping any bytes of a blob either still parses or raises PayloadError, nothing else."""
    v_trans = data.draw(st.booleans())
    blob = bytearray(build_blob([random_segment(make_layout(v_trans, n_layer=2), p0=3, n=4)]))
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    try:
        seg = parse_blob(bytes(blob))
    except PayloadError:
        return
    assert seg.n == 4


def test_errors_leave_no_view_of_an_mmap() -> None:
    """A failed parse or write must not keep the mmap exported, or closing it raises BufferError."""
    seg = random_segment(make_layout(False), p0=0, n=3)
    blob = build_blob([seg])
    with pytest.raises(PayloadError), mmap.mmap(-1, len(blob) + 1) as m:
        m[: len(blob)] = blob
        parse_blob(m)  # one trailing byte
    with pytest.raises(PayloadError), mmap.mmap(-1, len(blob) - 1) as m:
        write_blob([seg], m)  # too small
    with mmap.mmap(-1, len(blob)) as m:
        assert write_blob([seg], m) == len(blob)
        assert parse_blob(m) == seg


# ---------------------------------------------------------------- sections (full-size SWA)


@pytest.mark.parametrize("ext", [0, 12])
@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("sections", [(2, 1), (1, 3), (1, 1, 1)])
def test_sections_parse_and_build_as_the_reference(
    sections: tuple[int, ...], v_trans: bool, ext: int
) -> None:
    """One section per KV cache, each with every cell in its own pool order; the segment holds
    the layers of all sections in order, the cell metadata once."""
    lay = make_layout(v_trans, ext=ext, sections=sections)
    assert lay.section_layers == sections and lay.n_layer == sum(sections)
    seg = random_segment(lay, p0=12, n=9)
    rng = np.random.default_rng(3)
    orders = [rng.permutation(9) for _ in sections]
    assert parse_blob(join(reference_fields(seg, orders=orders)), expect=lay) == seg
    ref = join(reference_fields(seg, seq=7))
    assert build_blob([seg], seq_id=7) == ref and blob_size(lay, 9) == len(ref)
    assert parse_blob(ref, cell_ext_bytes=ext) == seg  # the sections are read from the blob itself
    assert KvLayout.from_caps(lay.compat_dict()) == lay
    parts = [seg.slice(12, 15), seg.slice(15, 21)]
    assert build_blob(parts, seq_id=7) == ref


def test_one_section_is_the_plain_layout() -> None:
    plain = make_layout(False)
    assert KvLayout(**{**plain.__dict__, "sections": (3,)}) == plain
    assert plain.section_layers == (3,) and plain.compat_dict()["sections"] == [3]
    assert KvLayout.from_caps({**caps(False), "sections": [2]}) == KvLayout.from_caps(caps(False))


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"s1.cell_count": u32(5)}, "cells"),
        ({"s1.cell0.pos": i32(99)}, "positions"),
        ({"s1.cell0.pos": i32(16), "s1.cell1.pos": i32(17), "s1.cell2.pos": i32(18)}, "positions"),
        ({"s1.n_stream": u32(2)}, "n_stream"),
        ({"s1.v_trans": u32(1)}, "v_trans"),
        ({"s1.n_layer": u32(2)}, ""),
        ({"s1.cell1.ext": bytes(12)}, "metadata"),
    ],
)
def test_sections_must_agree(patch: dict[str, bytes], message: str) -> None:
    """The sections are one sequence: the same cells, positions and metadata in each."""
    seg = random_segment(make_layout(False, ext=12, sections=(2, 1)), p0=10, n=6)
    with pytest.raises(PayloadError, match=message or None):
        parse_blob(join(reference_fields(seg), **patch), cell_ext_bytes=12)


def test_sections_never_taken_for_another_layout() -> None:
    split = make_layout(False, sections=(2, 1))
    plain = make_layout(False)  # same layers, one cache
    with pytest.raises(PayloadError, match="sections"):
        parse_blob(build_blob([random_segment(split, 0, 4)]), expect=plain)
    with pytest.raises(PayloadError):
        parse_blob(build_blob([random_segment(plain, 0, 4)]), expect=split)
    blob = build_blob([random_segment(split, 0, 3)])
    for cut in range(len(blob)):
        with pytest.raises(PayloadError):
            parse_blob(blob[:cut], expect=split)


@pytest.mark.parametrize(
    "sections",
    [(2, 2), (3, 0), (1, 1, 1, 0), (1,) * 5],
)
def test_layout_rejects_bad_sections(sections: tuple[int, ...]) -> None:
    base = make_layout(False, n_layer=len(sections) if sum(sections) != len(sections) else 3)
    with pytest.raises(PayloadError, match="sections"):
        KvLayout(**{**base.__dict__, "sections": sections})


def test_k_only_has_one_section() -> None:
    lay = make_layout(False, n_layer=2, k_only=True)
    with pytest.raises(PayloadError, match="K-only"):
        KvLayout(**{**lay.__dict__, "sections": (1, 1)})


def test_more_sections_than_allowed_are_refused() -> None:
    lay = make_layout(False, n_layer=4, sections=(1, 1, 1, 1))
    blob = join(reference_fields(random_segment(lay, 0, 2)))
    head = 8  # magic and seq id; then append a fifth copy of the last section
    sec = blob[head:]
    one = len(sec) // 4
    with pytest.raises(PayloadError, match="more than 4 sections"):
        parse_blob(blob + sec[-one:])


@pytest.mark.parametrize("ext", [0, 12])
@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("shape", ["plain", "k_only", "sections"])
def test_write_rows_blob_is_the_blob_of_the_rows(shape: str, v_trans: bool, ext: int) -> None:
    """The disk tier's path into an arena block: per-token rows written straight into a blob
    equal the blob of the segment made from those rows, and parse back to the same rows."""
    lay = make_layout(
        v_trans, ext=ext, k_only=shape == "k_only", sections=(2, 1) if shape == "sections" else ()
    )
    rows = np.random.default_rng(5).integers(0, 256, (7, lay.bytes_per_token), dtype=np.uint8)
    out = np.full(blob_size(lay, 7) + 9, 0xEE, np.uint8)
    assert write_rows_blob(30, lay, rows, out) == blob_size(lay, 7)
    assert out[: blob_size(lay, 7)].tobytes() == build_blob([KvSegment.from_rows(30, lay, rows)])
    assert (out[blob_size(lay, 7) :] == 0xEE).all()  # nothing past the blob
    seg = parse_blob(out[: blob_size(lay, 7)], expect=lay, view=True)
    assert seg.p0 == 30 and np.array_equal(seg.rows(), rows)
    with pytest.raises(PayloadError, match="rows must be"):
        write_rows_blob(30, lay, rows[:, 1:], out)
    with pytest.raises(PayloadError, match="output buffer has"):
        write_rows_blob(30, lay, rows, out[:10])
