"""--cache-idle-release on a real patched llama-server: once the host tree holds a slot's KV,
the slot is erased from the server's pool (as stock's idle-slot cache clears it), and the
slot's next turn is a host restore whose answer equals a full prefill."""

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
    request,
)
from tests.integration.test_proxy import convo, document


@pytest.fixture(scope="module")
def backend(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    # Its own server: the proxy must be the only client of the slots it steers.
    return start_server(patched_bin)


@pytest.fixture(scope="module")
def proxy(backend: ServerProcess) -> Iterator[ProxyThread]:
    thread = ProxyThread(proxy_config(backend, idle_release=True)).start()
    yield thread
    thread.stop()


def _server_slots(backend: ServerProcess) -> list[dict[str, Any]]:
    reply = request(
        backend.url + "/kvctl/slots?tokens=1",
        "GET",
        None,
        headers={"Authorization": f"Bearer {backend.spec.kvctl_key}"},
        timeout=60,
    )
    assert reply.status == 200 and isinstance(reply.body, dict), reply.body
    return list(reply.body["slots"])


def _ask(proxy: ProxyThread, messages: list[dict[str, str]]) -> Reply:
    reply = post(f"{proxy.url}/v1/chat/completions", chat_body(messages, 12))
    assert reply.status == 200, reply.body
    proxy.settle()
    proxy.call(lambda rt: rt.coordinator.tree.check_invariants())
    return reply


def _releases(proxy: ProxyThread) -> float:
    return float(proxy.call(lambda rt: rt.metrics.idle_releases._value.get()))


def test_idle_slot_is_released_and_its_next_turn_restored(
    proxy: ProxyThread, backend: ServerProcess, stock_server: ServerProcess
) -> None:
    messages = convo(document(41), "What is the first word?")
    first = _ask(proxy, messages)
    assert first.headers["X-Radix-Route"] == "prefill"
    slot = int(first.headers["X-Radix-Slot"])

    # The server's pool no longer holds the slot's KV, the proxy knows it, and the tree has it.
    held = next(s for s in _server_slots(backend) if int(s["id"]) == slot)
    assert not held.get("tokens") and int(held.get("pos_max", -1)) == -1, held
    assert proxy.call(lambda rt: len(rt.coordinator.servers[0].slots[slot].tokens)) == 0
    assert _releases(proxy) == 1

    messages += [
        {"role": "assistant", "content": first.body["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the last word?"},
    ]
    got = _ask(proxy, messages)
    assert got.headers["X-Radix-Route"] == "H"
    assert got.body["timings"]["cache_n"] >= int(first.headers["X-Radix-Prompt-Tokens"]) - 1
    ref = post(f"{stock_server.url}/v1/chat/completions", chat_body(messages, 12, cache_prompt=False))
    assert ref.status == 200, ref.body
    assert_same_answer(got, ref)
    assert _releases(proxy) == 2
