"""A tiny random-weight multimodal projector ("mmproj") GGUF and tiny PNG images, made here.

The projector is a llava-style CLIP of projector type MLP (`clip.projector_type` "mlp": libmtmd's
llava graph): a ViT of 2 layers at width 32 (llava reads the features of the second-to-last
layer, so one layer runs) over a 32x32 image cut into 8x8 patches, then the two-layer MLP
(mm.0, GELU, mm.2) up to the text model's width. Each image is 16 tokens. The weights are
seeded normal noise scaled so activations stay near unit size; norms are ones. Written with the
pinned source's gguf writer and cached by the content of its spec and of this file, like
tinymodels.py's models.

    mmproj = tiny_mmproj(576)                 # for SmolLM2-135M (n_embd 576)
    part = image_part(tiny_png(seed=1))       # an OpenAI image_url content part
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from proxy.native.fetch import cache_root, file_lock, staging_dir
from proxy.native.shapes import add_value, gguf_module

Shape = tuple[int, ...]  # ggml order: ne0 (the row length) first

# The vision tower: (IMAGE_SIZE / PATCH_SIZE)^2 patches, one image token each (no class token).
IMAGE_SIZE = 32
PATCH_SIZE = 8
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
_VIT = {"n_embd": 32, "n_head": 2, "n_ff": 64, "n_layer": 2}


def tiny_mmproj(n_embd: int, seed: int = 0) -> Path:
    """The mmproj GGUF for a text model of width `n_embd` (mm.2's output), written once into
    the cache (keyed by its spec and this file)."""
    spec = {"n_embd": n_embd, "seed": seed, "image": IMAGE_SIZE, "patch": PATCH_SIZE, "vit": _VIT}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode() + Path(__file__).read_bytes()).hexdigest()[
        :12
    ]
    final = cache_root() / "tiny-models" / f"mmproj-e{n_embd}-s{seed}-{key}.gguf"
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock"):
        if not final.exists():
            with staging_dir(final) as tmp:
                _write(n_embd, seed, tmp / final.name)
                os.replace(tmp / final.name, final)
    return final


def _write(n_embd: int, seed: int, out: Path) -> None:
    gguf = gguf_module()
    writer = gguf.GGUFWriter(str(out), "clip")
    writer.add_string("general.name", "tiny-mmproj")
    writer.add_uint32("general.file_type", 1)  # mostly F16
    kv: dict[str, Any] = {
        "clip.has_vision_encoder": True,
        "clip.projector_type": "mlp",
        "clip.vision.image_size": IMAGE_SIZE,
        "clip.vision.patch_size": PATCH_SIZE,
        "clip.vision.embedding_length": _VIT["n_embd"],
        "clip.vision.feed_forward_length": _VIT["n_ff"],
        "clip.vision.block_count": _VIT["n_layer"],
        "clip.vision.attention.head_count": _VIT["n_head"],
        "clip.vision.attention.layer_norm_epsilon": 1e-5,
        "clip.vision.projection_dim": n_embd,  # required by the loader, unused by the MLP graph
        "clip.vision.image_mean": [0.5, 0.5, 0.5],
        "clip.vision.image_std": [0.5, 0.5, 0.5],
    }
    for k, v in kv.items():
        add_value(writer, k, v)
    rng = np.random.default_rng(seed)
    for name, shape in _tensors(n_embd):
        writer.add_tensor(name, _weights(rng, name, shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tensors(n_embd: int) -> Iterator[tuple[str, Shape]]:
    e, f = _VIT["n_embd"], _VIT["n_ff"]
    yield "v.patch_embd.weight", (PATCH_SIZE, PATCH_SIZE, 3, e)  # conv2d kernel: KW, KH, IC, OC
    yield "v.patch_embd.bias", (e,)
    yield "v.position_embd.weight", (e, N_IMAGE_TOKENS)
    yield "v.pre_ln.weight", (e,)
    yield "v.pre_ln.bias", (e,)
    for il in range(_VIT["n_layer"]):
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
    yield "mm.0.weight", (e, n_embd)
    yield "mm.0.bias", (n_embd,)
    yield "mm.2.weight", (n_embd, n_embd)
    yield "mm.2.bias", (n_embd,)


def _weights(rng: np.random.Generator, name: str, shape: Shape) -> np.ndarray:
    """Layer-norm weights are ones and their biases zeros; other biases small noise; matrices
    normal with std 1/sqrt(fan-in) (the conv kernel's fan-in is its KW*KH*IC), so each stage's
    output is about unit size. 1-D tensors and the position embedding stay f32, matrices f16.
    numpy's shape is ggml's reversed."""
    np_shape = tuple(reversed(shape))
    is_norm = ".ln" in name or ".pre_ln." in name
    if is_norm:
        fill = 1.0 if name.endswith(".weight") else 0.0
        return np.full(np_shape, fill, dtype=np.float32)
    if name.endswith(".bias"):
        return rng.standard_normal(np_shape, dtype=np.float32) * 0.02
    if name == "v.position_embd.weight":
        return rng.standard_normal(np_shape, dtype=np.float32) * 0.5
    fan_in = int(np.prod(shape[:-1]))
    return (rng.standard_normal(np_shape, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float16)


def tiny_png(seed: int, size: int = IMAGE_SIZE) -> bytes:
    """A `size` x `size` RGB PNG of seeded random pixels (8-bit, unfiltered rows)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)  # filter type 0 per row
    ihdr = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)  # 8-bit truecolour
    chunks = _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw)) + _chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def image_part(png: bytes) -> dict[str, Any]:
    """The OpenAI chat content part carrying `png` as a base64 data URL."""
    url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}}
