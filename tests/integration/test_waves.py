"""Waves on a real patched llama-server (docs/design.md, Waves; issue 28 item 6): requests
sent together that share a document nobody has computed compute it once. The first one
computes the shared prefix alone (a prefix step, X-Radix-Prefix-Step), the proxy exports it,
the others restore it (route H); every answer is the one a full prefill gives (invariant 5)."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from proxy.native.launch import ServerProcess
from tests.helpers import ProxyThread, Reply, ServerFactory, assert_same_answer, chat_body, post, proxy_config
from tests.integration.test_proxy import convo, document

pytestmark = pytest.mark.integration

QUESTIONS = ("Which words appear most often?", "Name two rare words.", "Summarise it in one line.")


def _together(url: str, bodies: list[dict[str, object]]) -> list[Reply]:
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: post(f"{url}/v1/chat/completions", b), bodies))


def test_a_wave_computes_its_shared_document_once(
    start_server: ServerFactory, patched_bin: Path, stock_server: ServerProcess
) -> None:
    backend = start_server(patched_bin, n_parallel=4)
    doc = document(404, n_words=420)
    bodies = [chat_body(convo(doc, q), 8) for q in QUESTIONS]
    proxy = ProxyThread(proxy_config(backend)).start()
    try:
        replies = _together(proxy.url, bodies)
        proxy.settle()
        assert all(r.status == 200 for r in replies), [r.body for r in replies]
        heads = [r for r in replies if "X-Radix-Prefix-Step" in r.headers]
        assert len(heads) == 1, [dict(r.headers) for r in replies]
        step = dict(p.split("=") for p in heads[0].headers["X-Radix-Prefix-Step"].split(","))
        shared = int(step["tokens"])
        assert shared > 400  # the document, computed once, alone
        others = [r for r in replies if r is not heads[0]]
        assert [r.headers["X-Radix-Route"] for r in others] == ["H", "H"], [r.headers for r in others]
        assert all(r.body["timings"]["cache_n"] >= shared for r in others)
        # Tokens the server computed: the document once, then each request's own part (the
        # server recomputes at most the last token of what it reuses).
        computed = shared + sum(r.body["timings"]["prompt_n"] for r in replies)
        prompts = [int(r.headers["X-Radix-Prompt-Tokens"]) for r in replies]
        assert computed <= shared + sum(p - shared + 1 for p in prompts), (computed, shared, prompts)
        assert proxy.call(lambda rt: rt.metrics.value("radix_prefix_steps_total", outcome="done")) == 1
        proxy.call(lambda rt: rt.coordinator.tree.check_invariants())
        for reply, body in zip(replies, bodies, strict=True):
            ref = post(f"{stock_server.url}/v1/chat/completions", {**body, "cache_prompt": False})
            assert ref.status == 200, ref.body
            assert_same_answer(reply, ref)
    finally:
        proxy.stop()
