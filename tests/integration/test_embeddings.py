"""``/v1/embeddings`` through the proxy, on a real patched llama-server started with
``--embeddings`` (the default model, mean pooling), against stock llama-server of the same
commit started alike.

An embeddings request takes a slot: the proxy leases one, pins the inputs to it (patch 0014)
and afterwards records it as unknown, so no prefix is ever reused from KV an embedding
replaced, and completions on the same server keep answering like stock.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.native.launch import ServerProcess
from tests.helpers import ProxyThread, Reply, ServerFactory, get, post, proxy_config, request
from tests.integration.test_infill import completion
from tests.integration.test_kvctl import assert_error, assert_same_or_near_tie
from tests.integration.test_proxy import document
from tests.tinymodels import tiny_model

pytestmark = pytest.mark.integration

ARGS = ("--embeddings", "--pooling", "mean")
ONE = 1


@dataclass
class Pair:
    proxy: ProxyThread
    backend: ServerProcess
    stock: ServerProcess


@pytest.fixture(scope="module")
def pair(start_server: ServerFactory, patched_bin: Path, stock_bin: Path) -> Iterator[Pair]:
    kw: dict[str, Any] = {"threads": ONE, "n_parallel": 2, "ctx_size": 2 * 1024, "extra_args": ARGS}
    backend = start_server(patched_bin, **kw)
    stock = start_server(stock_bin, kvctl=False, **kw)
    thread = ProxyThread(proxy_config(backend)).start()
    yield Pair(thread, backend, stock)
    thread.stop()


@pytest.fixture(autouse=True)
def slots_come_back(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in ("pair", "rank_pair"):
        if name in request.fixturenames:
            pair: Pair = request.getfixturevalue(name)
            pair.proxy.settle()
            busy = pair.proxy.call(
                lambda rt: [s.slot_id for sv in rt.coordinator.servers for s in sv.slots if s.busy]
            )
            assert busy == []


def vectors(reply: Reply) -> list[np.ndarray]:
    assert reply.status == 200, str(reply.body)[:400]
    return [np.asarray(d["embedding"]) for d in sorted(reply.body["data"], key=lambda d: d["index"])]


# llama.cpp's numerics depend on batch composition and KV placement (invariant 5): stock's own
# vectors for one input, sent alone twice or in a batch of three, differed here by up to 0.004
# per element, cosine 0.99992. Different text gives cosines well below this.
MIN_COSINE = 0.9995


def assert_same_vectors(got: Reply, ref: Reply) -> None:
    """The same vectors up to that noise, each nearer its own reference than any other, from
    prompts of the same length."""
    a, b = vectors(got), vectors(ref)
    assert len(a) == len(b) and got.body["usage"] == ref.body["usage"]
    for i, x in enumerate(a):
        cos = [float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))) for y in b]
        assert x.shape == b[i].shape and cos[i] >= MIN_COSINE, cos
        assert all(c < cos[i] for j, c in enumerate(cos) if j != i), cos


INPUTS: list[Any] = [
    "The quick brown fox jumps over the lazy dog.",
    ["Embeddings of several inputs.", document(81, 120), "A third, short one."],
    [1, 2, 3, 4, 5, 6, 7],  # token ids
    [[10, 11, 12], "mixed with a string input"],
]


@pytest.mark.parametrize("given", INPUTS, ids=["one", "several", "token-ids", "ids-and-text"])
def test_embeddings_equal_stock(pair: Pair, given: Any) -> None:
    body = {"input": given, "encoding_format": "float"}
    got = post(f"{pair.proxy.url}/v1/embeddings", body)
    assert_same_vectors(got, post(f"{pair.stock.url}/v1/embeddings", body))
    assert got.headers["X-Radix-Server"] and got.headers["X-Radix-Slot"] in ("0", "1")


def test_llama_cpp_own_embedding_endpoint(pair: Pair) -> None:
    body = {"content": "The quick brown fox."}
    got = post(f"{pair.proxy.url}/embedding", body)
    ref = post(f"{pair.stock.url}/embedding", body)
    assert got.status == ref.status == 200
    x, y = (np.asarray(r.body[0]["embedding"]).ravel() for r in (got, ref))
    assert float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))) >= MIN_COSINE


def kvctl_key(pair: Pair) -> dict[str, str]:
    return {"Authorization": f"Bearer {pair.backend.spec.kvctl_key}"}


def test_an_embeddings_server_serves_with_moves_off(pair: Pair) -> None:
    info = request(f"{pair.backend.url}/kvctl/caps", headers=kvctl_key(pair)).body
    assert info["embedding"] == {"on": True, "pooling": 1}  # LLAMA_POOLING_TYPE_MEAN
    assert info["moves"] is False and any("embeddings" in r for r in info["moves_off"])
    assert info["n_seq_max"] == 2  # no owner or scratch sequence
    assert get(f"{pair.proxy.url}/health").body["servers"][0]["kv_moves"] == "off"


def test_the_inputs_run_on_the_pinned_slot(pair: Pair) -> None:
    """Patch 0014: with --kvctl the server honours id_slot for embeddings (stock ignores it)."""
    key, url = kvctl_key(pair), pair.backend.url

    def held() -> dict[int, int]:
        reply = request(f"{url}/kvctl/slots", headers=key)
        assert reply.status == 200, reply.body
        return {s["id"]: s["n_tokens"] for s in reply.body["slots"]}

    for slot in (1, 0):
        for s in (0, 1):
            assert post(f"{url}/kvctl/erase", {"slot": s}, headers=key).status == 200
        reply = post(f"{url}/v1/embeddings", {"input": [document(82, 60), "two"], "id_slot": slot})
        assert reply.status == 200, reply.body
        after = held()
        assert after[slot] > 0 and after[1 - slot] == 0, after
    for s in (0, 1):
        assert post(f"{url}/kvctl/erase", {"slot": s}, headers=key).status == 200
    pair.proxy.call(lambda rt: rt.coordinator.server_restarted(rt.coordinator.servers[0]))


PROMPT = "Reference document:\n" + document(83, 200) + "\nQuestion: which word comes first?\nAnswer:"


def ask(url: str, prompt: str = PROMPT, **more: Any) -> Reply:
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "n_probs": 3, "return_tokens": True}
    return post(f"{url}/completion", {**body, **more})


def test_completions_and_embeddings_share_the_slots_without_harm(pair: Pair) -> None:
    ref = completion(ask(pair.stock.url, cache_prompt=False))
    first = ask(pair.proxy.url)
    assert_same_or_near_tie(completion(first), ref)
    # Embeddings take both slots, the one holding the prompt's KV among them, several times and
    # side by side with completions: every slot an embedding ran on is recorded as unknown.
    texts = [document(90 + i, 150) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        embeds = [pool.submit(post, f"{pair.proxy.url}/v1/embeddings", {"input": t}) for t in texts]
        answers = [pool.submit(ask, pair.proxy.url) for _ in range(2)]
        for text, fut in zip(texts, embeds, strict=True):
            assert_same_vectors(fut.result(), post(f"{pair.stock.url}/v1/embeddings", {"input": text}))
        for fut in answers:
            assert_same_or_near_tie(completion(fut.result()), ref)
    pair.proxy.settle()
    again = ask(pair.proxy.url)
    assert_same_or_near_tie(completion(again), ref)
    # The last embedding's slot is never claimed to hold a prefix.
    last = post(f"{pair.proxy.url}/v1/embeddings", {"input": texts[0]})
    slot = int(last.headers["X-Radix-Slot"])
    held = pair.proxy.call(lambda rt: len(rt.coordinator.servers[0].slots[slot].tokens))
    assert held == 0
    mismatch = pair.proxy.call(lambda rt: rt.metrics.prompt_mismatch.labels("completions")._value.get())
    assert mismatch == 0


def test_an_answer_past_max_answer_is_refused_and_the_slot_comes_back(pair: Pair) -> None:
    small = ProxyThread(proxy_config(pair.backend, max_answer_bytes=4096)).start()
    try:
        reply = post(f"{small.url}/v1/embeddings", {"input": ["one", "two", "three"]})
        assert_error(reply, 502, "server_error", "--max-answer")
        small.settle()
        assert small.call(lambda rt: [s.slot_id for s in rt.coordinator.servers[0].slots if s.busy]) == []
    finally:
        small.stop()


BAD: list[tuple[dict[str, Any], str]] = [
    ({}, '"input" or "content" must be provided'),
    ({"input": []}, "must not be empty"),
    ({"input": [{"content": [{"type": "text", "text": "x"}]}]}, "multimodal"),
    ({"input": [[1, 1 << 30]]}, "invalid token id"),
    ({"input": ""}, "cannot be empty"),
    ({"input": ["a"] * 2049}, "at most 2048"),
]


@pytest.mark.parametrize(("body", "needle"), BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_a_400_in_the_servers_shape(pair: Pair, body: dict[str, Any], needle: str) -> None:
    assert_error(post(f"{pair.proxy.url}/v1/embeddings", body), 400, "invalid_request_error", needle)


def test_a_server_without_embeddings_refuses_as_the_server_refuses(
    plain_proxy: ProxyThread, stock_server: ServerProcess
) -> None:
    body = {"input": "hello"}
    ref = post(f"{stock_server.spec.url}/v1/embeddings", body)
    got = post(f"{plain_proxy.url}/v1/embeddings", body)
    assert got.status == ref.status == 501
    assert got.body["error"]["message"] == ref.body["error"]["message"]


# --- reranking: a tiny qwen3 with a classification head (tests/tinymodels.py) ----------------


@pytest.fixture(scope="module")
def rank_pair(start_server: ServerFactory, patched_bin: Path, stock_bin: Path) -> Iterator[Pair]:
    kw: dict[str, Any] = {
        "threads": ONE,
        "n_parallel": 2,
        "ctx_size": 2 * 1024,
        "extra_args": ("--reranking",),
        "model": tiny_model("qwen3-rerank"),
    }
    backend = start_server(patched_bin, **kw)
    stock = start_server(stock_bin, kvctl=False, **kw)
    thread = ProxyThread(proxy_config(backend)).start()
    yield Pair(thread, backend, stock)
    thread.stop()


DOCS = [document(100 + i, 30 + 25 * i) for i in range(4)]


def scores(reply: Reply) -> dict[int, float]:
    assert reply.status == 200, str(reply.body)[:400]
    return {r["index"]: r["relevance_score"] for r in reply.body["results"]}


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_scores_equal_stock(rank_pair: Pair, path: str) -> None:
    body = {"query": "Which words come first?", "documents": DOCS}
    got_reply = post(f"{rank_pair.proxy.url}{path}", body)
    ref_reply = post(f"{rank_pair.stock.url}{path}", body)
    got, ref = scores(got_reply), scores(ref_reply)
    assert got_reply.body["usage"] == ref_reply.body["usage"]  # the same prompts
    assert got.keys() == ref.keys() == set(range(len(DOCS)))
    spread = max(ref.values()) - min(ref.values())
    for i, score in got.items():
        # One document per slot at a time against stock's batches: equal up to batch numerics,
        # far closer than the documents' scores are to each other.
        assert abs(score - ref[i]) <= RANK_TOL * spread, (i, score, ref[i], spread)
    calls = rank_pair.proxy.call(lambda rt: rt.metrics.api_requests.labels("rerank")._value.get())
    assert calls >= 1


RANK_TOL = 0.05


def test_rerank_documents_run_on_the_pinned_slot(rank_pair: Pair) -> None:
    key, url = {"Authorization": f"Bearer {rank_pair.backend.spec.kvctl_key}"}, rank_pair.backend.url
    for s in (0, 1):
        assert post(f"{url}/kvctl/erase", {"slot": s}, headers=key).status == 200
    reply = post(f"{url}/v1/rerank", {"query": "q", "documents": DOCS[:3], "id_slot": 1})
    assert reply.status == 200, reply.body
    held = {s["id"]: s["n_tokens"] for s in request(f"{url}/kvctl/slots", headers=key).body["slots"]}
    assert held[1] > 0 and held[0] == 0, held
    for s in (0, 1):
        assert post(f"{url}/kvctl/erase", {"slot": s}, headers=key).status == 200
    rank_pair.proxy.call(lambda rt: rt.coordinator.server_restarted(rt.coordinator.servers[0]))


RANK_BAD: list[tuple[dict[str, Any], str]] = [
    ({"documents": ["a"]}, '"query" must be provided'),
    ({"query": 1, "documents": ["a"]}, '"query" must be a string'),
    ({"query": "q", "documents": []}, "non-empty string array"),
    ({"query": "q", "documents": ["a", 2]}, "non-empty string array"),
    ({"query": "q", "documents": ["a"] * 2049}, "at most 2048"),
]


@pytest.mark.parametrize(("body", "needle"), RANK_BAD, ids=[b[1] for b in RANK_BAD])
def test_bad_rerank_input_is_a_400(rank_pair: Pair, body: dict[str, Any], needle: str) -> None:
    assert_error(post(f"{rank_pair.proxy.url}/v1/rerank", body), 400, "invalid_request_error", needle)


def test_reranking_on_an_embeddings_server_is_refused_as_the_server_refuses(pair: Pair) -> None:
    body = {"query": "q", "documents": ["a"]}
    ref, got = post(f"{pair.stock.url}/v1/rerank", body), post(f"{pair.proxy.url}/v1/rerank", body)
    assert got.status == ref.status == 501
    assert got.body["error"]["message"] == ref.body["error"]["message"]
