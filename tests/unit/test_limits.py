"""Bounds on a request's fields: log-probabilities, grammars, JSON schemas, JSON nesting."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.config import Config
from proxy.errors import BadRequest
from proxy.server.http import limits
from proxy.server.http.front import parse_json

pytestmark = pytest.mark.unit

CONFIG = Config(backends=("http://x",))


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


ACCEPTED = [
    {"n_probs": 20},
    {"logprobs": True, "top_logprobs": 20},
    {"logprobs": True},
    {"logprobs": 5},  # the legacy completions API: a count
    {"logprobs": False, "top_logprobs": None},
    {"grammar": 'root ::= ("yes" | "no") "."\n'},
    {"grammar": 'root ::= "(((((" [()]+ # (((((((\n'},  # parentheses in literals and comments
    {"json_schema": nested_schema(20)},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": nested_schema(20)}}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": nested_schema(20)}}]},
]
REFUSED = [
    ({"n_probs": 21}, "--max-logprobs"),
    ({"n_probs": 49152}, "--max-logprobs"),
    ({"logprobs": True, "top_logprobs": 1000}, "--max-logprobs"),
    ({"logprobs": 100}, "--max-logprobs"),
    ({"n_probs": -1}, "non-negative integer"),
    ({"top_logprobs": 2.5}, "non-negative integer"),
    ({"grammar": 7}, "must be a string"),
    ({"grammar": "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000}, "--max-grammar"),
    ({"grammar": "root ::= " + "(" * 200 + '"a"' + ")" * 200}, "--max-grammar-depth"),
    (
        {"grammar": "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(5000))},
        "--max-grammar-rules",
    ),
    ({"json_schema": nested_schema(100)}, "--max-grammar-depth"),
    ({"json_schema": {"enum": ["x" * 1000] * 300}}, "--max-grammar"),
    ({"response_format": {"type": "json_object", "schema": nested_schema(100)}}, "--max-grammar-depth"),
    ({"tools": [{"function": {"name": "f", "parameters": nested_schema(100)}}]}, "--max-grammar-depth"),
]


@pytest.mark.parametrize("body", ACCEPTED)
def test_well_behaved_fields_pass(body: dict[str, Any]) -> None:
    limits.check_request(CONFIG, dict(body))


@pytest.mark.parametrize(("body", "why"), REFUSED)
def test_bombs_and_amplifiers_are_refused(body: dict[str, Any], why: str) -> None:
    with pytest.raises(BadRequest, match=why):
        limits.check_request(CONFIG, body)


def test_a_lower_logprobs_cap_also_caps_the_servers_default() -> None:
    body: dict[str, Any] = {"messages": [], "logprobs": True}
    limits.check_request(Config(backends=("http://x",), max_logprobs=5), body)
    assert body["top_logprobs"] == 5


def test_gbnf_depth_ignores_literals() -> None:
    assert limits.gbnf_depth(limits._GBNF_OPAQUE.sub(b"", b'a ::= ((b) "((((" [(]) # ((((')) == 2


@pytest.mark.parametrize("depth", [255, 256, 600, 1024])
def test_json_nested_past_what_the_proxy_can_forward_is_a_400(depth: int) -> None:
    raw = b'{"a": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    with pytest.raises(BadRequest, match="nested too deeply"):
        asyncio.run(parse_json(raw))


def test_json_nested_as_deep_as_the_proxy_can_forward_passes() -> None:
    depth = limits.MAX_JSON_DEPTH
    raw = b'{"a": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    assert asyncio.run(parse_json(raw))["a"]
