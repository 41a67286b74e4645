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
from tests.integration import test_kvctl as kvctl
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


def test_a_failed_draft_recompute_clears_the_slot_and_the_next_request_is_right(
    start_server: ServerFactory, fault_bin: Path, stock_bin: Path
) -> None:
    """The draft model's recompute after an import fails (fault "draft", patch 0023): a 503 that
    says so, the slot emptied (target and draft KV both), and the next request on that slot is a
    full prefill answered as stock's, with drafts accepted as on stock."""
    model = tiny_model(FAMILY)
    args = ("--model-draft", str(model), "--spec-type", "draft-simple", "--spec-draft-n-max", "4")
    server = kvctl.keyed(
        start_server(fault_bin, model=model, n_parallel=2, ctx_size=2048, threads=1, extra_args=args)
    )
    stock = start_server(stock_bin, model=model, ctx_size=2048, threads=1, kvctl=False, extra_args=args)
    url = server.url
    c = kvctl.caps(url)
    assert c["fault_injection"] is True and c["moves"] is True
    kvctl.complete(url, kvctl.PROMPT, slot=0)
    info = kvctl.slot_info(url, 0)
    tokens, n = info["tokens"], info["n_tokens"]
    blob = kvctl.export(url, 0, n)
    kvctl.erase(url, 0)

    body = kvctl.import_body(c["compat"], 0, 0, n, tokens, [blob], fault="draft")
    msg = kvctl.assert_error(
        kvctl.call(url, "POST", "/kvctl/import", body), 503, "unavailable_error", "draft"
    )
    assert "slot was cleared" in msg
    info = kvctl.slot_info(url, 0)
    assert (info["n_tokens"], info["n_cells"]) == (0, 0), info
    assert kvctl.cells(url)["used"] == 0

    # The same import without the fault: the slot holds [0, n) again and the draft is in step.
    kvctl.import_(url, c["compat"], 0, 0, n, tokens, [blob])
    request = tokens + [
        int(t) for t in kvctl.ok(url, "POST", "/tokenize", {"content": kvctl.SUFFIX})["tokens"]
    ]
    got = kvctl.complete(url, request, slot=0, n=24)
    assert got.cache_n >= n - 1, got.raw["timings"]
    ref = kvctl.complete(stock.url, request, slot=None, cache=False, n=24)
    kvctl.assert_same_or_near_tie(got, ref)
    rate, ref_rate = _acceptance(got.raw["timings"]), _acceptance(ref.raw["timings"])
    assert rate >= 0.8 * ref_rate and rate > 0.5, (got.raw["timings"], ref.raw["timings"])

    # After a failed one, the next request on the slot is a full prefill with the right answer.
    kvctl.erase(url, 0)
    failed = kvctl.call(url, "POST", "/kvctl/import", body)
    assert failed.status == 503
    after = kvctl.complete(url, request, slot=0, n=24)
    assert after.cache_n == 0, after.raw["timings"]
    kvctl.assert_same_or_near_tie(after, ref)
    assert _acceptance(after.raw["timings"]) >= 0.8 * ref_rate
