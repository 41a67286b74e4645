"""Tiny random-weight GGUF models of other architectures, made here (no weights are downloaded).

Each model is written with the `gguf` writer of the pinned llama.cpp source and carries the
default model's tokenizer metadata (vocab, merges, chat template; copied by proxy/native/shapes.py,
which also writes the realistic shapes), so prompts tokenize and
render for real and the proxy's tokenizer and template checks pass as with SmolLM2. The
weights are seeded normal noise, scaled so greedy answers are not made of near-ties (the top
two log-probabilities part by more than the near-tie rule's tolerance on most tokens; checked
by the tests that use them). A model is a few MB and is cached by the content of its spec
and of this file, like the native builds.

    path = tiny_model("qwen2vl")      # M-RoPE (Qwen2-VL's text path)

`extra_kv` keys are written after the common ones and replace any of the same name (MLA's key and
value lengths, a per-layer KV head count).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from proxy.native import shapes
from proxy.native.fetch import cache_root, file_lock, staging_dir
from proxy.native.shapes import add_value, copy_tokenizer, gguf_module

Shape = tuple[int, ...]
_LOGIT_STD = 16.0


@dataclass(frozen=True)
class Family:
    """One architecture: its GGUF arch name, hyper-parameters and tensors (name -> shape in
    ggml order: ne0 first). `norm_names` are tensors filled with ones (RMS norm weights)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    extra_kv: dict[str, Any] = field(default_factory=dict)
    tensors: Callable[[Family, int], dict[str, Shape]] | None = None
    scale: float = 1.0  # layer weights' std times sqrt(fan-in)
    tied: bool = False  # the output reuses the token embedding (no output.weight tensor)
    output_norm: str = "output_norm"  # lfm2 names its final norm token_embd_norm
    classifier: bool = False  # a two-label classification head (cls.output): a reranker

    def spec(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "tensors"} | {
            "tensors": self.tensors.__name__ if self.tensors else None
        }


def _attn(f: Family, il: int) -> dict[str, Shape]:
    q, kv = f.n_head * f.head_dim, f.n_head_kv * f.head_dim
    return {
        f"blk.{il}.attn_norm.weight": (f.n_embd,),
        f"blk.{il}.attn_q.weight": (f.n_embd, q),
        f"blk.{il}.attn_k.weight": (f.n_embd, kv),
        f"blk.{il}.attn_v.weight": (f.n_embd, kv),
        f"blk.{il}.attn_output.weight": (q, f.n_embd),
    }


def _ffn(f: Family, il: int) -> dict[str, Shape]:
    return {
        f"blk.{il}.ffn_norm.weight": (f.n_embd,),
        f"blk.{il}.ffn_gate.weight": (f.n_embd, f.n_ff),
        f"blk.{il}.ffn_down.weight": (f.n_ff, f.n_embd),
        f"blk.{il}.ffn_up.weight": (f.n_embd, f.n_ff),
    }


def dense_layer(f: Family, il: int) -> dict[str, Shape]:
    """llama / qwen2vl: RMS norm, attention without biases, SwiGLU."""
    return _attn(f, il) | _ffn(f, il)


def qk_norm_layer(f: Family, il: int) -> dict[str, Shape]:
    """qwen3: dense plus per-head q/k norms."""
    return dense_layer(f, il) | {
        f"blk.{il}.attn_q_norm.weight": (f.head_dim,),
        f"blk.{il}.attn_k_norm.weight": (f.head_dim,),
    }


def gemma2_layer(f: Family, il: int) -> dict[str, Shape]:
    """gemma2: dense plus norms after attention and after the FFN."""
    return dense_layer(f, il) | {
        f"blk.{il}.post_attention_norm.weight": (f.n_embd,),
        f"blk.{il}.post_ffw_norm.weight": (f.n_embd,),
    }


_SSM = {"d_conv": 4, "d_inner": 128, "d_state": 16, "n_group": 1, "dt_rank": 4}


def mamba2_layer(f: Family, il: int) -> dict[str, Shape]:
    """mamba2: a selective state-space block per layer, no attention (recurrent memory)."""
    d_inner, conv = _SSM["d_inner"], _SSM["d_inner"] + 2 * _SSM["n_group"] * _SSM["d_state"]
    rank = _SSM["dt_rank"]
    return {
        f"blk.{il}.attn_norm.weight": (f.n_embd,),
        f"blk.{il}.ssm_in.weight": (f.n_embd, d_inner + conv + rank),
        f"blk.{il}.ssm_conv1d.weight": (_SSM["d_conv"], conv),
        f"blk.{il}.ssm_conv1d.bias": (conv,),
        f"blk.{il}.ssm_dt.bias": (rank,),
        f"blk.{il}.ssm_a": (1, rank),
        f"blk.{il}.ssm_d": (1, rank),
        f"blk.{il}.ssm_norm.weight": (d_inner // _SSM["n_group"], _SSM["n_group"]),
        f"blk.{il}.ssm_out.weight": (d_inner, f.n_embd),
    }


_MOE = {"n_expert": 8, "n_expert_used": 2, "n_ff_exp": 64}


def _moe(f: Family, il: int, n_expert: int, n_ff_exp: int) -> dict[str, Shape]:
    return {
        f"blk.{il}.ffn_norm.weight": (f.n_embd,),
        f"blk.{il}.ffn_gate_inp.weight": (f.n_embd, n_expert),
        f"blk.{il}.ffn_gate_exps.weight": (f.n_embd, n_ff_exp, n_expert),
        f"blk.{il}.ffn_down_exps.weight": (n_ff_exp, f.n_embd, n_expert),
        f"blk.{il}.ffn_up_exps.weight": (f.n_embd, n_ff_exp, n_expert),
    }


def qwen3moe_layer(f: Family, il: int) -> dict[str, Shape]:
    """qwen3moe: qwen3's attention (q/k norms), a routed mixture of experts for the FFN."""
    return (
        _attn(f, il)
        | {
            f"blk.{il}.attn_q_norm.weight": (f.head_dim,),
            f"blk.{il}.attn_k_norm.weight": (f.head_dim,),
        }
        | _moe(f, il, _MOE["n_expert"], _MOE["n_ff_exp"])
    )


def gemma3_layer(f: Family, il: int) -> dict[str, Shape]:
    """gemma3: gemma2's layer plus per-head q/k norms."""
    return gemma2_layer(f, il) | {
        f"blk.{il}.attn_q_norm.weight": (f.head_dim,),
        f"blk.{il}.attn_k_norm.weight": (f.head_dim,),
    }


# Multi-head latent attention without a q low-rank (q_lora_rank 0: one q projection): the cache
# holds one compressed K row per token (kv_lora_rank + rope dims), V is a view of it.
_MLA = {"kv_lora_rank": 32, "rope": 16, "nope": 32, "v_head": 32, "n_dense": 1}
_MLA_MOE = {"n_expert": 4, "n_expert_used": 2, "n_ff_exp": 32, "n_shared": 1}


def deepseek2_layer(f: Family, il: int) -> dict[str, Shape]:
    """deepseek2: MLA attention; a dense FFN on the leading layer, experts plus a shared expert
    after."""
    rank, rope, k_head = _MLA["kv_lora_rank"], _MLA["rope"], _MLA["nope"] + _MLA["rope"]
    layer = {
        f"blk.{il}.attn_norm.weight": (f.n_embd,),
        f"blk.{il}.attn_kv_a_norm.weight": (rank,),
        f"blk.{il}.attn_q.weight": (f.n_embd, f.n_head * k_head),
        f"blk.{il}.attn_kv_a_mqa.weight": (f.n_embd, rank + rope),
        f"blk.{il}.attn_k_b.weight": (_MLA["nope"], rank, f.n_head),
        f"blk.{il}.attn_v_b.weight": (rank, _MLA["v_head"], f.n_head),
        f"blk.{il}.attn_output.weight": (f.n_head * _MLA["v_head"], f.n_embd),
    }
    if il < _MLA["n_dense"]:
        return layer | _ffn(f, il)
    shared = _MLA_MOE["n_ff_exp"] * _MLA_MOE["n_shared"]
    return (
        layer
        | _moe(f, il, _MLA_MOE["n_expert"], _MLA_MOE["n_ff_exp"])
        | {
            f"blk.{il}.ffn_gate_shexp.weight": (f.n_embd, shared),
            f"blk.{il}.ffn_down_shexp.weight": (shared, f.n_embd),
            f"blk.{il}.ffn_up_shexp.weight": (f.n_embd, shared),
        }
    )


# lfm2: which layers are attention is read from the per-layer KV head count (0: a short
# convolution layer, recurrent memory).
_LFM2_L_CACHE = 3
_LFM2_HEAD_COUNT_KV = [0, 1]


def lfm2_layer(f: Family, il: int) -> dict[str, Shape]:
    """lfm2: a gated short convolution or attention (q/k norms, q of width n_embd), SwiGLU."""
    if _LFM2_HEAD_COUNT_KV[il]:
        layer = _attn(f, il) | {
            f"blk.{il}.attn_q_norm.weight": (f.head_dim,),
            f"blk.{il}.attn_k_norm.weight": (f.head_dim,),
        }
    else:
        layer = {
            f"blk.{il}.attn_norm.weight": (f.n_embd,),
            f"blk.{il}.shortconv.conv.weight": (_LFM2_L_CACHE, f.n_embd),
            f"blk.{il}.shortconv.in_proj.weight": (f.n_embd, 3 * f.n_embd),
            f"blk.{il}.shortconv.out_proj.weight": (f.n_embd, f.n_embd),
        }
    return layer | _ffn(f, il)


FAMILIES: dict[str, Family] = {
    # GQA at head dim 80 (2 query heads, 1 KV head) and 128.
    "llama-h80": Family("llama", 2, 64, 2, 1, 80, 192, tensors=dense_layer),
    "llama-h128": Family("llama", 2, 64, 2, 1, 128, 192, tensors=dense_layer),
    "qwen3": Family("qwen3", 2, 64, 2, 1, 64, 192, tensors=qk_norm_layer),
    # M-RoPE: several position axes per token, 12 more bytes of metadata per KV cell.
    "qwen2vl": Family(
        "qwen2vl",
        2,
        128,
        2,
        1,
        64,
        192,
        extra_kv={"rope.dimension_sections": [16, 8, 8, 0]},
        tensors=dense_layer,
    ),
    # Sliding window on every other layer (a window of 32 tokens: the suite's prompts pass it).
    "gemma2": Family(
        "gemma2",
        2,
        64,
        2,
        1,
        64,
        192,
        extra_kv={"attention.sliding_window": 32},
        tensors=gemma2_layer,
        scale=3.0,
        tied=True,
    ),
    # Recurrent memory: no KV cache at all, a state per sequence.
    "mamba2": Family(
        "mamba2",
        2,
        64,
        0,
        0,
        0,
        0,
        extra_kv={
            "ssm.conv_kernel": _SSM["d_conv"],
            "ssm.inner_size": _SSM["d_inner"],
            "ssm.state_size": _SSM["d_state"],
            "ssm.time_step_rank": _SSM["dt_rank"],
            "ssm.group_count": _SSM["n_group"],
        },
        tensors=mamba2_layer,
    ),
    # Mixture of experts: 8 experts, 2 routed per token, after qwen3's attention.
    "qwen3moe": Family(
        "qwen3moe",
        2,
        64,
        2,
        1,
        64,
        192,
        extra_kv={
            "expert_count": _MOE["n_expert"],
            "expert_used_count": _MOE["n_expert_used"],
            "expert_feed_forward_length": _MOE["n_ff_exp"],
        },
        tensors=qwen3moe_layer,
    ),
    # Multi-head latent attention (MQA over a compressed K, no V of its own), then experts.
    "deepseek2": Family(
        "deepseek2",
        2,
        64,
        2,
        1,
        _MLA["kv_lora_rank"] + _MLA["rope"],
        128,
        extra_kv={
            "attention.q_lora_rank": 0,
            "attention.kv_lora_rank": _MLA["kv_lora_rank"],
            "attention.value_length": _MLA["kv_lora_rank"],
            "attention.key_length_mla": _MLA["nope"] + _MLA["rope"],
            "attention.value_length_mla": _MLA["v_head"],
            "rope.dimension_count": _MLA["rope"],
            "leading_dense_block_count": _MLA["n_dense"],
            "expert_count": _MLA_MOE["n_expert"],
            "expert_used_count": _MLA_MOE["n_expert_used"],
            "expert_feed_forward_length": _MLA_MOE["n_ff_exp"],
            "expert_shared_count": _MLA_MOE["n_shared"],
        },
        tensors=deepseek2_layer,
    ),
    # Sliding window on layer 0, full attention on layer 1 (pattern 2).
    "gemma3": Family(
        "gemma3",
        2,
        64,
        2,
        1,
        64,
        192,
        extra_kv={"attention.sliding_window": 32, "attention.sliding_window_pattern": 2},
        tensors=gemma3_layer,
        scale=3.0,
    ),
    # Hybrid: a short convolution layer (recurrent state) and an attention layer (KV cache).
    "lfm2": Family(
        "lfm2",
        2,
        64,
        2,
        1,
        32,
        192,
        extra_kv={"shortconv.l_cache": _LFM2_L_CACHE, "attention.head_count_kv": _LFM2_HEAD_COUNT_KV},
        tensors=lfm2_layer,
        output_norm="token_embd_norm",
    ),
    # A reranker (--reranking): qwen3 with a yes/no head on the last token; the server's score
    # is the softmax of "yes" (one label would always score 1).
    "qwen3-rerank": Family(
        "qwen3",
        2,
        64,
        2,
        1,
        64,
        192,
        extra_kv={"classifier.output_labels": ["yes", "no"]},
        tensors=qk_norm_layer,
        classifier=True,
    ),
    # Mistral 3's text model: llama's layer under its own arch name.
    "mistral3": Family("mistral3", 2, 64, 2, 1, 64, 192, tensors=dense_layer),
}


# gemma3 with a window of 200: more than half the smallest slot the server makes (its context is
# padded to 256 cells), too wide for the startup probe to cut in such a slot.
FAMILIES["gemma3-w200"] = replace(
    FAMILIES["gemma3"], extra_kv={"attention.sliding_window": 200, "attention.sliding_window_pattern": 2}
)


def tiny_model(name: str) -> Path:
    """The GGUF of family `name`, written once into the cache (keyed by its content)."""
    fam = FAMILIES[name]
    key = hashlib.sha256(
        json.dumps(fam.spec(), sort_keys=True).encode()
        + Path(__file__).read_bytes()
        + Path(shapes.__file__).read_bytes()
    ).hexdigest()[:12]
    final = cache_root() / "tiny-models" / f"{name}-{key}.gguf"
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock"):
        if not final.exists():
            with staging_dir(final) as tmp:
                _write(fam, tmp / final.name)
                os.replace(tmp / final.name, final)
    return final


def _write(fam: Family, out: Path) -> None:
    gguf = gguf_module()
    writer = gguf.GGUFWriter(str(out), fam.arch)
    vocab = copy_tokenizer(gguf, writer)
    a = fam.arch
    kv: dict[str, Any] = {"block_count": fam.n_layer, "context_length": 8192, "embedding_length": fam.n_embd}
    if fam.n_head:  # attention (a pure state-space model has none)
        kv |= {
            "feed_forward_length": fam.n_ff,
            "attention.head_count": fam.n_head,
            "attention.head_count_kv": fam.n_head_kv,
            "attention.key_length": fam.head_dim,
            "attention.value_length": fam.head_dim,
            "rope.dimension_count": fam.head_dim,
            "rope.freq_base": 10000.0,
        }
    kv["attention.layer_norm_rms_epsilon"] = 1e-5
    for k, v in (kv | fam.extra_kv).items():
        add_value(writer, f"{a}.{k}", v)
    writer.add_uint32("general.file_type", 1)  # mostly F16
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(a.encode()).digest()[:4], "little"))
    for name, shape in _tensors(fam, vocab):
        writer.add_tensor(name, _weights(rng, name, shape, fam))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tensors(fam: Family, n_vocab: int) -> Iterator[tuple[str, Shape]]:
    yield "token_embd.weight", (fam.n_embd, n_vocab)
    yield f"{fam.output_norm}.weight", (fam.n_embd,)
    if not fam.tied:
        yield "output.weight", (fam.n_embd, n_vocab)
    if fam.classifier:
        yield "cls.output.weight", (fam.n_embd, 2)
    assert fam.tensors is not None
    for il in range(fam.n_layer):
        yield from fam.tensors(fam, il).items()


def _weights(rng: np.random.Generator, name: str, shape: Shape, fam: Family) -> np.ndarray:
    """Norm weights are ones; matrices normal with std scale/sqrt(fan-in); the output's logits
    spread over about 16 nats, so the top two part by more than the near-tie tolerance on most
    tokens, and depend on the context (an untied output: a tied one mostly repeats the last
    token). numpy's shape is ggml's reversed."""
    np_shape = tuple(reversed(shape))
    if "norm" in name:
        return np.ones(np_shape, dtype=np.float32)
    if (
        name.endswith((".ssm_a", ".ssm_d", ".shortconv.conv.weight"))
        or ".ssm_conv1d" in name
        or name.endswith(".bias")
    ):
        # State-space and convolution parameters stay f32 (ggml's scan and conv read them so);
        # A < 0 keeps the recurrence stable.
        vals = rng.standard_normal(np_shape, dtype=np.float32) * 0.5
        return -np.abs(vals) - 0.5 if name.endswith(".ssm_a") else vals
    if name == "token_embd.weight":
        std = 1.0 if not fam.tied else 4.0 / np.sqrt(shape[0])
    elif name == "output.weight":
        std = _LOGIT_STD / np.sqrt(shape[0])
    else:
        std = fam.scale / np.sqrt(shape[0])
    return (rng.standard_normal(np_shape, dtype=np.float32) * std).astype(np.float16)


# The layer matrices a tiny LoRA adapter changes: the attention's (so the KV itself differs under
# the adapter) and the FFN's output.
_LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_down")


def tiny_lora(name: str, seed: int = 1, rank: int = 4, alora_tokens: tuple[int, ...] = ()) -> Path:
    """A random LoRA adapter (GGUF, f32) for the tiny model `name`, written once into the cache:
    `lora_a` and `lora_b` of rank `rank` on each layer's attention and FFN output, strong enough
    that greedy answers under the adapter differ from the base model's. With `alora_tokens`, an
    aLoRA adapter: it applies from where those tokens (its invocation sequence) start."""
    fam = FAMILIES[name]
    spec = {"family": fam.spec(), "seed": seed, "rank": rank, "alora": list(alora_tokens)}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode() + Path(__file__).read_bytes()).hexdigest()[
        :12
    ]
    final = cache_root() / "tiny-models" / f"{name}-lora{seed}-{key}.gguf"
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock"):
        if not final.exists():
            with staging_dir(final) as tmp:
                _write_lora(fam, tmp / final.name, seed, rank, alora_tokens)
                os.replace(tmp / final.name, final)
    return final


def _write_lora(fam: Family, out: Path, seed: int, rank: int, alora_tokens: tuple[int, ...]) -> None:
    gguf = gguf_module()
    writer = gguf.GGUFWriter(str(out), fam.arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))  # scale = alpha / rank = 1 at scale 1
    if alora_tokens:
        writer.add_key_value(
            "adapter.alora.invocation_tokens",
            list(alora_tokens),
            gguf.GGUFValueType.ARRAY,
            sub_type=gguf.GGUFValueType.UINT32,
        )
    rng = np.random.default_rng(seed)
    assert fam.tensors is not None
    for il in range(fam.n_layer):
        for tname, shape in fam.tensors(fam, il).items():
            if tname.split(".")[2] not in _LORA_TARGETS:
                continue
            n_in, n_out = shape
            # ggml shapes: W is (n_in, n_out); lora_a (n_in, rank), lora_b (rank, n_out). numpy's
            # are reversed. B @ A is about 8x the weights' own scale (std 1/sqrt(n_in)): the token
            # embeddings dominate the residual stream of these tiny models, and a weaker adapter
            # left most greedy answers unchanged at scale 1.
            # (f32: numpy's float64 scalars would make them F64, which ggml's CPU matmul cannot run:
            # llama.cpp loads such an adapter and crashes on the first decode, stock too)
            a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
            b = (rng.standard_normal((n_out, rank)) * (8.0 / np.sqrt(rank))).astype(np.float32)
            base = tname.removesuffix(".weight")
            writer.add_tensor(f"{base}.weight.lora_a", a)
            writer.add_tensor(f"{base}.weight.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
