"""The trust boundary's pure rules: which paths pass, one answer per request, token-id
prompts, cache-isolation keys, and hiding cache information from clients."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config import Config
from proxy.errors import BadRequest
from proxy.server.http import front

pytestmark = pytest.mark.unit

CONFIG = Config(backends=("http://x",))


@pytest.mark.parametrize(
    ("method", "path", "passes"),
    [
        ("GET", "/v1/models", True),
        ("GET", "/props", True),
        ("POST", "/tokenize", True),
        ("POST", "/detokenize", True),
        ("POST", "/apply-template", True),
        ("POST", "/props", False),
        ("GET", "/slots", False),
        ("POST", "/slots/0", False),
        ("GET", "/kvctl/slots", False),
        ("POST", "/kvctl/erase", False),
        ("OPTIONS", "/kvctl/erase", False),
        ("POST", "/kvctl/import", False),
        ("GET", "/lora-adapters", False),
        ("POST", "/lora-adapters", False),
        ("POST", "/v1/messages", False),
        ("POST", "/v1/responses", False),
        ("POST", "/infill", False),
        ("POST", "/v1/chat/completions/control", False),
        ("POST", "/embeddings", False),
        ("POST", "/v1/embeddings", False),
        ("POST", "/v1/rerank", False),
        ("POST", "/v1/messages/count_tokens", True),
        ("POST", "/v1/responses/input_tokens", True),
        ("GET", "/metrics/../kvctl/slots", False),
        ("GET", "/v1/stream", False),
    ],
)
def test_only_the_read_only_allowlist_passes(method: str, path: str, passes: bool) -> None:
    assert (front.refusal(method, path) is None) == passes


def test_slot_endpoints_are_steered_not_refused() -> None:
    steered_paths = ("/infill", "/v1/embeddings", "/embeddings", "/embedding", "/v1/rerank", "/rerank")
    for steered in (*steered_paths, "/reranking", "/v1/reranking"):
        assert steered not in front.REFUSED  # proxy/server/api/infill.py, proxy/server/api/embeddings.py


@pytest.mark.parametrize("body", [{"n": 2}, {"n_cmpl": 3}, {"n": 0}, {"n": "2"}, {"n": True}, {"n": 1.5}])
def test_more_than_one_answer_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        front.check_one_answer(body)


def test_one_answer_passes() -> None:
    front.check_one_answer({"n": 1})
    front.check_one_answer({})


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([1, 2, 70_000], "invalid token id 70000"),
        ([-1, 2], "invalid token id -1"),
        ([1, 2**63], f"invalid token id {2**63}"),  # past int64: overflowed to a 500 before
        ([-(2**63) - 1, 2], "invalid token id"),
        ([1, "a"], "array of token ids"),
        ([1, True], "array of token ids"),
        (list(range(100)), "exceeds the available context size"),
    ],
)
def test_bad_token_prompts(prompt: list[Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        front.prompt_token_ids(prompt, n_vocab=49_152, n_ctx_slot=64)


def test_token_prompt_passes() -> None:
    assert front.prompt_token_ids([0, 5, 49_151], n_vocab=49_152, n_ctx_slot=64).tolist() == [0, 5, 49_151]


def test_an_oversized_token_prompt_is_refused_before_it_is_read() -> None:
    class Exploding(list):
        def __iter__(self) -> Any:
            raise AssertionError("iterated")

    with pytest.raises(BadRequest, match="context size"):
        front.prompt_token_ids(Exploding([0] * 1000), n_vocab=10, n_ctx_slot=64)


def test_cache_namespace_sources() -> None:
    headers: dict[str, str] = {}
    assert front.cache_namespace(CONFIG, {}, headers) == ""
    body = {"cache_salt": "tenant-a", "messages": []}
    a = front.cache_namespace(CONFIG, body, headers)
    assert a and "cache_salt" not in body  # the key is not forwarded to the server
    assert front.cache_namespace(CONFIG, {"cache_salt": "tenant-b"}, headers) != a
    assert front.cache_namespace(CONFIG, {"cache_salt": "tenant-a"}, headers) == a
    by_header = front.cache_namespace(CONFIG, {}, {"X-Cache-Salt": "tenant-a"})
    by_key = front.cache_namespace(CONFIG, {}, {"Authorization": "Bearer sk-1"})
    assert len({a, by_header, by_key, ""}) == 4
    assert front.cache_namespace(CONFIG, {}, {"Authorization": "Bearer sk-2"}) != by_key
    off = Config(backends=("http://x",), cache_isolation=())
    assert front.cache_namespace(off, {"cache_salt": "x"}, {"Authorization": "Bearer k"}) == ""
    only_field = Config(backends=("http://x",), cache_isolation=("field",))
    assert front.cache_namespace(only_field, {}, {"Authorization": "Bearer k"}) == ""
    with pytest.raises(BadRequest):
        front.cache_namespace(CONFIG, {"cache_salt": 5}, headers)


def test_a_composite_isolation_key_is_unambiguous() -> None:
    # Joined by a newline, salt "a\nheader:b" was the same key as salt "a" and header "b".
    both = front.cache_namespace(CONFIG, {"cache_salt": "a"}, {"X-Cache-Salt": "b"})
    assert front.cache_namespace(CONFIG, {"cache_salt": 'a"],["header","b'}, {}) != both
    for salt in ("a\nheader:b", "a\x00", "tab\there", "del\x7f"):
        with pytest.raises(BadRequest, match="control characters"):
            front.cache_namespace(CONFIG, {"cache_salt": salt}, {})
    with pytest.raises(BadRequest, match="control characters"):
        front.cache_namespace(CONFIG, {}, {"X-Cache-Salt": "a\tb"})


def test_strip_cache_info() -> None:
    raw = orjson.dumps(
        {
            "choices": [],
            "timings": {"cache_n": 90, "prompt_n": 10},
            "usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 90}},
        }
    )
    out = orjson.loads(front.strip_cache_info_raw(raw))
    assert "timings" not in out and out["usage"] == {"prompt_tokens": 100}
    assert front.strip_cache_info_raw(b"not json") == b"not json"


@settings(max_examples=50, deadline=None)
@given(cut=st.lists(st.integers(1, 200), max_size=8))
def test_sse_stripper_any_chunking(cut: list[int]) -> None:
    events = [
        b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n',
        b'data: {"choices":[],"timings":{"cache_n":42,"prompt_n":3}}\n\n',
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)
    stripper, out, pos = front.SseStripper(), b"", 0
    for n in cut:
        out += stripper.feed(stream[pos : pos + n])
        pos += n
    out += stripper.feed(stream[pos:]) + stripper.flush()
    assert b"cache_n" not in out and b'"content":"hi"' in out and out.endswith(b"data: [DONE]\n\n")


def test_parse_json() -> None:
    assert asyncio.run(front.parse_json(b'{"a": 1}')) == {"a": 1}
    big = orjson.dumps({"x": "y" * (front.OFF_LOOP_BYTES + 10)})
    assert len(asyncio.run(front.parse_json(big))["x"]) == front.OFF_LOOP_BYTES + 10
    for bad in (b"[1]", b"nope", b'"s"'):
        with pytest.raises(BadRequest):
            asyncio.run(front.parse_json(bad))


def test_no_other_route_reveals_cache_hits_when_hidden() -> None:
    body = {"messages": [], "return_progress": True, "response_fields": ["timings/cache_n"], "stream": True}
    front.hide_cache_info_request(body)
    assert body == {"messages": [], "stream": True}
    raw = orjson.dumps({"timings/cache_n": 90, "prompt_progress": {"cache": 90}, "content": "x"})
    assert orjson.loads(front.strip_cache_info_raw(raw)) == {"content": "x"}
    stripper = front.SseStripper()
    out = (
        stripper.feed(b'data: {"prompt_progress":{"total":100,"cache":90,"processed":95}}\n\n')
        + stripper.flush()
    )
    assert b"cache" not in out


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1:8080", True),
        ("localhost", True),
        ("LOCALHOST:1", True),
        ("[::1]:8080", True),
        ("127.8.9.10", True),
        ("evil.example:8080", False),
        ("localhost.evil.example", False),
        ("10.0.0.1:8080", False),
        ("", False),
    ],
)
def test_admin_rule_names_this_host_by_a_loopback_name(host: str, loopback: bool) -> None:
    from proxy.server.ops.admin import loopback_host

    assert loopback_host(host) is loopback
