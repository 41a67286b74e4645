"""Random-weight multimodal projectors ("mmproj" GGUFs) shaped like the vision towers users run
(``radixctl model mmproj SHAPE``, ``radixctl bench vision --mmproj SHAPE``).

Each projector is a llava-style CLIP of projector type MLP (``clip.projector_type`` "mlp":
libmtmd's llava graph, the fewest tensors of any projector): a ViT over the image cut into
square patches, then the two-layer MLP (mm.0, GELU, mm.2) up to the text model's width. llava
reads the features of the second-to-last layer, so ``n_layer - 1`` layers run. There is no class
token: an image is ``(image_size / patch_size)^2`` tokens. A projector of a real tower's shape
(its width, heads, FFN, layers, image and patch size) encodes an image with as much compute as
the real one does, so a benchmark on it measures what an image costs, without a download.

Weights are seeded normal noise scaled so activations stay near unit size (matrices f16 with std
1/sqrt(fan-in), biases small, norms ones); written with the pinned source's gguf writer, once
into the cache, keyed by the content of the spec and of this file, like the shape models:

    mmproj = projector("clip-vit-b-16", model_width(model_path))
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from proxy.errors import ConfigError
from proxy.native import shapes
from proxy.native.fetch import cache_root, file_lock, say, staging_dir
from proxy.native.pins import LLAMA_CPP
from proxy.native.shapes import add_value, gguf_module

Shape = tuple[int, ...]  # ggml order: ne0 (the row length) first


@dataclass(frozen=True)
class ProjectorShape:
    """A vision tower's shape: what an image costs to encode, and how many tokens it becomes."""

    like: str  # the tower it is shaped like
    image_size: int  # the side of the square the server resizes an image to
    patch_size: int
    n_embd: int
    n_head: int
    n_ff: int
    n_layer: int  # llava runs all but the last

    @property
    def n_image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def params(self) -> int:
        """The tower's weights (the MLP onto the text model's width not counted)."""
        e, f = self.n_embd, self.n_ff
        per_layer = 4 * (e * e + e) + 2 * e * f + f + e + 4 * e
        return 3 * self.patch_size**2 * e + e + e * self.n_image_tokens + 2 * e + self.n_layer * per_layer


PROJECTORS: dict[str, ProjectorShape] = {
    # the tests' tower: 16 tokens an image, encoded in a few milliseconds
    "tiny": ProjectorShape("(tests)", 32, 8, 32, 2, 64, 2),
    # CLIP ViT-B/16 at 224 px: 196 tokens an image (86 M weights)
    "clip-vit-b-16": ProjectorShape("CLIP ViT-B/16", 224, 16, 768, 12, 3072, 12),
    # LLaVA-1.5's tower, CLIP ViT-L/14 at 336 px: 576 tokens an image (304 M weights)
    "clip-vit-l-14-336": ProjectorShape("CLIP ViT-L/14-336", 336, 14, 1024, 16, 4096, 24),
}


def parse_projector_ref(ref: str) -> ProjectorShape:
    """A name of :data:`PROJECTORS`, checked."""
    if ref not in PROJECTORS:
        raise ConfigError(
            f"unknown projector shape {ref!r}",
            fix=f"use one of {', '.join(PROJECTORS)} (radixctl model mmproj --list)",
        )
    return PROJECTORS[ref]


def projector(name: str, n_embd_text: int, seed: int = 0) -> Path:
    """The mmproj GGUF of shape ``name`` for a text model of width ``n_embd_text`` (mm.2's
    output), written once into the cache (keyed by its spec and this file)."""
    shape = parse_projector_ref(name)
    # keyed by what decides the file's bytes: the spec, this writer, the metadata typing of
    # shapes.py and the pinned source's gguf-py
    spec = json.dumps(
        {"shape": asdict(shape), "n_embd_text": n_embd_text, "seed": seed, "gguf_py": LLAMA_CPP.sha256},
        sort_keys=True,
    )
    code = Path(__file__).read_bytes() + Path(shapes.__file__).read_bytes()
    key = hashlib.sha256(spec.encode() + code).hexdigest()[:12]
    final = cache_root() / "projectors" / f"mmproj-{name}-e{n_embd_text}-s{seed}-{key}.gguf"
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock"):
        if not final.exists():
            if name != "tiny":
                say(f"write random-weight {shape.like}-shaped projector into {final.parent} ...")
            with staging_dir(final) as tmp:
                _write(shape, n_embd_text, seed, tmp / final.name)
                os.replace(tmp / final.name, final)
    return final


def model_width(model: Path) -> int:
    """A text model GGUF's ``{arch}.embedding_length``: the width a projector for it ends in."""
    gguf = gguf_module()
    reader = gguf.GGUFReader(str(model))
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ConfigError(f"{model} has no general.architecture", fix="pass a llama.cpp text model GGUF")
    width = reader.fields.get(f"{arch_field.contents()}.embedding_length")
    if width is None:
        raise ConfigError(f"{model} has no embedding_length", fix="pass a llama.cpp text model GGUF")
    return int(width.contents())


def _write(shape: ProjectorShape, n_embd_text: int, seed: int, out: Path) -> None:
    gguf = gguf_module()
    writer = gguf.GGUFWriter(str(out), "clip")
    writer.add_string("general.name", f"random-weight {shape.like}-shaped mmproj")
    writer.add_uint32("general.file_type", 1)  # mostly F16
    kv: dict[str, Any] = {
        "clip.has_vision_encoder": True,
        "clip.projector_type": "mlp",
        "clip.vision.image_size": shape.image_size,
        "clip.vision.patch_size": shape.patch_size,
        "clip.vision.embedding_length": shape.n_embd,
        "clip.vision.feed_forward_length": shape.n_ff,
        "clip.vision.block_count": shape.n_layer,
        "clip.vision.attention.head_count": shape.n_head,
        "clip.vision.attention.layer_norm_epsilon": 1e-5,
        "clip.vision.projection_dim": n_embd_text,  # required by the loader, unused by the MLP graph
        "clip.vision.image_mean": [0.5, 0.5, 0.5],
        "clip.vision.image_std": [0.5, 0.5, 0.5],
    }
    for k, v in kv.items():
        add_value(writer, k, v)
    rng = np.random.default_rng(seed)
    for name, dims in _tensors(shape, n_embd_text):
        writer.add_tensor(name, _weights(rng, name, dims))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tensors(shape: ProjectorShape, n_embd_text: int) -> Iterator[tuple[str, Shape]]:
    e, f, p = shape.n_embd, shape.n_ff, shape.patch_size
    yield "v.patch_embd.weight", (p, p, 3, e)  # conv2d kernel: KW, KH, IC, OC
    yield "v.patch_embd.bias", (e,)
    yield "v.position_embd.weight", (e, shape.n_image_tokens)
    yield "v.pre_ln.weight", (e,)
    yield "v.pre_ln.bias", (e,)
    for il in range(shape.n_layer):
        b = f"v.blk.{il}"
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            yield f"{b}.{t}.weight", (e, e)
            yield f"{b}.{t}.bias", (e,)
        for t in ("ln1", "ln2"):
            yield f"{b}.{t}.weight", (e,)
            yield f"{b}.{t}.bias", (e,)
        # up (e -> f) and down (f -> e); a down of ne0 == e would be taken for legacy swapped names
        yield f"{b}.ffn_up.weight", (e, f)
        yield f"{b}.ffn_up.bias", (f,)
        yield f"{b}.ffn_down.weight", (f, e)
        yield f"{b}.ffn_down.bias", (e,)
    yield "mm.0.weight", (e, n_embd_text)
    yield "mm.0.bias", (n_embd_text,)
    yield "mm.2.weight", (n_embd_text, n_embd_text)
    yield "mm.2.bias", (n_embd_text,)


def _weights(rng: np.random.Generator, name: str, dims: Shape) -> np.ndarray:
    """Layer-norm weights are ones and their biases zeros; other biases small noise; matrices
    normal with std 1/sqrt(fan-in) (the conv kernel's fan-in is its KW*KH*IC), so each stage's
    output is about unit size. 1-D tensors and the position embedding stay f32, matrices f16.
    numpy's shape is ggml's reversed."""
    np_shape = tuple(reversed(dims))
    if ".ln" in name or ".pre_ln." in name:
        return np.full(np_shape, 1.0 if name.endswith(".weight") else 0.0, dtype=np.float32)
    if name.endswith(".bias"):
        return rng.standard_normal(np_shape, dtype=np.float32) * 0.02
    if name == "v.position_embd.weight":
        return rng.standard_normal(np_shape, dtype=np.float32) * 0.5
    fan_in = int(np.prod(dims[:-1]))
    matrix: np.ndarray = (rng.standard_normal(np_shape, dtype=np.float32) / np.sqrt(fan_in)).astype(
        np.float16
    )
    return matrix


def resolve_projector(ref: str, model: Path) -> Path:
    """``ref`` as ``--mmproj`` takes it: a shape of :data:`PROJECTORS` (written for ``model``'s
    width; a shape's name wins over a file of that name) or an mmproj GGUF file with a vision
    encoder, as an absolute path (its width is the server's to check: projector types end in
    different tensors)."""
    if ref in PROJECTORS:
        return projector(ref, model_width(model))
    path = Path(ref).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(
            f"projector {ref!r} is neither a shape nor a file",
            fix=f"pass one of {', '.join(PROJECTORS)} or the path of an mmproj GGUF",
        )
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ConfigError(f"{path} is not a GGUF file", fix="pass an mmproj .gguf file")
    try:
        fields = gguf_module().GGUFReader(str(path)).fields
    except (ValueError, OSError, IndexError, KeyError) as exc:  # gguf-py's errors on a damaged file
        raise ConfigError(f"{path} cannot be read as GGUF: {exc}", fix="pass an mmproj .gguf file") from exc
    arch, vision = fields.get("general.architecture"), fields.get("clip.has_vision_encoder")
    if arch is None or arch.contents() != "clip" or vision is None or not vision.contents():
        raise ConfigError(
            f"{path} is not a vision projector (general.architecture 'clip' with a vision encoder)",
            fix="pass the mmproj GGUF made for this model, not the model itself",
        )
    return path
