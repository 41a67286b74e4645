"""The proxy end to end, on a real patched llama-server with the default model (greedy).

References come from the stock server of the same commit with ``cache_prompt: false``
(a full prefill), compared under invariant 5 (see tests/helpers.py).
"""

from __future__ import annotations

import http.client
import json
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from proxy.native.launch import ServerProcess
from tests.helpers import (
    ProxyThread,
    Reply,
    ServerFactory,
    assert_same_answer,
    chat_body,
    get,
    post,
    proxy_config,
    slots_keep_kv,
)

WORDS = [
    "river",
    "mountain",
    "signal",
    "ledger",
    "turbine",
    "invoice",
    "harbor",
    "sensor",
    "quarterly",
    "margin",
    "valve",
    "pressure",
    "audit",
    "forecast",
    "copper",
    "lattice",
    "beacon",
    "orchard",
    "glacier",
    "compass",
    "network",
    "battery",
    "inverter",
]


def document(seed: int, n_words: int = 260) -> str:
    rng = random.Random(seed)
    sentences: list[str] = []
    while sum(len(s.split()) for s in sentences) < n_words:
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ".")
    return " ".join(sentences)


def convo(doc: str, question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"You are a careful analyst. Reference document:\n{doc}"},
        {"role": "user", "content": question},
    ]


@pytest.fixture(scope="module")
def backend(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    # Its own server: the proxy must be the only client of the slots it steers.
    return start_server(patched_bin)


@pytest.fixture(scope="module")
def proxy(backend: ServerProcess) -> Iterator[ProxyThread]:
    assert backend.spec.kvctl_dir is not None
    config = proxy_config(
        backend,
        cache_ram_mib=512,
        record_path=backend.spec.kvctl_dir.parent / f"recorded-{backend.spec.port}.jsonl",
    )
    thread = ProxyThread(config).start()
    yield thread
    thread.stop()


@pytest.fixture(autouse=True)
def tree_stays_valid(proxy: ProxyThread) -> Iterator[None]:
    yield
    proxy.settle()
    proxy.call(lambda rt: rt.coordinator.tree.check_invariants())
    busy = proxy.call(lambda rt: [s.slot_id for sv in rt.coordinator.servers for s in sv.slots if s.busy])
    assert busy == []


def ask(proxy: ProxyThread, messages: list[dict[str, str]], n: int = 16, **extra: object) -> Reply:
    reply = post(f"{proxy.url}/v1/chat/completions", chat_body(messages, n, **extra))
    assert reply.status == 200, reply.body
    proxy.settle()
    return reply


def reference(stock_server: ServerProcess, messages: list[dict[str, str]], n: int = 16) -> Reply:
    reply = post(f"{stock_server.url}/v1/chat/completions", chat_body(messages, n, cache_prompt=False))
    assert reply.status == 200, reply.body
    return reply


def test_fresh_prompt_matches_full_prefill(proxy: ProxyThread, stock_server: ServerProcess) -> None:
    messages = convo(document(1), "Which words appear most often?")
    got = ask(proxy, messages)
    assert got.headers["X-Radix-Route"] == "prefill"
    assert_same_answer(got, reference(stock_server, messages))


def test_returning_prompt_is_restored_from_host_tree(proxy: ProxyThread, stock_server: ServerProcess) -> None:
    doc = document(2)
    first = ask(proxy, convo(doc, "Summarize the document in one line."))
    n_first = int(first.headers["X-Radix-Prompt-Tokens"])
    # Four other long prompts take every slot, so the first prompt's slot is overwritten.
    for seed in range(10, 14):
        ask(proxy, convo(document(seed), "List three words."), n=4)
    messages = convo(doc, "Which sentence is the longest?")
    got = ask(proxy, messages)
    assert got.headers["X-Radix-Route"] in ("H", "A+H")
    timings = got.body["timings"]
    assert timings["cache_n"] > 0.8 * n_first - 30, timings
    assert timings["prompt_n"] < 40, timings
    assert int(got.headers["X-Radix-Cached-Tokens"]) == timings["cache_n"]
    assert_same_answer(got, reference(stock_server, messages))


def test_restored_kv_is_byte_identical_to_saved(proxy: ProxyThread) -> None:
    doc = document(3)
    ask(proxy, convo(doc, "Name one word."), n=4)
    for seed in range(20, 24):
        ask(proxy, convo(document(seed), "Name one word."), n=4)
    # The restore below runs as always; only the release after it is held back, so the slot
    # still holds what was imported when it is compared with the tree.
    with slots_keep_kv(proxy):
        got = ask(proxy, convo(doc, "Name two words."), n=4)
    assert got.headers["X-Radix-Route"] in ("H", "A+H")
    slot, cached = int(got.headers["X-Radix-Slot"]), int(got.headers["X-Radix-Cached-Tokens"])

    async def compare(rt: object) -> bool:
        from proxy.server.ops.runtime import Runtime

        assert isinstance(rt, Runtime)
        server = rt.coordinator.servers[0]
        tokens = server.slots[slot].tokens
        match = rt.coordinator.tree.match(tokens[:cached], ns=server.model_ns)
        assert match.length == cached
        saved = np.concatenate([s.rows() for s in rt.coordinator.tree.segments(match, 0, cached)])
        async with server.move_lock:
            live = await server.mover.export({"slot": slot}, 0, tokens[:cached])
        return bool(np.array_equal(saved, np.concatenate([seg.rows() for seg in live])))

    assert proxy.run(compare(proxy.runtime))


def test_multi_turn_chat_reuses_the_slot(proxy: ProxyThread, stock_server: ServerProcess) -> None:
    messages = convo(document(4), "What is the first word?")
    first = ask(proxy, messages)
    messages += [
        {"role": "assistant", "content": first.body["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the last word?"},
    ]
    got = ask(proxy, messages)
    assert got.headers["X-Radix-Route"] in ("A", "H", "A+H")
    assert got.body["timings"]["cache_n"] >= int(first.headers["X-Radix-Prompt-Tokens"]) - 1
    assert_same_answer(got, reference(stock_server, messages))


def test_branches_share_one_stored_prefix(proxy: ProxyThread) -> None:
    doc = document(5, n_words=300)
    before = proxy.call(lambda rt: rt.coordinator.tree.stats())
    lengths = []
    for i in range(8):
        reply = ask(proxy, convo(doc, f"Question {i}: how often does the word '{WORDS[i]}' occur?"), n=2)
        lengths.append(int(reply.headers["X-Radix-Prompt-Tokens"]))
    after = proxy.call(lambda rt: rt.coordinator.tree.stats())
    new_unique = after.unique_tokens - before.unique_tokens
    new_logical = after.logical_tokens - before.logical_tokens
    # The shared document is stored once: far fewer unique tokens than eight copies.
    assert new_unique < 0.4 * sum(lengths), (new_unique, lengths)
    assert new_logical >= sum(lengths)
    per_token = proxy.call(lambda rt: rt.coordinator.servers[0].mover.bytes_per_token)
    assert after.bytes - before.bytes < 1.2 * new_unique * per_token + 64 * 1024


def test_streaming_passes_chunks_through(proxy: ProxyThread) -> None:
    messages = convo(document(6, 120), "Count from one to ten in words.")
    body = chat_body(messages, 24, stream=True)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.config.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    events, text = [], ""
    while True:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            events.append(payload)
            if payload != b"[DONE]":
                delta = json.loads(payload)["choices"]
                if delta and delta[0]["delta"].get("content"):
                    text += delta[0]["delta"]["content"]
    conn.close()
    assert len(events) > 5 and events[-1] == b"[DONE]"
    plain = ask(proxy, messages, n=24)
    assert text == plain.body["choices"][0]["message"]["content"]


def test_bad_input_leaves_everything_intact(proxy: ProxyThread, backend: ServerProcess) -> None:
    before = proxy.call(lambda rt: rt.coordinator.tree.stats())
    bad_json = post(f"{proxy.url}/v1/chat/completions", None, raw=b"{not json")
    assert bad_json.status == 400 and set(bad_json.body["error"]) == {"code", "message", "type"}
    no_messages = post(f"{proxy.url}/v1/chat/completions", {"max_tokens": 4})
    assert no_messages.status == 400 and no_messages.body["error"]["type"] == "invalid_request_error"
    huge = post(f"{proxy.url}/v1/chat/completions", chat_body(convo(document(7, 9000), "hi"), 4))
    assert huge.status == 400 and "context" in huge.body["error"]["message"]
    bad_role = post(f"{proxy.url}/v1/chat/completions", {"messages": [{"role": 5}], "max_tokens": 2})
    assert 400 <= bad_role.status < 500 and "error" in bad_role.body
    after = proxy.call(lambda rt: rt.coordinator.tree.stats())
    assert (after.nodes, after.bytes, after.unique_tokens) == (
        before.nodes,
        before.bytes,
        before.unique_tokens,
    )
    assert get(f"{proxy.url}/health").status == 200
    ask(proxy, convo(document(8, 60), "Say yes."), n=2)


def test_unknown_model_is_answered_like_the_server_does(
    proxy: ProxyThread, stock_server: ServerProcess
) -> None:
    body = chat_body(convo(document(12, 40), "Say yes."), 2, model="no-such-model")
    direct = post(f"{stock_server.url}/v1/chat/completions", body)
    via = post(f"{proxy.url}/v1/chat/completions", body)
    # llama-server serves its one model whatever the name; the proxy changes nothing about that.
    assert via.status == direct.status
    if via.status >= 400:
        assert set(via.body["error"]) == {"code", "message", "type"}
    assert get(f"{proxy.url}/health").status == 200


def test_client_disconnect_mid_stream(proxy: ProxyThread) -> None:
    body = chat_body(convo(document(9, 100), "Write a long story."), 400, stream=True)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.config.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.readline()
    conn.close()  # go away mid-stream
    proxy.settle()
    reply = ask(proxy, convo(document(9, 100), "Say one word."), n=2)
    assert reply.status == 200


def test_metrics_and_admin(proxy: ProxyThread) -> None:
    ask(proxy, convo(document(11, 40), "Say no."), n=2)
    text = get(f"{proxy.url}/metrics").body
    assert 'radix_requests_total{route="H",server="s0"}' in text
    assert "radix_host_tree_bytes" in text
    # Sharing is off here: no owner holds a cell and no request took route S.
    samples = {
        line.split()[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples['kv_cache_owner_cells{server="s0"}'] == 0
    assert samples["kv_share_path_s_requests_total"] == 0
    assert samples["kv_share_path_h_requests_total"] >= 1
    routes = get(f"{proxy.url}/radix/routes").body["decisions"]
    assert routes and {"route", "cached", "prompt_tokens", "slot"} <= set(routes[-1])


def test_next_turn_sent_at_once_reuses_its_own_prefix(proxy: ProxyThread) -> None:
    # No settle between the turns: the first turn's slot is still being saved when the
    # second arrives, and the second must wait for it rather than prefill elsewhere.
    messages = convo(document(60, 200), "Give one word.")  # a seed no other test uses
    first = post(f"{proxy.url}/v1/chat/completions", chat_body(messages, 4))
    assert first.status == 200
    messages += [
        {"role": "assistant", "content": first.body["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Another one."},
    ]
    second = post(f"{proxy.url}/v1/chat/completions", chat_body(messages, 4))
    assert second.status == 200
    assert second.headers["X-Radix-Route"] in ("A", "A+H", "H"), second.headers
    assert second.body["timings"]["cache_n"] >= int(first.headers["X-Radix-Prompt-Tokens"]) - 1


def test_received_requests_are_recorded_as_a_replayable_manifest(proxy: ProxyThread) -> None:
    from proxy.traffic.runner import read_manifest

    body = chat_body(convo(document(13, 30), "Say maybe."), 2)
    reply = post(f"{proxy.url}/v1/chat/completions", body, headers={"X-Session-Id": "sess-7"})
    assert reply.status == 200
    assert proxy.config.record_path is not None
    entries = read_manifest(proxy.config.record_path)
    last = entries[-1]
    # Recorded as the client sent it: the proxy's id_slot / cache_prompt are not in it.
    assert last.body == body and last.session == "sess-7" and last.path == "/v1/chat/completions"
    assert [e.t for e in entries] == sorted(e.t for e in entries)
