"""A slot is free when its answer is done (issue 28 item 7), on a real patched llama-server with
one slot: a request queued behind an answer whose save is not worth waiting for (the tree
already holds its prompt, and the answer is shorter than a host restore) takes the slot as soon
as that answer is done, without waiting for the save's read-back, export or idle release; its
answer equals a full prefill, and the proxy's slot table still matches the server's slots.

No timed assertion: the request is queued before the answer ends (the test waits for the
proxy's queue to show it), and the take is counted (``radix_saving_slot_takes_total``).
"""

from __future__ import annotations

import threading
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

ANSWER = 120  # tokens of the answer whose save is taken over: shorter than a restore (below)
MIN_RESTORE = 200


@pytest.fixture(scope="module")
def backend(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    return start_server(patched_bin, n_parallel=1)  # one slot: the second request must queue


@pytest.fixture(scope="module")
def proxy(backend: ServerProcess) -> Iterator[ProxyThread]:
    thread = ProxyThread(proxy_config(backend, min_restore_tokens=MIN_RESTORE)).start()
    yield thread
    thread.stop()


def _in_thread(url: str, body: dict[str, Any]) -> tuple[threading.Thread, list[Reply]]:
    out: list[Reply] = []
    thread = threading.Thread(target=lambda: out.append(post(url, body, timeout=600)), daemon=True)
    thread.start()
    return thread, out


def _until(proxy: ProxyThread, what: str, check: Any, tries: int = 6000) -> None:
    """Poll the proxy's state (a bound on tries, not a clock assertion)."""
    for _ in range(tries):
        if proxy.call(check):
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"never saw: {what}")


def test_a_queued_request_takes_the_slot_of_a_save_not_worth_waiting_for(
    proxy: ProxyThread, backend: ServerProcess, stock_server: ServerProcess
) -> None:
    url = f"{proxy.url}/v1/chat/completions"
    doc = convo(document(53), "What is the first word?")
    first = post(url, chat_body(doc, 8))
    assert first.status == 200, first.body
    proxy.settle()  # the document's prompt is in the host tree now

    # The same prompt again, with a long answer: the tree holds the prompt, the answer is
    # shorter than a restore, so its save is not worth waiting for.
    long_turn, long_reply = _in_thread(url, chat_body(doc, ANSWER, ignore_eos=True))
    _until(proxy, "the long answer leased", lambda rt: len(rt.coordinator.leases.inflight) == 1)
    other = convo(document(54, 80), "Name one word of the document.")
    queued_turn, queued_reply = _in_thread(url, chat_body(other, 12))
    _until(proxy, "the second request queued", lambda rt: rt.coordinator.leases.queued() == 1)
    long_turn.join(600)
    queued_turn.join(600)
    assert long_reply and long_reply[0].status == 200, long_reply
    assert queued_reply and queued_reply[0].status == 200, queued_reply
    proxy.settle()

    takes = proxy.call(lambda rt: rt.metrics.value("radix_saving_slot_takes_total", server="s0"))
    assert takes == 1, "the queued request waited for the save of a finished answer"
    # The taker's answer equals a full prefill on stock llama-server.
    ref = post(f"{stock_server.url}/v1/chat/completions", chat_body(other, 12, cache_prompt=False))
    assert ref.status == 200, ref.body
    assert_same_answer(queued_reply[0], ref)

    # Invariant 1 after the handoff: what the proxy records for the slot is exactly what the
    # server holds (or nothing, after its idle release), nothing unrecorded is left behind.
    held = _server_slot(backend)
    slot = proxy.call(lambda rt: rt.coordinator.servers[0].slots[0])
    recorded, unrecorded = proxy.call(lambda rt: (slot.tokens.tolist(), slot.unrecorded))
    assert unrecorded == 0
    assert recorded == [int(t) for t in held.get("tokens") or []]
    proxy.call(lambda rt: rt.coordinator.tree.check_invariants())

    # The long answer's next turn is still a host restore whose answer equals a full prefill.
    nxt = doc + [
        {"role": "assistant", "content": long_reply[0].body["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the last word?"},
    ]
    got = post(url, chat_body(nxt, 12))
    assert got.status == 200 and got.headers["X-Radix-Route"] in ("H", "A+H"), got.headers
    ref = post(f"{stock_server.url}/v1/chat/completions", chat_body(nxt, 12, cache_prompt=False))
    assert_same_answer(got, ref)


def _server_slot(backend: ServerProcess) -> dict[str, Any]:
    reply = request(
        backend.url + "/kvctl/slots?tokens=1",
        "GET",
        None,
        headers={"Authorization": f"Bearer {backend.spec.kvctl_key}"},
        timeout=60,
    )
    assert reply.status == 200 and isinstance(reply.body, dict), reply.body
    return dict(reply.body["slots"][0])
