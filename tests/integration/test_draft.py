"""A draft model (speculative decoding, ``--model-draft``) behind the proxy with moves on (patch
0021), on a tiny random-weight model made here, against stock llama-server of the same commit
with the same draft computing from scratch, with f16 and q8_0 KV.

After a host restore (route H) into a slot the server recomputes the draft model's KV of the
restored prefix, so drafts are accepted as often as on stock. The draft is the target model
itself: with its KV right it drafts exactly what the target says (acceptance near 1); with the
draft's KV of the slot empty or stale most drafts would be rejected. Speculative decoding never
changes a greedy answer, so the answers are checked against stock's too, under the near-tie rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ProxyThread, ServerFactory, assert_same_answer, proxy_config
from tests.integration.test_architectures import KV_CONFIGS, _ask, _fallbacks, _from_scratch
from tests.integration.test_proxy import convo, document
from tests.tinymodels import tiny_model

pytestmark = pytest.mark.integration

FAMILY = "llama-h128"
KVS = ("f16", "q8_0-fa")


def _acceptance(timings: dict[str, Any]) -> float:
    assert timings.get("draft_n", 0) > 0, timings
    return float(timings["draft_n_accepted"]) / float(timings["draft_n"])


@pytest.mark.parametrize("kv", KVS)
def test_a_draft_model_is_served_with_moves(
    kv: str, start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> None:
    model = tiny_model(FAMILY)
    # draft-simple: the pinned server runs no speculative decoding unless a type is named
    args = (
        *KV_CONFIGS[kv],
        "--model-draft",
        str(model),
        "--spec-type",
        "draft-simple",
        "--spec-draft-n-max",
        "4",
    )
    patched = start_server(patched_bin, model=model, ctx_size=4096, threads=1, extra_args=args)
    stock = start_server(stock_bin, model=model, ctx_size=4096, threads=1, kvctl=False, extra_args=args)
    proxy = ProxyThread(proxy_config(patched)).start()
    try:
        assert proxy.call(lambda rt: rt.coordinator.servers[0].moves) is True
        messages = convo(document(13, 120), "What is the first word?")
        first = _ask(proxy, messages)
        assert_same_answer(first, _from_scratch(stock, messages))
        messages += [
            {"role": "assistant", "content": str(first.body["choices"][0]["message"]["content"])},
            {"role": "user", "content": "And the last word?"},
        ]
        second = _ask(proxy, messages)  # the slot's KV was released: restored from the host tree
        assert second.headers["X-Radix-Route"] == "H", second.headers
        assert second.body["timings"]["cache_n"] > 0, second.body["timings"]
        ref = _from_scratch(stock, messages)
        assert_same_answer(second, ref)
        rate, ref_rate = _acceptance(second.body["timings"]), _acceptance(ref.body["timings"])
        assert rate >= 0.8 * ref_rate and rate > 0.5, (second.body["timings"], ref.body["timings"])
        assert _fallbacks(proxy) == 0
    finally:
        proxy.stop()
        patched.stop()
        stock.stop()
