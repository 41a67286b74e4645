"""Resident KV sharing (route S), mixed restores and fan-out, on a real patched server."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.config import Config
from proxy.native.launch import ServerProcess, free_port
from tests.helpers import ProxyThread, Reply, ServerFactory, assert_same_answer, chat_body, get, post, request
from tests.integration.test_proxy import convo, document


def start_proxy(backend: ServerProcess, **kw: object) -> ProxyThread:
    assert backend.spec.kvctl_dir is not None
    config = Config(
        backends=(backend.url,),
        port=free_port(),
        shm_dir=backend.spec.kvctl_dir,
        kvctl_key=backend.spec.kvctl_key,
        min_restore_tokens=32,
        cache_ram_mib=512,
        kv_share=True,
        **kw,  # type: ignore[arg-type]
    )
    return ProxyThread(config).start()


@pytest.fixture(scope="module")
def backend(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    return start_server(patched_bin)


@pytest.fixture(scope="module")
def proxy(backend: ServerProcess) -> Iterator[ProxyThread]:
    thread = start_proxy(backend)
    yield thread
    thread.stop()


def ask(proxy: ProxyThread, messages: list[dict[str, str]], n: int = 12) -> Reply:
    reply = post(f"{proxy.url}/v1/chat/completions", chat_body(messages, n))
    assert reply.status == 200, reply.body
    return reply


def ask_together(proxy: ProxyThread, conversations: list[list[dict[str, str]]], n: int = 12) -> list[Reply]:
    with concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:
        replies = list(pool.map(lambda m: ask(proxy, m, n), conversations))
    proxy.settle()
    return replies


def reference(stock_server: ServerProcess, messages: list[dict[str, str]], n: int = 12) -> Reply:
    reply = post(f"{stock_server.url}/v1/chat/completions", chat_body(messages, n, cache_prompt=False))
    assert reply.status == 200
    return reply


def invariants(proxy: ProxyThread) -> None:
    def check(rt: object) -> None:
        from proxy.server.ops.runtime import Runtime

        assert isinstance(rt, Runtime)
        rt.coordinator.tree.check_invariants()
        for server in rt.coordinator.servers:
            assert not any(s.busy for s in server.slots)
            if server.sharing is not None:
                server.sharing.index.check_invariants()
                assert server.sharing.index.stats().pinned == 0

    proxy.call(check)


def test_fan_out_computes_the_shared_prefix_once(proxy: ProxyThread, stock_server: ServerProcess) -> None:
    doc = document(31, n_words=320)
    conversations = [convo(doc, f"Question {i}: which word comes first?") for i in range(3)]
    replies = ask_together(proxy, conversations)
    prompt_tokens = [int(r.headers["X-Radix-Prompt-Tokens"]) for r in replies]
    computed = sum(r.body["timings"]["prompt_n"] for r in replies)
    # One prefill of the shared document plus the short suffixes, not three prefills.
    assert computed < 1.5 * max(prompt_tokens), (computed, prompt_tokens)
    routes = sorted(r.headers["X-Radix-Route"] for r in replies)
    assert routes.count("prefill") == 1, routes
    for reply, messages in zip(replies, conversations, strict=True):
        assert_same_answer(reply, reference(stock_server, messages))
    invariants(proxy)


def test_attached_slots_hold_the_shared_cells_once(
    proxy: ProxyThread, backend: ServerProcess, stock_server: ServerProcess
) -> None:
    doc = document(32, n_words=300)
    ask(proxy, convo(doc, "First question: name a word."))
    proxy.settle()
    # Two requests at once: one continues on the source slot (A), the other attaches the
    # resident prefix to another slot (S).
    pair = [convo(doc, "Second question: name a verb."), convo(doc, "Third question: name a noun.")]
    replies = ask_together(proxy, pair)
    routes = sorted(r.headers["X-Radix-Route"] for r in replies)
    assert "S" in routes or "S+H" in routes, routes
    for reply, messages in zip(replies, pair, strict=True):
        assert_same_answer(reply, reference(stock_server, messages))
    cells = request(
        f"{backend.url}/kvctl/cells", headers={"Authorization": f"Bearer {backend.spec.kvctl_key}"}
    ).body
    shared = min(r.body["timings"]["cache_n"] for r in replies if r.headers["X-Radix-Route"].startswith("S"))
    # The owner and two slots hold the shared prefix in one set of cells.
    assert cells["logical"] - cells["used"] >= 2 * shared - 8, (cells, shared)
    assert cells["owner"] > 0
    metrics = get(f"{proxy.url}/metrics").body
    assert _sample(metrics, "kv_share_path_s_requests_total") >= 1
    assert _sample(metrics, 'kv_cache_owner_cells{server="s0"}') == cells["owner"]
    assert _sample(metrics, 'radix_resident_entries{server="s0"}') >= 1
    invariants(proxy)


def _sample(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


def test_pool_near_full_releases_owners_instead_of_failing(
    start_server: ServerFactory, patched_bin: Path
) -> None:
    small = start_server(patched_bin, ctx_size=2048, n_parallel=2)
    thread = start_proxy(small, kv_share_cells=1800, kv_share_headroom=64)
    try:
        for seed in range(3):
            ask(thread, convo(document(40 + seed, n_words=220), "Name one word."), n=4)
            thread.settle()
        owners_before = thread.call(lambda rt: rt.coordinator.servers[0].sharing.index.stats().entries)  # type: ignore[union-attr]
        assert owners_before >= 2
        # Needs most of the pool: owners must give their cells back first.
        big = ask(thread, convo(document(50, n_words=900), "Summarize."), n=64)
        assert big.body["choices"][0]["message"]["content"]
        thread.settle()
        released = thread.call(lambda rt: rt.coordinator.servers[0].sharing.index.stats().evicted)  # type: ignore[union-attr]
        assert released >= 1
        fallbacks = thread.call(lambda rt: rt.metrics.fallbacks.labels("import")._value.get())
        assert fallbacks == 0
        invariants(thread)
    finally:
        thread.stop()
