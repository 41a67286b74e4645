"""The agent APIs' pure parts: the server's Anthropic and Responses conversions mirrored, the
chat answer written as Anthropic's (body and events), cache information stripped."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from proxy.errors import BadRequest, TooLarge, Unavailable
from proxy.server.api import anthropic, responses
from proxy.server.api.anthropic_stream import EventStream
from proxy.server.api.shapes import AnthropicShape, ResponsesShape, strip_deep
from proxy.server.http.front import api_key

pytestmark = pytest.mark.unit


def test_system_and_text_blocks_as_the_server_converts_them() -> None:
    body = {
        "model": "claude-x",
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2; cch=a5145; You are Claude.\n",
            },
            {"type": "image", "source": {}},
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "doc", "cache_control": {"type": "ephemeral"}}],
            },
        ],
        "stop_sequences": ["END"],
        "temperature": 0,
        "top_k": 1,
        "cache_salt": "s",
        "metadata": {"user_id": "u1"},
        "thinking": {"type": "enabled", "budget_tokens": 512},
    }
    chat = anthropic.to_chat(body)
    assert chat["messages"] == [
        {
            "role": "system",
            "content": "x-anthropic-billing-header: cc_version=2; cch=fffff; You are Claude.\nBe brief.",
        },
        {"role": "user", "content": "hi"},
        # The whole block is passed on, cache_control and all, as the server does.
        {
            "role": "user",
            "content": [{"type": "text", "text": "doc", "cache_control": {"type": "ephemeral"}}],
        },
    ]
    assert chat["stop"] == ["END"] and chat["max_tokens"] == anthropic.DEFAULT_MAX_TOKENS
    assert chat["temperature"] == 0 and chat["top_k"] == 1
    assert chat["thinking_budget_tokens"] == 512 and chat["__metadata_user_id"] == "u1"
    assert "model" not in chat and "cache_salt" not in chat and "metadata" not in chat
    forwarded = anthropic.forward_body(chat, body)
    assert forwarded["cache_salt"] == "s" and forwarded["verbose"] is True  # stop word wanted
    assert "stream_options" not in forwarded


def test_tool_blocks_as_the_server_converts_them() -> None:
    body = {
        "max_tokens": 9,
        "stream": True,
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}, {"name": "g"}],
        "tool_choice": {"type": "any"},
        "messages": [
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"b": 1, "a": "é"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "2"}],
                    },
                    {"type": "tool_result", "tool_use_id": "t2", "content": "plain"},
                    {"type": "tool_result", "tool_use_id": "t3"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t4",
                        "content": [{"type": "image", "source": {"type": "url", "url": "http://i"}}],
                    },
                ],
            },
            {"role": "assistant"},
        ],
    }
    chat = anthropic.to_chat(body)
    assert chat["messages"] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"b":1,"a":"é"}'}}
            ],
            "reasoning_content": "hmm",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "tool", "tool_call_id": "t2", "content": "plain"},
        {"role": "tool", "tool_call_id": "t3", "content": ""},
        {
            "role": "tool",
            "tool_call_id": "t4",
            "content": [{"type": "image_url", "image_url": {"url": "http://i"}}],
        },
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g", "description": "", "parameters": {}}},
    ]
    assert chat["tool_choice"] == "required" and chat["max_tokens"] == 9
    forwarded = anthropic.forward_body(chat, body)
    assert forwarded["stream_options"] == {"include_usage": True} and forwarded["timings_per_token"] is True
    assert "verbose" not in forwarded


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 4},
        {"messages": "hi"},
        {"messages": []},
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    ],
)
def test_bodies_the_server_cannot_answer_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        anthropic.to_chat(body)


def chat_answer(**msg: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "model": "m",
        "choices": [{"finish_reason": msg.pop("finish", "stop"), "message": {"role": "assistant", **msg}}],
        "usage": {
            "prompt_tokens": 30,
            "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 20},
        },
        "timings": {"cache_n": 20, "prompt_n": 10},
        "__verbose": {"stopping_word": "END"},
    }


def test_a_chat_answer_as_an_anthropic_message() -> None:
    answer = chat_answer(
        content="hello",
        reasoning_content="think",
        finish="tool_calls",
        tool_calls=[
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
        ],
    )
    message = anthropic.message_of(answer, show=True)
    assert message["content"] == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "hello"},
        {"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 1}},
        {"type": "tool_use", "id": "c2", "name": "g", "input": {}},
    ]
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] == "END"
    assert message["usage"] == {"cache_read_input_tokens": 20, "input_tokens": 10, "output_tokens": 5}
    hidden = anthropic.message_of(chat_answer(content="x", finish="length"), show=False)
    assert (
        hidden["usage"] == {"input_tokens": 30, "output_tokens": 5} and hidden["stop_reason"] == "max_tokens"
    )
    shaped = orjson.loads(AnthropicShape(False, 30).answer(orjson.dumps(answer), 200))
    assert "timings" not in json.dumps(shaped) and "__verbose" not in shaped


def test_errors_in_anthropic_shape() -> None:
    raw = orjson.dumps({"error": {"code": 400, "message": "too long", "type": "exceed_context_size_error"}})
    assert orjson.loads(AnthropicShape(True, 1).answer(raw, 400)) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "too long"},
    }
    assert anthropic.error_of(TooLarge("big"))["error"]["type"] == "request_too_large"
    assert anthropic.error_of(Unavailable("busy"))["error"]["type"] == "overloaded_error"
    assert anthropic.error_body(500, "x", "server_error")["error"]["type"] == "api_error"
    assert orjson.loads(anthropic.convert_error(b"oops", 502))["error"]["message"] == "oops"


def sse(*chunks: dict[str, Any] | str) -> bytes:
    return b"".join(
        b"data: " + (c.encode() if isinstance(c, str) else orjson.dumps(c)) + b"\n\n" for c in chunks
    )


def delta(d: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": "cc", "model": "m", "choices": [{"index": 0, "finish_reason": finish, "delta": d}], **extra}


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            head, data = block.split("\n", 1)
            out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


TIMINGS = {"cache_n": 12, "prompt_n": 3}
STREAM = sse(
    delta({"role": "assistant", "content": None}),
    delta({"reasoning_content": "hm"}, timings=TIMINGS),
    delta({"content": "Hel"}, timings=TIMINGS),
    delta({"content": "lo"}, timings=TIMINGS),
    delta({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f"}}]}),
    delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
    delta({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
    delta({}, "tool_calls", __verbose={"stopping_word": ""}),
    {"id": "cc", "choices": [], "usage": {"completion_tokens": 7, "prompt_tokens": 15}, "timings": TIMINGS},
    "[DONE]",
)


@pytest.mark.parametrize("cut", [1, 7, 100, len(STREAM)])
def test_a_chat_stream_as_anthropic_events(cut: int) -> None:
    stream = EventStream(show=True, prompt_tokens=15)
    raw = b"".join(stream.feed(STREAM[i : i + cut]) for i in range(0, len(STREAM), cut)) + stream.flush()
    got = events(raw)
    assert [(name, data.get("index")) for name, data in got] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_delta", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 0),  # the thinking block's signature
        ("content_block_stop", 0),
        ("content_block_stop", 1),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    start = got[0][1]["message"]
    assert start["id"] == "cc" and start["usage"] == {
        "cache_read_input_tokens": 12,
        "input_tokens": 3,
        "output_tokens": 0,
    }
    assert got[6][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f"}
    assert "".join(d.get("delta", {}).get("partial_json", "") for _, d in got) == '{"a":1}'
    assert got[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert got[-2][1]["usage"] == {"output_tokens": 7}


def test_hidden_cache_information_in_events() -> None:
    stream = EventStream(show=False, prompt_tokens=15)
    raw = stream.feed(STREAM) + stream.flush()
    assert b"cache_read" not in raw and b"timings" not in raw
    assert events(raw)[0][1]["message"]["usage"] == {"input_tokens": 15, "output_tokens": 0}


def test_a_fault_mid_stream_ends_with_an_anthropic_error_event() -> None:
    stream = EventStream(show=True, prompt_tokens=5)
    broken = (
        sse(delta({"content": "Hi"}, timings=TIMINGS))
        + b'data: {"error": {"code": 502, "message": "gone", "type": "server_error"}}\n\n'
    )
    got = events(stream.feed(broken) + stream.feed(sse(delta({"content": "more"}))) + stream.flush())
    assert got[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "gone"}})
    assert [name for name, _ in got].count("error") == 1 and "message_stop" not in [n for n, _ in got]
    # A stream that just ends before the answer's end: an error event too.
    cut = EventStream(show=True, prompt_tokens=5)
    tail = events(cut.feed(sse(delta({"content": "Hi"}))) + cut.flush())
    assert tail[-1][0] == "error" and tail[-1][1]["error"]["type"] == "api_error"


def test_stop_sequence_from_the_verbose_block() -> None:
    stream = EventStream(show=True, prompt_tokens=5)
    raw = stream.feed(
        sse(delta({"content": "a"}), delta({}, "stop", __verbose={"stopping_word": "END"}), "[DONE]")
    )
    got = events(raw + stream.flush())
    assert got[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": "END"}


def test_responses_input_as_the_server_converts_it() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "q1"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "a1"}],
                "status": "completed",
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"role": "developer", "content": [{"type": "input_text", "text": "d"}]},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {}}, {"type": "web_search"}],
        "max_output_tokens": 7,
        "reasoning": {"effort": "low"},
        "stream": True,
    }
    chat = responses.to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"text": "q1", "type": "text"}]},
        {
            "role": "assistant",
            "content": [{"text": "a1", "type": "text"}],
            "tool_calls": [{"function": {"arguments": "{}", "name": "f"}, "id": "c1", "type": "function"}],
        },
        {"content": "42", "role": "tool", "tool_call_id": "c1"},
        {"role": "developer", "content": [{"text": "d", "type": "text"}]},
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {}, "strict": True}}
    ]
    assert chat["max_tokens"] == 7 and chat["reasoning_effort"] == "low" and chat["stream"] is True
    assert not {"input", "instructions", "max_output_tokens", "reasoning"} & set(chat)
    assert body["input"][0]["content"] == "q1"  # the client's body is left as it was
    assert responses.to_chat({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "'input' is required"),
        ({"input": "x", "previous_response_id": "r1"}, "llama.cpp does not support 'previous_response_id'."),
        ({"input": 3}, "'input' must be a string or array of objects"),
        ({"input": [{"type": "nonsense"}]}, "Cannot determine type of 'item'"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "'input_file' is not supported"),
        ({"input": "x", "tools": {}}, "'tools' must be an array of objects"),
    ],
)
def test_responses_bodies_the_server_rejects(body: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message.replace("(", r"\(").replace(".", r"\.")):
        responses.to_chat(body)


def test_responses_cache_information_stripped_at_any_depth() -> None:
    answer = {
        "usage": {"input_tokens": 30, "input_tokens_details": {"cached_tokens": 20}},
        "response": {"usage": {"input_tokens_details": {"cached_tokens": 1}}},
        "timings": {"cache_n": 20},
    }
    shape = ResponsesShape(show=False)
    assert shape.timings(orjson.dumps(answer)) == {"cache_n": 20}
    del answer["timings"]
    assert shape.timings(orjson.dumps(answer)) == {"cache_n": 20, "prompt_n": 10}
    assert b"cached" not in shape.answer(orjson.dumps(answer), 200)
    stripper = shape.stream()
    assert stripper is not None
    line = b"event: response.completed\ndata: " + orjson.dumps({"data": answer, "timings": {}}) + b"\n\n"
    out = stripper.feed(line[:20]) + stripper.feed(line[20:]) + stripper.flush()
    assert b"cached" not in out and b"timings" not in out and b"event: response.completed" in out
    assert strip_deep([{"prompt_progress": 1, "x": [{"timings_x": 2}]}]) == [{"x": [{}]}]


def test_x_api_key_is_the_api_key() -> None:
    assert api_key({"x-api-key": " k1 "}) == "k1"
    assert api_key({"Authorization": "Bearer k2", "x-api-key": "k1"}) == "k2"
    assert api_key({"Authorization": "Basic zzz"}) == ""


def test_a_prompt_the_server_counted_otherwise_is_counted() -> None:
    from prometheus_client import CollectorRegistry

    from proxy.server.api.shapes import check_prompt_count
    from proxy.server.metrics import Metrics

    metrics = Metrics(CollectorRegistry(), ("s0",))
    assert check_prompt_count(metrics, "responses", 15, {"cache_n": 12, "prompt_n": 3}, "r1")
    assert check_prompt_count(metrics, "responses", 15, None, "r2")  # the server did not say
    assert not check_prompt_count(metrics, "responses", 15, {"cache_n": 12, "prompt_n": 4}, "r3")
    sample = metrics.registry.get_sample_value("radix_prompt_mismatch_total", {"api": "responses"})
    assert sample == 1.0
