"""The remote tier (docs/scale-out.md) on a real Valkey (or Redis) and two proxies, each in
front of its own patched llama-server with the default model.

A prompt computed behind proxy 1 is restored behind proxy 2 from the store (route H, a
promotion counted) with the answer a full prefill gives (invariant 5). The store stopped
(a hung store: deadline), killed, restarted, flushed, and filled with forged or swapped
entries: every request is answered right, each fallback is counted by cause, nothing hangs.
References come from the stock server with ``cache_prompt: false``.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from proxy.native.launch import ServerProcess
from proxy.native.store import StoreProcess, store_binary
from proxy.server.ops.admin import tiers as tiers_of
from tests.helpers import ProxyThread, Reply, ServerFactory, assert_same_answer, chat_body, post, proxy_config
from tests.integration.test_proxy import convo, document

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        store_binary() is None,
        reason="neither valkey-server nor redis-server is installed (make valkey; Debian: apt-get install redis-server)",
    ),
]
CHUNK = 64  # tokens per chunk (--kv-arena-chunk): the suite's prompts are a few hundred tokens


class Store(StoreProcess):
    """The store of proxy/native/store.py, with a client for the tests' own reads and writes."""

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="radix-remote-") as tmp:
        os.chmod(tmp, 0o700)
        yield Path(tmp)


@pytest.fixture(scope="module")
def store(workdir: Path) -> Iterator[Store]:
    s = Store(workdir)
    s.start()
    yield s
    s.kill()


@pytest.fixture(scope="module")
def proxies(
    start_server: ServerFactory, patched_bin: Path, store: Store, workdir: Path
) -> Iterator[list[ProxyThread]]:
    servers = [start_server(patched_bin, n_parallel=2) for _ in range(2)]
    over: dict[str, Any] = {
        "cache_remote": store.url,
        "cache_remote_key_file": workdir / "remote.key",  # the same key for both: one fleet
        "cache_remote_timeout_s": 2.0,
        "cache_remote_backoff_s": 0.5,
        "kv_arena_chunk": CHUNK,
    }
    threads = [ProxyThread(proxy_config(s, **over)).start() for s in servers]
    yield threads
    for t in threads:
        t.stop()


def ask(proxy: ProxyThread, messages: list[dict[str, str]], n: int = 12) -> Reply:
    """One request; then its save and its writes to the store are done."""
    reply = post(f"{proxy.url}/v1/chat/completions", chat_body(messages, n))
    assert reply.status == 200, reply.body
    proxy.settle()
    assert proxy.run(proxy.runtime.coordinator.remote.drain(120))  # type: ignore[union-attr]
    return reply


def reference(stock: ServerProcess, messages: list[dict[str, str]], n: int = 12) -> Reply:
    reply = post(f"{stock.url}/v1/chat/completions", chat_body(messages, n, cache_prompt=False))
    assert reply.status == 200, reply.body
    return reply


def metric(proxy: ProxyThread, name: str, **labels: str) -> float:
    return proxy.call(lambda rt: rt.metrics.value(name, **labels))


def checked(proxy: ProxyThread) -> None:
    proxy.settle()
    proxy.call(lambda rt: rt.coordinator.tree.check_invariants())
    busy = proxy.call(lambda rt: [s.slot_id for sv in rt.coordinator.servers for s in sv.slots if s.busy])
    assert busy == []


def after_backoff() -> None:
    time.sleep(0.6)  # past cache_remote_backoff_s: the proxies ask the store again


def test_a_prompt_computed_behind_one_proxy_is_restored_behind_the_other(
    proxies: list[ProxyThread], store: Store, stock_server: ServerProcess
) -> None:
    one, two = proxies
    doc = document(4701)
    ask(one, convo(doc, "Which words appear most often?"))
    assert metric(one, "radix_remote_writes_total") > 0
    assert store.client().dbsize() > 0
    messages = convo(doc, "Name two words that are rare.")
    got = ask(two, messages)
    assert got.headers["X-Radix-Route"] == "H", got.headers
    assert got.body["timings"]["cache_n"] >= 4 * CHUNK, got.body["timings"]
    assert metric(two, "radix_remote_promotions_total") == 1
    assert metric(two, "radix_remote_promoted_tokens_total") >= 4 * CHUNK
    stats = two.call(lambda rt: tiers_of(rt)["remote"])
    assert stats["up"] and stats["promotions"] == 1 and stats["where"].endswith(f":{store.port}/0")
    assert_same_answer(got, reference(stock_server, messages))
    checked(one)
    checked(two)


def test_a_hung_killed_restarted_and_flushed_store_costs_no_answer(
    proxies: list[ProxyThread], store: Store, stock_server: ServerProcess
) -> None:
    one, two = proxies
    assert store.proc is not None
    # Hung: the store takes connections but answers nothing; each call meets its deadline.
    os.kill(store.proc.pid, signal.SIGSTOP)
    try:
        messages = convo(document(4702), "What is the first sentence about?")
        got = ask(two, messages)
        assert_same_answer(got, reference(stock_server, messages))
        assert metric(two, "radix_remote_fallbacks_total", cause="timeout") >= 1
        assert metric(two, "radix_remote_up") == 0
    finally:
        os.kill(store.proc.pid, signal.SIGCONT)
    after_backoff()
    # Dead: connections refused; requests and writes go on without it.
    store.kill()
    after_backoff()
    messages = convo(document(4703), "Which words appear most often?")
    got = ask(one, messages)
    assert_same_answer(got, reference(stock_server, messages))
    refused = metric(one, "radix_remote_fallbacks_total", cause="connection") + metric(
        one, "radix_remote_write_dropped_total", cause="connection"
    )
    assert refused >= 1
    # Back (empty): a prompt computed behind proxy 1 is shared again.
    store.start()
    after_backoff()
    doc = document(4704)
    ask(one, convo(doc, "Which words appear most often?"))
    assert store.client().dbsize() > 0
    before = metric(two, "radix_remote_promotions_total")
    messages = convo(doc, "Name two words that are rare.")
    got = ask(two, messages)
    assert metric(two, "radix_remote_promotions_total") == before + 1
    assert got.headers["X-Radix-Route"] == "H", got.headers
    assert_same_answer(got, reference(stock_server, messages))
    # Flushed: nothing is found, the request is prefilled, and the chunks are written again.
    doc = document(4705)
    ask(one, convo(doc, "Which words appear most often?"))
    store.client().flushall()
    messages = convo(doc, "Name two words that are rare.")
    got = ask(two, messages)
    assert metric(two, "radix_remote_promotions_total") == before + 1
    assert_same_answer(got, reference(stock_server, messages))
    assert store.client().dbsize() > 0  # proxy 2 saved what it computed
    checked(one)
    checked(two)


def _forge(store: Store, how: str) -> int:
    client = store.client()
    keys = sorted(client.scan_iter("radix:*"))
    values: list[bytes] = [bytes(v) for k in keys if isinstance(v := client.get(k), bytes)]
    assert keys and len(values) == len(keys)
    if how == "flip":
        for key, value in zip(keys, values, strict=True):
            forged = bytearray(value)
            forged[-1] ^= 0xFF
            client.set(key, bytes(forged))
    else:  # swap: every key holds another (valid, signed) chunk's value
        for key, value in zip(keys, values[1:] + values[:1], strict=True):
            client.set(key, value)
    return len(keys)


@pytest.mark.parametrize("how", ["flip", "swap"])
def test_forged_or_swapped_entries_are_refused_never_served(
    proxies: list[ProxyThread], store: Store, stock_server: ServerProcess, how: str
) -> None:
    one, two = proxies
    store.client().flushall()
    doc = document(4710 if how == "flip" else 4711)
    ask(one, convo(doc, "Which words appear most often?"))
    assert _forge(store, how) >= 2
    promotions = metric(two, "radix_remote_promotions_total")
    refused = metric(two, "radix_remote_fallbacks_total", cause="refused")
    messages = convo(doc, "Name two words that are rare.")
    got = ask(two, messages)
    assert metric(two, "radix_remote_promotions_total") == promotions
    assert metric(two, "radix_remote_fallbacks_total", cause="refused") == refused + 1
    assert got.headers["X-Radix-Route"] != "H", got.headers
    assert_same_answer(got, reference(stock_server, messages))
    checked(two)
