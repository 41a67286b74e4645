"""Random-weight models of real shapes (proxy/native/shapes.py): the shapes are the real models'
hyper-parameters, a written file has the tensors, types and weight scale it claims (read back with
the pinned gguf-py), and shape references parse or fail with a fix."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from proxy.errors import ConfigError
from proxy.native import shapes
from proxy.native.modelref import resolve_model

pytestmark = pytest.mark.unit

# The published configs' figures: layers, width, query heads, KV heads, head dim, FFN width.
REAL = {
    "llama-3.2-1b": (16, 2048, 32, 8, 64, 8192),
    "llama-3.2-3b": (28, 3072, 24, 8, 128, 8192),
    "qwen3-4b": (36, 2560, 32, 8, 128, 9728),
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336),
    "qwen2.5-32b": (64, 5120, 40, 8, 128, 27648),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_shapes_are_the_real_models(name: str) -> None:
    s = shapes.SHAPES[name]
    assert (s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.head_dim, s.n_ff) == REAL[name]


def test_kv_and_weight_sizes() -> None:
    # The figure: 4k tokens of the 8B shape's f16 KV are 512 MiB.
    assert 4096 * shapes.SHAPES["llama-3.1-8b"].kv_bytes_per_token() == 512 << 20
    assert shapes.SHAPES["llama-3.2-1b"].kv_bytes_per_token() == 32 << 10
    # Parameter counts with the real vocabularies are the models' published sizes.
    assert shapes.SHAPES["llama-3.2-1b"].weights(128256) == pytest.approx(1.24e9, rel=0.01)
    assert shapes.SHAPES["llama-3.1-8b"].weights(128256) == pytest.approx(8.03e9, rel=0.01)
    assert shapes.SHAPES["qwen3-4b"].weights(151936) == pytest.approx(4.02e9, rel=0.01)


@pytest.mark.parametrize(
    ("ref", "want"),
    [
        ("shape:llama-3.2-1b", ("llama-3.2-1b", "q4_0")),
        ("llama-3.1-8b:q8_0", ("llama-3.1-8b", "q8_0")),
        ("shape:qwen3-4b:q4_0", ("qwen3-4b", "q4_0")),
    ],
)
def test_shape_refs_parse(ref: str, want: tuple[str, str]) -> None:
    assert shapes.parse_shape_ref(ref) == want


@pytest.mark.parametrize(
    ("ref", "word"), [("shape:llama-70b", "unknown model shape"), ("shape:qwen3-4b:f16", "weight type")]
)
def test_bad_shape_refs_say_what_exists(ref: str, word: str) -> None:
    with pytest.raises(ConfigError, match=word) as err:
        shapes.parse_shape_ref(ref)
    assert err.value.fix
    with pytest.raises(ConfigError, match=word):
        resolve_model(ref)


@pytest.mark.parametrize("quant", shapes.QUANTS)
def test_written_model_reads_back_as_its_shape(tmp_path: Path, quant: str) -> None:
    # A narrow shape of the 1B's kind (every tensor kind, biases and q/k norms too), written by
    # the same code as the real ones and read back with the server's gguf-py.
    small = replace(
        shapes.SHAPES["qwen2.5-32b"], n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512
    )
    small = replace(small, qk_norm=True)
    out = tmp_path / "m.gguf"
    shapes._write("small", small, quant, out)
    gguf = shapes.gguf_module()
    reader = gguf.GGUFReader(str(out))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert fields["general.architecture"] == "qwen2"
    assert fields["qwen2.block_count"] == 2 and fields["qwen2.attention.head_count_kv"] == 2
    assert fields["qwen2.rope.freq_base"] == pytest.approx(1e6)
    tensors = {t.name: t for t in reader.tensors}
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    assert set(tensors) == {name for name, _ in shapes._tensors(small, n_vocab)}
    qtype = getattr(gguf.GGMLQuantizationType, quant.upper())
    for name, dims in shapes._tensors(small, n_vocab):
        t = tensors[name]
        assert tuple(int(d) for d in t.shape) == dims, name
        if shapes._is_float(name):
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            assert np.all(t.data == (1.0 if "norm" in name else 0.0)), name
            continue
        assert t.tensor_type == qtype, name
        weights = gguf.quants.dequantize(t.data, qtype).astype(np.float64)
        # Layers: 1/sqrt(fan-in); an untied embedding 1; the output's logits about 8 nats.
        want = {"token_embd.weight": 1.0, "output.weight": 8.0 / np.sqrt(dims[0])}.get(
            name, 1.0 / np.sqrt(dims[0])
        )
        assert weights.std() == pytest.approx(want, rel=0.05), name
        assert abs(weights.mean()) < 0.1 * want, name
