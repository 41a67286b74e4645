"""Agent clients unchanged: the Anthropic and OpenAI SDKs (and LangChain's ChatAnthropic)
through the proxy, on a real patched llama-server with the default model (greedy).

References come from the stock server of the same commit: its own ``/v1/messages`` and
``count_tokens`` (the server's conversion of the Anthropic body), and a full prefill of the
same converted chat body with log-probabilities, compared under invariant 5
(tests/helpers.py). Second turns show the cache at work (``X-Radix-Route``, cached tokens).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from proxy.native.launch import ServerProcess
from proxy.server.api import anthropic as convert
from proxy.server.api import responses as responses_convert
from tests.helpers import NEAR_TIE_NATS, ProxyThread, Reply, ServerFactory, answer_tokens, post, proxy_config
from tests.integration.test_proxy import document

pytestmark = pytest.mark.integration

KEY = "agent-key"
SYSTEM = "You are a careful analyst. Reference document:\n" + document(41, 220)
TOOLS: list[Any] = [
    {
        "name": "word_count",
        "description": "Counts how often a word occurs in the reference document.",
        "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    }
]


@pytest.fixture(scope="module")
def backend(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    return start_server(patched_bin)  # its own: the proxy must be the only client of its slots


@pytest.fixture(scope="module")
def proxy(backend: ServerProcess) -> Iterator[ProxyThread]:
    thread = ProxyThread(proxy_config(backend, cache_ram_mib=256)).start()
    yield thread
    thread.stop()


@pytest.fixture(autouse=True)
def tree_stays_valid(proxy: ProxyThread) -> Iterator[None]:
    yield
    if proxy.runtime is None or proxy.loop.is_closed() or not proxy.loop.is_running():
        return  # the last test stopped it
    proxy.settle()
    proxy.call(lambda rt: rt.coordinator.tree.check_invariants())
    busy = proxy.call(lambda rt: [s.slot_id for sv in rt.coordinator.servers for s in sv.slots if s.busy])
    assert busy == []


def claude(proxy: ProxyThread, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0, timeout=180)


def reference(stock: ServerProcess, body: dict[str, Any]) -> Reply:
    """A full prefill of the chat body the server makes of ``body``, with log-probabilities."""
    chat = {**convert.to_chat(body), "cache_prompt": False, "logprobs": True, "top_logprobs": 2}
    chat.pop("stream", None)
    reply = post(f"{stock.url}/v1/chat/completions", chat)
    assert reply.status == 200, reply.body
    return reply


def assert_same_text(got: str, ref: Reply, tol: float = NEAR_TIE_NATS) -> None:
    """``got`` is the reference's text, or parts from it only where its top-two margin is small."""
    at = 0
    for i, (token, _, margin) in enumerate(answer_tokens(ref)):
        if got[at : at + len(token)] != token:
            assert margin < tol, f"parted at token {i} ({got[at:]!r} vs {token!r}), margin {margin:.3f}"
            return
        at += len(token)
    assert got == ref.body["choices"][0]["message"]["content"]


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def ask(proxy: ProxyThread, body: dict[str, Any], key: str = KEY) -> tuple[Any, Any]:
    """The answer and its headers (case-insensitive)."""
    raw = claude(proxy, key).messages.with_raw_response.create(**sdk(body))
    proxy.settle()
    return raw.parse(), raw.headers


def sdk(body: dict[str, Any]) -> dict[str, Any]:
    """The SDK's arguments for ``body``: it has no sampling parameters (greedy goes in extra_body)."""
    args = {k: v for k, v in body.items() if k != "temperature"}
    return {**args, "extra_body": {"temperature": body["temperature"]}} if "temperature" in body else args


def body_of(question: str, n: int = 12, **extra: Any) -> dict[str, Any]:
    return {
        "model": "default",
        "max_tokens": n,
        "temperature": 0,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": question}],
        **extra,
    }


def test_messages_match_the_stock_server(proxy: ProxyThread, stock_server: ServerProcess) -> None:
    body = body_of("Which word comes first in the document?")
    message, headers = ask(proxy, body)
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason in ("max_tokens", "end_turn")
    # The proxy's tokens are the server's: the same count as stock llama-server's own.
    count = post(f"{stock_server.url}/v1/messages/count_tokens", body).body["input_tokens"]
    assert int(headers["x-radix-prompt-tokens"]) == count
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == count
    ref = reference(stock_server, body)
    assert_same_text(text_of(message), ref)
    # The stock server's own /v1/messages gives the same answer: the conversion is its own.
    stock = post(f"{stock_server.url}/v1/messages", body).body
    assert_same_text("".join(b["text"] for b in stock["content"] if b["type"] == "text"), ref)


def test_second_turn_reuses_the_cache(proxy: ProxyThread, stock_server: ServerProcess) -> None:
    body = body_of("Name one word from the document.", 8)
    first, head1 = ask(proxy, body)
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "text", "text": text_of(first) or "river"}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Name another one.", "cache_control": {"type": "ephemeral"}}
            ],
        },
    ]
    second, head2 = ask(proxy, body)
    assert head2["x-radix-route"] != "prefill"
    assert second.usage.cache_read_input_tokens >= int(head1["x-radix-prompt-tokens"]) * 0.8
    assert int(head2["x-radix-cached-tokens"]) == second.usage.cache_read_input_tokens
    assert_same_text(text_of(second), reference(stock_server, body))


def test_streaming_events(proxy: ProxyThread, stock_server: ServerProcess) -> None:
    body = body_of("Count from one to five in words.", 16, stop_sequences=["five", "Five"])
    with claude(proxy).messages.stream(**sdk(body)) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
        headers = stream.response.headers
    proxy.settle()
    assert len(pieces) > 1 and "".join(pieces) == text_of(final)
    assert final.stop_reason in ("max_tokens", "end_turn")
    assert final.stop_sequence is None or final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0 and headers["x-radix-route"]
    # The stream and the server's own stream say the same.
    stock = post(f"{stock_server.url}/v1/messages", {**body, "stream": False}).body
    assert final.stop_reason == stock["stop_reason"] and final.stop_sequence == stock["stop_sequence"]
    assert_same_text(text_of(final), reference(stock_server, body))


def test_a_tool_loop(proxy: ProxyThread, stock_server: ServerProcess) -> None:
    """An agent's loop: tools offered, a tool_use the agent ran, its tool_result sent back.
    (The default model writes no tool calls itself; the loop's requests are what matter here.)"""
    body = body_of("How often does the word 'river' occur?", 8, tools=TOOLS, tool_choice={"type": "auto"})
    first, head1 = ask(proxy, body)
    body["messages"] += [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me count."},
                {"type": "tool_use", "id": "toolu_1", "name": "word_count", "input": {"word": "river"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "7"}]}
            ],
        },
    ]
    second, head2 = ask(proxy, body)
    count = claude(proxy).messages.count_tokens(
        model="default", system=body["system"], messages=body["messages"], tools=TOOLS
    )
    assert count.input_tokens == int(head2["x-radix-prompt-tokens"])
    assert (
        count.input_tokens == post(f"{stock_server.url}/v1/messages/count_tokens", body).body["input_tokens"]
    )
    assert head2["x-radix-route"] != "prefill"
    assert second.usage.cache_read_input_tokens > 0.5 * int(head1["x-radix-prompt-tokens"])
    assert_same_text(text_of(second), reference(stock_server, body))


def test_bad_input_gets_anthropic_errors_and_changes_nothing(proxy: ProxyThread) -> None:
    before = proxy.call(
        lambda rt: (rt.coordinator.tree.stats(), [s.tokens.tolist() for s in rt.coordinator.servers[0].slots])
    )
    bad: list[dict[str, Any] | bytes] = [
        b"{not json",
        {"max_tokens": 4},
        {"max_tokens": 4, "messages": "hi"},
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
    ]
    for case in bad:
        reply = post(
            f"{proxy.url}/v1/messages",
            None if isinstance(case, bytes) else case,
            raw=case if isinstance(case, bytes) else None,
        )
        assert reply.status == 400, (case, reply.body)
        assert reply.body["type"] == "error" and reply.body["error"]["type"] == "invalid_request_error"
        assert reply.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude(proxy).messages.create(model="default", max_tokens=4, messages=[])
    counted = post(f"{proxy.url}/v1/messages/count_tokens", {"model": "default"})
    assert counted.status >= 400 and counted.body["type"] == "error"
    after = proxy.call(
        lambda rt: (rt.coordinator.tree.stats(), [s.tokens.tolist() for s in rt.coordinator.servers[0].slots])
    )
    assert after == before


def test_api_keys_isolate_across_apis(proxy: ProxyThread) -> None:
    """Anthropic's x-api-key is the client's API key: another key computes the prompt again;
    the same key sent as a Bearer token (OpenAI's way) shares the cache."""
    body = body_of("Repeat the last word of the document.", 4)
    body["system"] = [{"type": "text", "text": "Tenant memo: " + document(43, 200)}]
    _, first = ask(proxy, body, key="tenant-a")
    n = int(first["x-radix-prompt-tokens"])
    other, _ = ask(proxy, body, key="tenant-b")
    assert other.usage.cache_read_input_tokens < 8
    chat = {**convert.to_chat(body), "cache_prompt": True}
    shared = post(f"{proxy.url}/v1/chat/completions", chat, headers={"Authorization": "Bearer tenant-a"})
    proxy.settle()
    assert shared.status == 200 and shared.body["timings"]["cache_n"] > 0.8 * n


def test_langchain_chat_anthropic(proxy: ProxyThread, stock_server: ServerProcess) -> None:
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    from langchain_core.messages import HumanMessage, SystemMessage

    llm = langchain_anthropic.ChatAnthropic(
        model="default", base_url=proxy.url, api_key=KEY, max_tokens=8, temperature=0, max_retries=0
    )
    question = "Which word comes last in the document?"
    got = llm.invoke([SystemMessage(SYSTEM), HumanMessage(question)])
    proxy.settle()
    again = llm.invoke([SystemMessage(SYSTEM), HumanMessage(question)])
    proxy.settle()
    assert again.usage_metadata is not None
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0
    body = {"model": "default", "max_tokens": 8, "temperature": 0, "system": SYSTEM}
    body["messages"] = [{"role": "user", "content": question}]
    assert_same_text(str(got.content), reference(stock_server, body))


# ---- OpenAI Responses --------------------------------------------------------------------------


def gpt(proxy: ProxyThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, max_retries=0, timeout=180)


def responses_reference(stock: ServerProcess, body: dict[str, Any]) -> Reply:
    chat = {**responses_convert.to_chat(body), "cache_prompt": False, "logprobs": True, "top_logprobs": 2}
    chat.pop("stream", None)
    reply = post(f"{stock.url}/v1/chat/completions", chat)
    assert reply.status == 200, reply.body
    return reply


def test_responses_create_and_second_turn(proxy: ProxyThread, stock_server: ServerProcess) -> None:
    body: dict[str, Any] = {
        "model": "default",
        "instructions": SYSTEM,
        "input": [{"role": "user", "content": "Which word comes second in the document?"}],
        "max_output_tokens": 10,
        "temperature": 0,
    }
    raw = gpt(proxy).responses.with_raw_response.create(**body)
    proxy.settle()
    first = raw.parse()
    counted = post(f"{stock_server.url}/v1/responses/input_tokens", body).body["input_tokens"]
    assert int(raw.headers["x-radix-prompt-tokens"]) == counted == first.usage.input_tokens
    assert post(f"{proxy.url}/v1/responses/input_tokens", body).body["input_tokens"] == counted
    assert_same_text(first.output_text, responses_reference(stock_server, body))
    body["input"] += [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": first.output_text}],
        },
        {"role": "user", "content": "And the third?"},
    ]
    raw = gpt(proxy).responses.with_raw_response.create(**body)
    proxy.settle()
    second = raw.parse()
    assert raw.headers["x-radix-route"] != "prefill"
    assert second.usage.input_tokens_details.cached_tokens >= 0.8 * counted
    assert_same_text(second.output_text, responses_reference(stock_server, body))


def test_responses_stream(proxy: ProxyThread, stock_server: ServerProcess) -> None:
    body: dict[str, Any] = {
        "model": "default",
        "instructions": "Be brief.",
        "input": "Count from one to five in words.",
        "max_output_tokens": 12,
        "temperature": 0,
    }
    events = list(gpt(proxy).responses.create(**body, stream=True))
    proxy.settle()
    kinds = [e.type for e in events]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert_same_text(text, responses_reference(stock_server, body))
    bad = post(f"{proxy.url}/v1/responses", {"model": "default", "input": [{"type": "nonsense"}]})
    assert bad.status == 400 and bad.body["error"]["message"] == "Cannot determine type of 'item'"


def test_a_server_dying_mid_stream_ends_with_an_anthropic_error_event(
    start_server: ServerFactory, patched_bin: Path
) -> None:
    lone = start_server(patched_bin, n_parallel=2)
    thread = ProxyThread(proxy_config(lone, cache_ram_mib=64, queue_timeout_s=20.0)).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", thread.config.port, timeout=60)
        body = {**body_of("Write a long report on every word.", 400), "stream": True}
        conn.request("POST", "/v1/messages", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream")
        assert resp.readline() == b"event: message_start\n"
        assert lone.proc is not None
        lone.proc.kill()
        rest = resp.read().decode()  # ends: no hang, no second HTTP response inside the body
        last = [b for b in rest.split("\n\n") if b.strip()][-1]
        assert last.startswith("event: error\ndata: ")
        error = json.loads(last.split("data: ", 1)[1])
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert "mid-stream" in error["error"]["message"] and "HTTP/1.1" not in rest
        assert "message_stop" not in rest
        thread.settle()
        assert thread.call(lambda rt: [s.slot_id for s in rt.coordinator.servers[0].slots if s.busy]) == []
    finally:
        thread.stop()


# ---- last: a proxy that hides cache information (one proxy per server) -------------------------


def test_every_prompt_was_the_servers(proxy: ProxyThread) -> None:
    """After all the above, the server computed each prompt at the proxy's length."""

    def sample(name: str, api: str) -> float:
        value = proxy.call(lambda rt: rt.metrics.registry.get_sample_value(name, {"api": api}))
        return float(value or 0.0)

    for api in ("messages", "responses"):
        assert sample("radix_api_requests_total", api) >= 2
        assert sample("radix_prompt_mismatch_total", api) == 0


def test_cache_information_hidden(backend: ServerProcess, proxy: ProxyThread) -> None:
    proxy.stop()
    hidden = ProxyThread(proxy_config(backend, cache_ram_mib=64, cache_info=False)).start()
    try:
        body = body_of("Name a word.", 4)
        for _ in range(2):
            reply = post(f"{hidden.url}/v1/messages", body, headers={"x-api-key": KEY})
            hidden.settle()
            assert reply.status == 200 and "cache_read_input_tokens" not in reply.body["usage"]
            assert not [h for h in reply.headers if h.lower().startswith("x-radix")]
        stream = post(f"{hidden.url}/v1/messages", {**body, "stream": True}, headers={"x-api-key": KEY})
        hidden.settle()
        assert "cache_read_input_tokens" not in stream.body and "message_stop" in stream.body
        for streamed in (False, True):
            r = post(
                f"{hidden.url}/v1/responses", {"input": "Say hi.", "max_output_tokens": 4, "stream": streamed}
            )
            hidden.settle()
            text = json.dumps(r.body)
            assert r.status == 200 and "cached_tokens" not in text and "timings" not in text
    finally:
        hidden.stop()
