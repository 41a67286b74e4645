"""Bounds on what one request may make a server (and the proxy) spend, checked before it is sent.

- Log-probabilities: llama-server caps ``n_probs`` only at the vocabulary, so a 94-byte request
  can ask for an answer of hundreds of MiB. OpenAI's limit (20) is the default here.
- Grammars and JSON schemas: the server parses a GBNF grammar and converts a schema to one
  with recursive code; a grammar nested 100,000 deep or a chain of 200,000 rules overflows its
  stack and kills the process. Their size, nesting and rule count are bounded here.
- JSON nesting: orjson reads 1,024 levels but writes only 254, and the proxy writes every body
  again when it forwards it; deeper bodies are refused here instead of failing later.

Each refusal is a 400 in the API's error shape, before any slot is leased.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import orjson

from proxy.config import Config
from proxy.errors import BadRequest

# orjson.dumps refuses 255 levels and more: what the proxy cannot forward, it refuses.
MAX_JSON_DEPTH = 254
# OpenAI's logprobs field is a bool on chat (with top_logprobs the count) and a count on the
# legacy completions API; llama.cpp takes n_probs, and logprobs as its alias.
LOGPROB_FIELDS = ("n_probs", "top_logprobs", "logprobs")
SERVER_DEFAULT_TOP_LOGPROBS = 20  # what the server asks for on `logprobs: true` alone
# Where a JSON schema the server turns into a grammar can come from.
SCHEMA_FIELDS = ("json_schema", "response_format", "tools")
# What is not grammar structure: string literals, character classes, comments.
_GBNF_OPAQUE = re.compile(rb'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*')


def check_json_depth(body: dict[str, Any]) -> None:
    """400 for a body nested deeper than the proxy can write again."""
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError as exc:
        raise BadRequest(f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from exc


def maybe_deep(raw: bytes) -> bool:
    """Cheap guard (C speed): only a body with that many brackets can be that deep."""
    return raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH


def check_logprobs(config: Config, body: dict[str, Any]) -> None:
    limit = config.max_logprobs
    for key in LOGPROB_FIELDS:
        value = body.get(key)
        if value is None or isinstance(value, bool):
            continue
        if not isinstance(value, int) or value < 0:
            raise BadRequest(f"'{key}' must be a non-negative integer")
        if value > limit:
            raise BadRequest(
                f"'{key}' is {value}: at most {limit} log-probabilities per token are served (--max-logprobs)"
            )
    if (
        body.get("logprobs") is True
        and body.get("top_logprobs") is None
        and limit < SERVER_DEFAULT_TOP_LOGPROBS
    ):
        body["top_logprobs"] = limit  # else the server's default of 20 applies


def check_grammar(config: Config, body: dict[str, Any]) -> None:
    grammar = body.get("grammar")
    if grammar is not None:
        if not isinstance(grammar, str):
            raise BadRequest("'grammar' must be a string")
        check_gbnf(config, grammar.encode())
    for key in SCHEMA_FIELDS:
        value = body.get(key)
        if value is None:
            continue
        if key != "tools" and len(orjson.dumps(value)) > config.max_grammar_bytes:
            raise BadRequest(f"'{key}' is larger than {config.max_grammar_bytes} bytes (--max-grammar)")
        if json_deeper_than(value, config.max_grammar_depth):
            raise BadRequest(
                f"'{key}' is nested deeper than {config.max_grammar_depth} levels (--max-grammar-depth)"
            )


def check_gbnf(config: Config, grammar: bytes) -> None:
    if len(grammar) > config.max_grammar_bytes:
        raise BadRequest(f"'grammar' is larger than {config.max_grammar_bytes} bytes (--max-grammar)")
    structure = _GBNF_OPAQUE.sub(b"", grammar)
    rules = structure.count(b"::=")
    if rules > config.max_grammar_rules:
        raise BadRequest(
            f"'grammar' has {rules} rules: at most {config.max_grammar_rules} (--max-grammar-rules)"
        )
    if gbnf_depth(structure) > config.max_grammar_depth:
        raise BadRequest(
            f"'grammar' nests groups deeper than {config.max_grammar_depth} levels (--max-grammar-depth)"
        )


def gbnf_depth(structure: bytes) -> int:
    """Deepest parenthesis nesting of a grammar with its literals removed (vectorized: a
    grammar may be hundreds of KiB and this runs on the event loop)."""
    chars = np.frombuffer(structure, dtype=np.uint8)
    steps = (chars == ord("(")).astype(np.int32) - (chars == ord(")")).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


def json_deeper_than(value: Any, limit: int) -> bool:
    """Whether a JSON value nests more than ``limit`` arrays/objects (iterative: no recursion
    on client input)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def check_request(config: Config, body: dict[str, Any]) -> None:
    """Every bound on a steered request's fields."""
    check_logprobs(config, body)
    check_grammar(config, body)
