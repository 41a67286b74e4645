"""A random-weight model of a real shape (`radixctl model make llama-3.2-1b`, Q4_0) behind the proxy,
against stock llama-server of the same commit computing from scratch.

The benchmarks measure the product on these shapes (docs/bench.md, "Model shapes"), so this checks
that what they run is what they claim: the server loads the file as a 16-layer, 2048-wide model with
8 KV heads of 64 dims (32 KiB of f16 KV per token), the proxy serves it, its second turn is a host
restore of the first turn's KV, and both answers equal stock's from scratch under the near-tie rule.
"""

from __future__ import annotations

from pathlib import Path

from proxy.native.modelref import resolve_model
from proxy.native.shapes import SHAPES
from tests.helpers import (
    ProxyThread,
    Reply,
    ServerFactory,
    assert_same_answer,
    chat_body,
    post,
    proxy_config,
    request,
)
from tests.integration.test_proxy import convo, document

SHAPE = "llama-3.2-1b"


def _ask(url: str, messages: list[dict[str, str]], **extra: object) -> Reply:
    reply = post(f"{url}/v1/chat/completions", chat_body(messages, 8, **extra), timeout=300)
    assert reply.status == 200, reply.body
    return reply


def test_realistic_shape_is_served_and_restored_as_stock_computes_it(
    start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> None:
    model = resolve_model(f"shape:{SHAPE}")
    assert model == resolve_model(f"shape:{SHAPE}:q4_0")  # written once, found again by its key
    patched = start_server(patched_bin, model=model, ctx_size=2048)
    stock = start_server(stock_bin, model=model, ctx_size=2048, kvctl=False)
    shape = SHAPES[SHAPE]
    caps = request(
        f"{patched.url}/kvctl/caps", headers={"Authorization": f"Bearer {patched.spec.kvctl_key}"}
    ).body
    assert caps["moves"] is True and caps["compat"]["n_layer"] == shape.n_layer, caps
    props = request(f"{stock.url}/props").body
    assert props["model_path"].endswith(model.name)

    proxy = ProxyThread(proxy_config(patched)).start()
    try:
        layout = proxy.call(lambda rt: rt.coordinator.servers[0].mover.layout)
        assert layout is not None and sum(layout.section_layers) == shape.n_layer
        messages = convo(document(3, 100), "What is the first word?")
        first = _ask(proxy.url, messages)
        proxy.settle()
        assert first.headers["X-Radix-Route"] == "prefill"
        assert_same_answer(first, _ask(stock.url, messages, cache_prompt=False))
        # The saved KV is the shape's: 32 KiB of f16 K and V per token, 16 layers of it.
        stats = proxy.call(lambda rt: rt.coordinator.tree.stats())
        assert stats.unique_tokens > 100
        assert stats.bytes >= stats.unique_tokens * shape.kv_bytes_per_token(), stats

        messages += [
            {"role": "assistant", "content": first.body["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And the last word?"},
        ]
        second = _ask(proxy.url, messages)
        proxy.settle()
        assert second.headers["X-Radix-Route"] == "H", second.headers
        assert int(second.headers["X-Radix-Cached-Tokens"]) > 100
        assert_same_answer(second, _ask(stock.url, messages, cache_prompt=False))
    finally:
        proxy.stop()
        patched.stop()
        stock.stop()
