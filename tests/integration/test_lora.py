"""Per-request LoRA adapters behind the proxy with moves on (patch 0023), on a tiny random-weight
model and two random adapters made here (tests/tinymodels.py), against stock llama-server of the
same commit with the same adapters computing from scratch, with f16 and q8_0 KV.

The effective adapter scales are part of the cache key (proxy/core/adapters.py). A conversation
under one adapter is restored (route H) only for requests under the same scales, and the server
computes only the new tokens: the import named the adapters, so the slot took them and kept the
KV instead of clearing it as an adapter change. A request without adapters, or under the other
one, never reuses that KV. Every answer equals stock's from scratch under the same adapters, and
the adapters change the answers, so reusing KV of the wrong set would show.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.errors import ConfigError
from proxy.native.launch import ServerProcess
from tests.helpers import ProxyThread, Reply, ServerFactory, assert_same_answer, chat_body, post, proxy_config
from tests.integration.test_architectures import KV_CONFIGS, _fallbacks
from tests.integration.test_proxy import convo, document
from tests.tinymodels import tiny_lora, tiny_model

pytestmark = pytest.mark.integration

FAMILY = "llama-h128"
LORA0 = [{"id": 0, "scale": 1.0}]
LORA1 = [{"id": 1, "scale": 1.0}]
OWN = [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}]  # the server's own scales


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


def _route(reply: Reply) -> str:
    return str(reply.headers["X-Radix-Route"])


@pytest.fixture(scope="module", params=("f16", "q8_0-fa"))
def lora_servers(
    request: pytest.FixtureRequest, start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> Iterator[tuple[ProxyThread, ServerProcess]]:
    # Two adapters at the server's own scale 1: a request without "lora" runs under both. (With
    # --lora-init-without-apply the pinned server still applies them at 1 to such a request,
    # though its README says 0; the proxy reads the scales from the compatibility key.)
    args = (
        *KV_CONFIGS[request.param],
        "--lora",
        str(tiny_lora(FAMILY, seed=1)),
        "--lora",
        str(tiny_lora(FAMILY, seed=2)),
    )
    model = tiny_model(FAMILY)
    patched = start_server(patched_bin, model=model, ctx_size=4096, threads=1, extra_args=args)
    stock = start_server(stock_bin, model=model, ctx_size=4096, threads=1, kvctl=False, extra_args=args)
    proxy = ProxyThread(proxy_config(patched)).start()
    assert proxy.call(lambda rt: rt.coordinator.servers[0].moves) is True
    yield proxy, stock
    proxy.stop()
    patched.stop()
    stock.stop()


def test_kv_under_an_adapter_is_reused_only_under_the_same_scales(
    lora_servers: tuple[ProxyThread, ServerProcess],
) -> None:
    proxy, stock = lora_servers
    messages = convo(document(11, 120), "What is the first word?")
    # The adapters change the answer: KV reused across adapter sets would show.
    refs = {
        "own": _text(_from_scratch(stock, messages)),
        "lora0": _text(_from_scratch(stock, messages, lora=LORA0)),
        "lora1": _text(_from_scratch(stock, messages, lora=LORA1)),
    }
    assert len(set(refs.values())) == 3, refs

    first = _ask(proxy, messages, lora=LORA0)
    assert _route(first) == "prefill"
    assert_same_answer(first, _from_scratch(stock, messages, lora=LORA0))

    # The next turn under the same adapter: a host restore, and the server computes only the new
    # tokens (it kept the restored KV: the import named the adapter).
    messages += [
        {"role": "assistant", "content": _text(first)},
        {"role": "user", "content": "And the last word?"},
    ]
    second = _ask(proxy, messages, lora=LORA0)
    assert _route(second) == "H", second.headers
    cached = int(second.headers["X-Radix-Cached-Tokens"])
    assert cached > 100
    assert second.body["timings"]["cache_n"] >= cached, second.body["timings"]
    assert_same_answer(second, _from_scratch(stock, messages, lora=LORA0))

    # The same prompt without adapters, and under the other adapter: none of that KV is reused.
    plain = _ask(proxy, messages)
    assert _route(plain) == "prefill", plain.headers
    assert plain.body["timings"]["cache_n"] == 0, plain.body["timings"]
    assert_same_answer(plain, _from_scratch(stock, messages))
    other = _ask(proxy, messages, lora=LORA1)
    assert _route(other) == "prefill", other.headers
    assert other.body["timings"]["cache_n"] == 0, other.body["timings"]
    assert_same_answer(other, _from_scratch(stock, messages, lora=LORA1))

    # Scales equal to the server's own (1 for both) are a request's without "lora": its KV is reused.
    own = _ask(proxy, messages, lora=OWN)
    assert _route(own) in ("A", "H"), own.headers
    assert int(own.headers["X-Radix-Cached-Tokens"]) > 100
    assert_same_answer(own, _from_scratch(stock, messages))

    # And the adapter's own KV is still there for it.
    again = _ask(proxy, messages, lora=LORA0)
    assert _route(again) in ("A", "H"), again.headers
    assert int(again.headers["X-Radix-Cached-Tokens"]) > 100
    assert_same_answer(again, _from_scratch(stock, messages, lora=LORA0))
    assert _fallbacks(proxy) == 0


@pytest.mark.parametrize(
    "lora",
    [[{"id": 2, "scale": 1.0}], [{"id": 0, "scale": "big"}]],
    ids=["unknown-id", "scale-not-a-number"],
)
def test_a_bad_lora_field_is_a_400_and_changes_nothing(
    lora_servers: tuple[ProxyThread, ServerProcess], lora: Any
) -> None:
    proxy, _ = lora_servers
    body = chat_body([{"role": "user", "content": "hi"}], 4, lora=lora)
    reply = post(f"{proxy.url}/v1/chat/completions", body)
    assert reply.status == 400, reply.body
    assert "lora" in reply.body["error"]["message"], reply.body
    ok = post(
        f"{proxy.url}/v1/chat/completions", chat_body([{"role": "user", "content": "hi"}], 4, lora=LORA1)
    )
    assert ok.status == 200, ok.body


def test_an_alora_adapter_is_refused_per_request_and_applied_to_every_request(
    start_server: ServerFactory, patched_bin: Path
) -> None:
    """aLoRA (an adapter whose KV depends on where its invocation string starts): loaded at scale
    0 the server starts, and a request naming it at another scale is a 400 before anything runs;
    applied to every request (scale 1) the server refuses --kvctl at startup, saying why."""
    model, alora = tiny_model(FAMILY), tiny_lora(FAMILY, seed=3, alora_tokens=(1, 2, 3))
    server = start_server(
        patched_bin, model=model, ctx_size=2048, threads=1, extra_args=("--lora-scaled", f"{alora}:0")
    )
    try:
        body = {"prompt": "hello", "n_predict": 2, "lora": [{"id": 0, "scale": 1.0}]}
        reply = post(f"{server.url}/completion", body)
        assert reply.status == 400, reply.body
        assert "aLoRA" in reply.body["error"]["message"], reply.body
        assert post(f"{server.url}/completion", {"prompt": "hello", "n_predict": 2}).status == 200
    finally:
        server.stop()
    with pytest.raises(ConfigError) as info:
        start_server(patched_bin, model=model, ctx_size=2048, threads=1, extra_args=("--lora", str(alora)))
    assert "aLoRA adapter applied to every request" in str(info.value), info.value
