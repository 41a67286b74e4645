"""Random-weight GGUFs shaped like the models users run (``radixctl model make SHAPE``).

Prefill and KV moves cost what a model's shape says: its layer count, width, heads, head dim,
grouped KV heads and weight type. A random-weight model of a real shape computes exactly as much
as the real one does, so benchmarks on it measure what users would see, without downloading a
single weight. Each model carries the default model's tokenizer (vocab, merges, chat template):
prompts tokenize and render for real, the proxy's tokenizer and template checks pass as with
SmolLM2, and only the embedding and output rows differ in count from the real model's vocab
(prefill computes logits for the last token alone, so that changes almost nothing).

Weights are quantized blocks written directly (Q4_0 or Q8_0: seeded random quants, one scale a
tensor chosen so each matrix has std 1/sqrt(fan-in)); norms are ones. A model is written once
into the cache, keyed by the content of its spec, of this file and of the tokenizer model, like
the native builds:

    path = shape_model("llama-3.2-1b", "q4_0")
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from proxy.errors import ConfigError
from proxy.native.build import pristine_source
from proxy.native.fetch import cache_root, file_lock, say, staging_dir
from proxy.native.model import default_model_path
from proxy.native.pins import SMOLLM2

#: The weight types a shape can be written in.
QUANTS = ("q4_0", "q8_0")
DEFAULT_QUANT = "q4_0"
#: ``--model shape:NAME[:QUANT]`` names a shape wherever a GGUF path is accepted.
SHAPE_PREFIX = "shape:"

_BLOCK = 32  # elements per Q4_0 / Q8_0 block
# Bytes per block: a f16 scale, then 16 bytes of nibbles (value q - 8) for Q4_0, 32 signed bytes
# for Q8_0. Random quants are drawn uniformly, then the one value without a mirror (-8, -128) is
# made 0 so a matrix has mean 0: values -7..7 (0 twice) and -127..127 (0 twice), whose std is:
_BLOCK_BYTES = {"q4_0": 2 + _BLOCK // 2, "q8_0": 2 + _BLOCK}
_QUANT_STD = {"q4_0": float(np.sqrt(2 * 140 / 16)), "q8_0": float(np.sqrt(2 * 690880 / 256))}
_LOGIT_STD = 8.0  # the output's logits spread over about this many nats


@dataclass(frozen=True)
class ModelShape:
    """One real model's shape: its GGUF arch and the hyper-parameters that decide its cost."""

    arch: str
    like: str  # the model it is shaped like
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_theta: float
    context_length: int
    rms_eps: float = 1e-5
    tied: bool = True  # the output reuses the token embedding
    qk_norm: bool = False  # per-head q/k RMS norms (Qwen3)
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)

    def kv_bytes_per_token(self, bytes_per_element: float = 2.0) -> int:
        """K and V of every layer for one token (f16 by default)."""
        return int(2 * self.n_layer * self.n_head_kv * self.head_dim * bytes_per_element)

    def weights(self, n_vocab: int) -> int:
        """Parameter count with a vocabulary of ``n_vocab`` rows."""
        return sum(int(np.prod(s)) for _, s in _tensors(self, n_vocab))


SHAPES: dict[str, ModelShape] = {
    "llama-3.2-1b": ModelShape("llama", "Llama-3.2-1B", 16, 2048, 32, 8, 64, 8192, 500000.0, 131072),
    "llama-3.2-3b": ModelShape("llama", "Llama-3.2-3B", 28, 3072, 24, 8, 128, 8192, 500000.0, 131072),
    "qwen3-4b": ModelShape(
        "qwen3", "Qwen3-4B", 36, 2560, 32, 8, 128, 9728, 1000000.0, 40960, rms_eps=1e-6, qk_norm=True
    ),
    "llama-3.1-8b": ModelShape(
        "llama", "Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 500000.0, 131072, tied=False
    ),
    "qwen2.5-32b": ModelShape(
        "qwen2",
        "Qwen2.5-32B",
        64,
        5120,
        40,
        8,
        128,
        27648,
        1000000.0,
        32768,
        rms_eps=1e-6,
        tied=False,
        qkv_bias=True,
    ),
}


def parse_shape_ref(ref: str) -> tuple[str, str]:
    """``shape:NAME[:QUANT]`` (or ``NAME[:QUANT]``) -> (name, quant), checked."""
    name, _, quant = ref.removeprefix(SHAPE_PREFIX).partition(":")
    quant = quant or DEFAULT_QUANT
    if name not in SHAPES:
        raise ConfigError(
            f"unknown model shape {name!r}",
            fix=f"use one of {', '.join(SHAPES)} (radixctl model shapes lists them)",
        )
    if quant not in QUANTS:
        raise ConfigError(f"unknown weight type {quant!r} for a shape", fix=f"use one of {', '.join(QUANTS)}")
    return name, quant


def shape_model(name: str, quant: str = DEFAULT_QUANT) -> Path:
    """The GGUF of shape ``name`` in weight type ``quant``, written once into the cache."""
    shape = SHAPES[name]
    spec = json.dumps(
        {"shape": asdict(shape), "quant": quant, "tokenizer": SMOLLM2.member_sha256}, sort_keys=True
    )
    key = hashlib.sha256(spec.encode() + Path(__file__).read_bytes()).hexdigest()[:12]
    final = cache_root() / "shape-models" / f"{name}-{quant}-{key}.gguf"
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock"):
        if not final.exists():
            say(f"write random-weight {shape.like}-shaped model ({quant}) into {final.parent} ...")
            with staging_dir(final) as tmp:
                _write(name, shape, quant, tmp / final.name)
                os.replace(tmp / final.name, final)
            say(f"model ready: {final}")
    return final


def gguf_module() -> Any:
    """The pinned source's gguf-py (the writer that matches the server's reader)."""
    path = str(pristine_source() / "gguf-py")
    if path not in sys.path:
        sys.path.insert(0, path)
    import gguf

    return gguf


def vocab_path() -> Path:
    """A GGUF of the default model's ``tokenizer.*`` keys alone (about 2 MB, written once from
    the default model): what the models made here copy. A machine without network can be given
    this file under the cache's models/ instead of the 98 MB model (deploy/gpu/carry.sh)."""
    final = cache_root() / "models" / f"vocab-{SMOLLM2.member_sha256[:12]}.gguf"
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock"):
        if not final.exists():
            gguf = gguf_module()
            with staging_dir(final) as tmp:
                writer = gguf.GGUFWriter(str(tmp / final.name), "llama")
                _copy_keys(gguf, writer, default_model_path())
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_ti_data_to_file()
                writer.close()
                os.replace(tmp / final.name, final)
    return final


def copy_tokenizer(gguf: Any, writer: Any) -> int:
    """Copy every ``tokenizer.*`` key of the default model; returns the vocabulary size."""
    return _copy_keys(gguf, writer, vocab_path())


def _copy_keys(gguf: Any, writer: Any, source: Path) -> int:
    reader = gguf.GGUFReader(str(source))
    n_vocab = 0
    for key, fld in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = fld.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            values = fld.contents()
            writer.add_array(key, values)
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(values)
        else:
            writer.add_key_value(key, fld.contents(), vtype)
    return n_vocab


def add_value(writer: Any, key: str, value: Any) -> None:
    """One metadata key, typed as llama.cpp reads it (counts as u32, floats as f32)."""
    if isinstance(value, list):
        writer.add_array(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, str(value))


Shape = tuple[int, ...]  # ggml order: ne0 (the row length) first


def _tensors(shape: ModelShape, n_vocab: int) -> Iterator[tuple[str, Shape]]:
    s, q, kv = shape, shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    yield "token_embd.weight", (s.n_embd, n_vocab)
    yield "output_norm.weight", (s.n_embd,)
    if not s.tied:
        yield "output.weight", (s.n_embd, n_vocab)
    for il in range(s.n_layer):
        b = f"blk.{il}"
        yield f"{b}.attn_norm.weight", (s.n_embd,)
        yield f"{b}.attn_q.weight", (s.n_embd, q)
        yield f"{b}.attn_k.weight", (s.n_embd, kv)
        yield f"{b}.attn_v.weight", (s.n_embd, kv)
        if s.qkv_bias:
            yield f"{b}.attn_q.bias", (q,)
            yield f"{b}.attn_k.bias", (kv,)
            yield f"{b}.attn_v.bias", (kv,)
        if s.qk_norm:
            yield f"{b}.attn_q_norm.weight", (s.head_dim,)
            yield f"{b}.attn_k_norm.weight", (s.head_dim,)
        yield f"{b}.attn_output.weight", (q, s.n_embd)
        yield f"{b}.ffn_norm.weight", (s.n_embd,)
        yield f"{b}.ffn_gate.weight", (s.n_embd, s.n_ff)
        yield f"{b}.ffn_down.weight", (s.n_ff, s.n_embd)
        yield f"{b}.ffn_up.weight", (s.n_embd, s.n_ff)


def _write(name: str, shape: ModelShape, quant: str, out: Path) -> None:
    gguf = gguf_module()
    writer = gguf.GGUFWriter(str(out), shape.arch)
    writer.add_string("general.name", f"random-weight {shape.like} shape")
    n_vocab = copy_tokenizer(gguf, writer)
    kv: dict[str, Any] = {
        "block_count": shape.n_layer,
        "context_length": shape.context_length,
        "embedding_length": shape.n_embd,
        "feed_forward_length": shape.n_ff,
        "attention.head_count": shape.n_head,
        "attention.head_count_kv": shape.n_head_kv,
        "attention.key_length": shape.head_dim,
        "attention.value_length": shape.head_dim,
        "rope.dimension_count": shape.head_dim,
        "rope.freq_base": shape.rope_theta,
        "attention.layer_norm_rms_epsilon": shape.rms_eps,
    }
    for k, v in kv.items():
        add_value(writer, f"{shape.arch}.{k}", v)
    qtype = getattr(gguf.GGMLQuantizationType, quant.upper())
    writer.add_uint32("general.file_type", {"q4_0": 2, "q8_0": 7}[quant])  # llama_ftype
    tensors = list(_tensors(shape, n_vocab))
    # Tensor infos first, then the data one tensor at a time: an 8B model is never in memory.
    for tname, dims in tensors:
        if _is_float(tname):
            writer.add_tensor_info(tname, tuple(reversed(dims)), np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            rows, row_bytes = int(np.prod(dims[1:])), dims[0] // _BLOCK * _BLOCK_BYTES[quant]
            writer.add_tensor_info(
                tname, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, raw_dtype=qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(
        int.from_bytes(hashlib.sha256(f"{name}/{quant}".encode()).digest()[:8], "little")
    )
    for tname, dims in tensors:
        writer.write_tensor_data(_data(rng, tname, dims, shape, quant))
    writer.close()


def _is_float(name: str) -> bool:
    return "norm" in name or name.endswith(".bias")


def _data(rng: np.random.Generator, name: str, dims: Shape, shape: ModelShape, quant: str) -> np.ndarray:
    """A tensor's bytes: ones for norms, zeros for biases, random blocks for matrices."""
    if _is_float(name):
        return (np.ones if "norm" in name else np.zeros)(int(np.prod(dims)), dtype=np.float32)
    fan_in = dims[0]
    if name == "token_embd.weight":
        # Tied: the output's logits are the embedding rows times a unit-RMS state.
        std = _LOGIT_STD / np.sqrt(fan_in) if shape.tied else 1.0
    elif name == "output.weight":
        std = _LOGIT_STD / np.sqrt(fan_in)
    else:
        std = 1.0 / np.sqrt(fan_in)
    n_blocks = int(np.prod(dims)) // _BLOCK
    blocks = (
        np.frombuffer(rng.bytes(n_blocks * _BLOCK_BYTES[quant]), dtype=np.uint8).reshape(n_blocks, -1).copy()
    )
    quants = blocks[:, 2:]
    if quant == "q4_0":  # nibble 0 is -8: make it 8 (0)
        lo, hi = quants & 0x0F, quants >> 4
        lo[lo == 0], hi[hi == 0] = 8, 8
        quants[:] = lo | (hi << 4)
    else:  # byte 0x80 is -128: make it 0
        quants[quants == 0x80] = 0
    scale = np.float16(std / _QUANT_STD[quant])
    blocks[:, :2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    return blocks.reshape(-1)
