"""The vision benchmark's parts: projectors of real towers' shapes, the vision workload, and the
limit's keying of media cells."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.bench import limit as lim
from proxy.bench.workloads import DEFAULT_ARMS, make_workload
from proxy.errors import ConfigError
from proxy.native import projectors
from proxy.native.shapes import gguf_module
from proxy.traffic.images import image_part, png

pytestmark = pytest.mark.unit


# ---- projectors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "tokens", "weights_m"),
    [("tiny", 16, None), ("clip-vit-b-16", 196, 86), ("clip-vit-l-14-336", 576, 304)],
)
def test_projector_shapes_are_the_real_towers(name: str, tokens: int, weights_m: int | None) -> None:
    shape = projectors.PROJECTORS[name]
    assert shape.n_image_tokens == tokens
    if weights_m is not None:  # CLIP ViT-B/16's tower is 86 M weights, ViT-L/14-336's 304 M
        assert shape.params() / 1e6 == pytest.approx(weights_m, rel=0.02)


def test_a_written_projector_reads_back_as_its_shape(tmp_path: Path) -> None:
    small = replace(
        projectors.PROJECTORS["clip-vit-b-16"], image_size=64, n_embd=64, n_head=4, n_ff=128, n_layer=3
    )
    out = tmp_path / "mmproj.gguf"
    projectors._write(small, 96, 0, out)
    reader = gguf_module().GGUFReader(str(out))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["clip.projector_type"] == "mlp" and fields["clip.vision.block_count"] == 3
    assert fields["clip.vision.image_size"] == 64 and fields["clip.vision.patch_size"] == 16
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {name for name, _ in projectors._tensors(small, 96)}
    assert tuple(int(d) for d in tensors["mm.2.weight"].shape) == (96, 96)  # onto the text model's width
    assert tuple(int(d) for d in tensors["v.position_embd.weight"].shape) == (64, small.n_image_tokens)
    up = np.asarray(tensors["v.blk.0.ffn_up.weight"].data, dtype=np.float64)
    assert up.std() == pytest.approx(1 / np.sqrt(64), rel=0.1)  # 1/sqrt(fan-in)


def _text_model(path: Path, width: int) -> Path:
    """A GGUF with only what model_width reads: an architecture and its embedding length."""
    writer = gguf_module().GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.embedding_length", width)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def test_projector_refs_resolve_or_say_what_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _text_model(tmp_path / "text.gguf", 96)
    assert projectors.model_width(model) == 96
    with pytest.raises(ConfigError, match="neither a shape nor a file") as err:
        projectors.resolve_projector("clip-vit-h", model)
    assert err.value.fix and "clip-vit-b-16" in err.value.fix
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ConfigError, match="not a GGUF"):
        projectors.resolve_projector(str(bad), model)
    with pytest.raises(ConfigError, match="not a vision projector"):
        projectors.resolve_projector(str(model), model)  # the text model itself
    monkeypatch.setattr(projectors, "cache_root", lambda: tmp_path / "cache")
    tiny = projectors.resolve_projector("tiny", model)
    assert tiny == projectors.projector("tiny", 96) and tiny.is_relative_to(tmp_path / "cache")
    monkeypatch.chdir(tiny.parent)
    assert projectors.resolve_projector(tiny.name, model) == tiny  # a relative path, made absolute


# ---- the workload ------------------------------------------------------------------------------------


def _images(body: dict[str, Any]) -> list[str]:
    return [
        part["image_url"]["url"]
        for msg in body["messages"]
        if isinstance(msg["content"], list)
        for part in msg["content"]
        if part["type"] == "image_url"
    ]


@pytest.mark.parametrize("flag", ["--mmproj", "-mm", "--mmproj-url", "-mmu"])
def test_a_projector_given_twice_is_refused(flag: str) -> None:
    from types import SimpleNamespace

    from proxy.bench.cli_options import with_projector

    settings = SimpleNamespace(extra_args=("-c", "4096", flag, "other.gguf"), model="unused")
    with pytest.raises(ConfigError, match="given twice"):
        with_projector(settings, "tiny")


def test_vision_sessions_send_the_shared_and_their_own_photos_on_every_turn() -> None:
    wl = make_workload("vision", users=3, rounds=3, shared_images=2, own_images=1, image_px=16)
    assert DEFAULT_ARMS["vision"] == ("legacy", "proxy") and wl.concurrency == 3
    by_id = {r.id: r for r in wl.requests}
    assert len(by_id) == 9
    # arrival order: every session's first round, then the second rounds, ...
    assert [r.id for r in wl.requests[:4]] == ["s0-r1", "s1-r1", "s2-r1", "s0-r2"]
    firsts = [_images(by_id[f"s{u}-r1"].body) for u in range(3)]
    assert all(len(f) == 3 for f in firsts)
    assert firsts[0][:2] == firsts[1][:2] == firsts[2][:2]  # the shared photos: the same bytes
    assert len({f[2] for f in firsts}) == 3  # each session's own photo differs
    for u in range(3):
        for rnd in (2, 3):
            req = by_id[f"s{u}-r{rnd}"]
            assert req.after == (f"s{u}-r{rnd - 1}",)  # closed loop: after its last answer
            assert _images(req.body) == firsts[u]  # the photos again, with the history
            earlier = by_id[f"s{u}-r{rnd - 1}"].body["messages"]
            assert req.body["messages"][: len(earlier)] == earlier  # the history grows
    assert {r.delay_s for r in wl.requests if r.meta["round"] == 1} == {0.0, 0.5, 1.0}
    # one seed, the same workload
    assert make_workload("vision", users=3, rounds=3, shared_images=2, own_images=1, image_px=16) == wl


@pytest.mark.parametrize(
    "options",
    [{"users": 0}, {"rounds": 0}, {"shared_images": 0, "own_images": 0}, {"own_images": -1}, {"image_px": 4}],
)
def test_vision_refuses_what_it_cannot_make(options: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        make_workload("vision", **options)


def test_png_is_a_valid_image_of_its_size() -> None:
    data = png(7, 12)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(data[16:20], "big") == 12
    assert png(7, 12) == data != png(8, 12)
    assert image_part(data)["image_url"]["url"].startswith("data:image/png;base64,")


# ---- the limit's media cells -------------------------------------------------------------------------


def _reply(tokens: list[int], media: list[dict[str, Any]]) -> dict[str, Any]:
    return {"tokens": tokens, "media": [{"chunk": "bWV0YQ==", **m} for m in media]}


def test_media_cells_key_chunks_no_move_names_by_their_hash() -> None:
    movable = {"idx": 1, "n_tokens": 2, "id": "aa", "movable": True}
    fixed = {"idx": 4, "n_tokens": 2, "id": "bb", "movable": False}
    cells = lim.media_cells(_reply([5, -7, -9, 6, -1, -1, 8], [movable, fixed]))
    assert cells == [5, -7, -9, 6, ("bb", 0), ("bb", 1), 8]


@pytest.mark.parametrize(
    ("tokens", "media", "word"),
    [
        (
            [5, -1],
            [{"idx": 1, "n_tokens": 2, "id": "cc", "movable": False}],
            "does not match",
        ),  # past the end
        (
            [5, -1, 6, -1],
            [{"idx": 1, "n_tokens": 1, "id": "cc", "movable": False}],
            "no media chunk",
        ),  # stray -1
        ([5, -1, -1], [{"idx": 1, "n_tokens": 2, "id": "dd", "movable": True}], "does not match"),  # unkeyed
        ([5, -1, -1], [{"idx": 1, "n_tokens": 2, "id": "", "movable": False}], "no id"),  # two images alike
    ],
)
def test_media_cells_refuse_a_reply_they_cannot_key(
    tokens: list[int], media: list[dict[str, Any]], word: str
) -> None:
    with pytest.raises(ValueError, match=word):
        lim.media_cells(_reply(tokens, media))


def test_the_same_image_after_the_same_text_is_reused_and_another_is_new() -> None:
    def fixed(image: str) -> list[Any]:
        return lim.media_cells(
            _reply([1, 2, -1, -1, -1, 3], [{"idx": 2, "n_tokens": 3, "id": image, "movable": False}])
        )

    # the same image again: only the last token; another image: the image and what follows
    assert lim.min_prefill([fixed("a"), fixed("a"), fixed("b")]) == [6, 1, 4]
