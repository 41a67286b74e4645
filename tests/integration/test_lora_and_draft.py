"""Per-request LoRA adapters and a draft model (speculative decoding) behind the proxy, on a tiny
random-weight model and adapters made here (tests/tinymodels.py), against stock llama-server of
the same commit computing from scratch, with f16 and q8_0 KV.

- LoRA: the adapter scales are part of the cache key. A conversation under one adapter is restored
  (route H) only for requests under the same scales, and the server computes only the new tokens
  (the restore named the adapters, so the server kept the KV instead of clearing it as an adapter
  change); a request without adapters, or with another one, never reuses that KV. Every answer
  equals stock's from scratch under the same adapters, and the adapters change the answers (so
  reusing the wrong KV would show).
- Draft model: with ``--model-draft`` moves are on; after a host restore the draft model's KV of
  the restored prefix is recomputed, so drafts are accepted as often as on stock (the draft is the
  target model itself: with its KV right it drafts what the target says). Answers equal stock's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.native.launch import ServerProcess
from tests.helpers import (
    ProxyThread,
    Reply,
    ServerFactory,
    assert_same_answer,
    chat_body,
    post,
    proxy_config,
)
from tests.integration.test_architectures import KV_CONFIGS, _fallbacks
from tests.integration.test_proxy import convo, document
from tests.tinymodels import tiny_lora, tiny_model

FAMILY = "llama-h128"
KVS = ("f16", "q8_0-fa")
LORA0 = [{"id": 0, "scale": 1.0}]
LORA1 = [{"id": 1, "scale": 1.0}]


def _ask(proxy: ProxyThread, messages: list[dict[str, str]], **extra: Any) -> Reply:
    reply = post(f"{proxy.url}/v1/chat/completions", chat_body(messages, 16, **extra))
    assert reply.status == 200, reply.body
    proxy.settle()
    return reply


def _from_scratch(stock: ServerProcess, messages: list[dict[str, str]], **extra: Any) -> Reply:
    reply = post(f"{stock.url}/v1/chat/completions", chat_body(messages, 16, cache_prompt=False, **extra))
    assert reply.status == 200, reply.body
    return reply


def _text(reply: Reply) -> str:
    return str(reply.body["choices"][0]["message"]["content"])


def _computed(reply: Reply) -> int:
    """Prompt tokens the server computed for the answer (the rest it reused)."""
    return int(reply.body["timings"]["prompt_n"])


@pytest.fixture(scope="module", params=KVS)
def lora_servers(
    request: pytest.FixtureRequest, start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> Iterator[tuple[ProxyThread, ServerProcess]]:
    # Two adapters, loaded at scale 0: a request without "lora" runs the base model.
    args = (
        *KV_CONFIGS[request.param],
        "--lora",
        str(tiny_lora(FAMILY, seed=1)),
        "--lora",
        str(tiny_lora(FAMILY, seed=2)),
        "--lora-init-without-apply",
    )
    model = tiny_model(FAMILY)
    patched = start_server(patched_bin, model=model, ctx_size=4096, threads=1, extra_args=args)
    stock = start_server(stock_bin, model=model, ctx_size=4096, threads=1, kvctl=False, extra_args=args)
    proxy = ProxyThread(proxy_config(patched)).start()
    yield proxy, stock
    proxy.stop()
    patched.stop()
    stock.stop()


def test_lora_scales_are_part_of_the_cache_key(lora_servers: tuple[ProxyThread, ServerProcess]) -> None:
    proxy, stock = lora_servers
    messages = convo(document(11, 120), "What is the first word?")
    base_ref = _from_scratch(stock, messages)
    lora_ref = _from_scratch(stock, messages, lora=LORA0)
    # The adapter changes the answer: KV reused across adapter sets would show.
    assert _text(base_ref) != _text(lora_ref)

    first = _ask(proxy, messages, lora=LORA0)
    assert first.headers["X-Radix-Route"] == "prefill"
    assert_same_answer(first, lora_ref)

    # The next turn under the same adapter: a host restore, and the server computes only the new
    # tokens (it kept the restored KV: the restore named the adapter).
    messages += [
        {"role": "assistant", "content": _text(first)},
        {"role": "user", "content": "And the last word?"},
    ]
    second = _ask(proxy, messages, lora=LORA0)
    assert second.headers["X-Radix-Route"] == "H", second.headers
    cached = int(second.headers["X-Radix-Cached-Tokens"])
    assert cached > 100
    assert _computed(second) <= len_of(second) - cached + 1
    assert_same_answer(second, _from_scratch(stock, messages, lora=LORA0))

    # The same prompt without adapters, and under the other adapter: none of that KV is reused.
    plain = _ask(proxy, messages)
    assert plain.headers["X-Radix-Route"] == "prefill", plain.headers
    assert_same_answer(plain, _from_scratch(stock, messages))
    other = _ask(proxy, messages, lora=LORA1)
    assert other.headers["X-Radix-Route"] == "prefill", other.headers
    assert_same_answer(other, _from_scratch(stock, messages, lora=LORA1))
    # Scales that equal the server's own (0 for both) are the base model's: its KV is reused.
    zero = _ask(proxy, messages, lora=[{"id": 0, "scale": 0.0}])
    assert zero.headers["X-Radix-Route"] == "H", zero.headers
    assert_same_answer(zero, _from_scratch(stock, messages))

    # And the adapter's own KV is still there for it.
    again = _ask(proxy, messages, lora=LORA0)
    assert again.headers["X-Radix-Route"] == "H", again.headers
    assert_same_answer(again, _from_scratch(stock, messages, lora=LORA0))
    assert _fallbacks(proxy) == 0


def len_of(reply: Reply) -> int:
    return int(reply.body["usage"]["prompt_tokens"])


@pytest.mark.parametrize(
    "lora",
    [
        "x",
        [{"id": 2, "scale": 1.0}],
        [{"id": -1, "scale": 1.0}],
        [{"id": 0, "scale": "big"}],
        [{"id": True, "scale": 1.0}],
        [7],
    ],
    ids=["not-a-list", "unknown-id", "negative-id", "scale-not-a-number", "id-bool", "entry-not-object"],
)
def test_a_bad_lora_field_is_a_400(lora_servers: tuple[ProxyThread, ServerProcess], lora: Any) -> None:
    proxy, _ = lora_servers
    reply = post(
        f"{proxy.url}/v1/chat/completions", chat_body([{"role": "user", "content": "hi"}], 4, lora=lora)
    )
    assert reply.status == 400, reply.body
    assert "lora" in reply.body["error"]["message"], reply.body


@pytest.mark.parametrize("kv", KVS)
def test_a_draft_model_is_served_with_moves(
    kv: str, start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> None:
    model = tiny_model(FAMILY)
    args = (*KV_CONFIGS[kv], "--model-draft", str(model), "--spec-draft-n-max", "4")
    patched = start_server(patched_bin, model=model, ctx_size=4096, threads=1, extra_args=args)
    stock = start_server(stock_bin, model=model, ctx_size=4096, threads=1, kvctl=False, extra_args=args)
    proxy = ProxyThread(proxy_config(patched)).start()
    try:
        assert proxy.call(lambda rt: rt.coordinator.servers[0].moves) is True
        messages = convo(document(13, 120), "What is the first word?")
        first = _ask(proxy, messages)
        assert_same_answer(first, _from_scratch(stock, messages))
        messages += [
            {"role": "assistant", "content": _text(first)},
            {"role": "user", "content": "And the last word?"},
        ]
        second = _ask(proxy, messages)
        assert second.headers["X-Radix-Route"] == "H", second.headers
        ref = _from_scratch(stock, messages)
        assert_same_answer(second, ref)
        # The draft is the target itself: with the restored prefix in its KV it drafts what the
        # target says, as on stock; without it (the draft's KV of the slot empty or stale) most
        # drafts would be rejected.
        timings = second.body["timings"]
        assert timings["draft_n"] > 0, timings
        rate = timings["draft_n_accepted"] / timings["draft_n"]
        ref_rate = ref.body["timings"]["draft_n_accepted"] / max(1, ref.body["timings"]["draft_n"])
        assert rate >= 0.8 * ref_rate and rate > 0.5, (timings, ref.body["timings"])
        assert _fallbacks(proxy) == 0
    finally:
        proxy.stop()
        patched.stop()
        stock.stop()
