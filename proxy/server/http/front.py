"""What the proxy accepts from clients, and what it tells them (the trust boundary).

- Only paths that run a completion on a steered slot, and a short allowlist of read-only
  paths, reach a server; everything else (the /kvctl control API, /slots, POST /props,
  /lora-adapters, endpoints that would run on an unsteered slot) is answered 404 here.
- A request asks for one answer: ``n`` / ``n_cmpl`` above 1 would make the server put the
  extra choices on slots the proxy did not lease, so they are refused.
- Prompts given as token ids are checked (count, range) before anything iterates them.
- A cache-isolation key (like vLLM's ``cache_salt``) puts a request's KV in its own
  namespace: requests with different keys never reuse each other's KV.
- With cache information hidden, the answer carries no ``X-Radix-*`` cache headers and no
  ``timings`` (whose ``cache_n`` would tell a client exactly how much of its prompt some
  other request had cached).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from typing import Any

import numpy as np
import orjson

from proxy.config import Config
from proxy.errors import BadRequest
from proxy.server.dataplane.wire import LineSplitter
from proxy.server.http.limits import check_json_depth, maybe_deep

# Read-only paths passed to the first server unchanged (method, path).
READ_ONLY = {
    ("GET", "/v1/models"),
    ("GET", "/models"),
    ("GET", "/props"),
    ("GET", "/v1/health"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/apply-template"),
    ("POST", "/v1/chat/completions/input_tokens"),
    ("POST", "/chat/completions/input_tokens"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/responses/input_tokens"),
    ("POST", "/responses/input_tokens"),
}
# Paths llama-server serves that the proxy refuses, and why (the rest get a plain 404).
REFUSED = {
    "/v1/chat/completions/control": "the control endpoint is not available through the proxy",
}
OFF_LOOP_BYTES = 1 << 20  # bodies larger than this are parsed in a worker thread
SALT_FIELD = "cache_salt"
SALT_HEADER = "X-Cache-Salt"


def refusal(method: str, path: str) -> str | None:
    """Why ``method path`` is not served, or None when it is passed to a server."""
    if (method, path) in READ_ONLY:
        return None
    reason = REFUSED.get(path)
    return reason or f"{method} {path} is not served by the proxy"


async def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = _loads(raw) if len(raw) <= OFF_LOOP_BYTES else await asyncio.to_thread(_loads, raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _loads(raw: bytes) -> Any:
    body = orjson.loads(raw)
    if maybe_deep(raw):
        check_json_depth(body)
    return body


def check_one_answer(body: dict[str, Any]) -> None:
    for key in ("n", "n_cmpl"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(f"'{key}' must be a positive integer")
        if value > 1:
            raise BadRequest(f"'{key}' > 1 is not supported through the proxy: send {value} requests instead")


def prompt_token_ids(prompt: list[Any], n_vocab: int, n_ctx_slot: int) -> np.ndarray:
    """A prompt given as token ids, checked before it is iterated."""
    if len(prompt) >= n_ctx_slot:
        raise BadRequest(
            f"the request exceeds the available context size: {len(prompt)} prompt tokens, "
            f"{n_ctx_slot} per slot"
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise BadRequest("'prompt' must be a string or an array of token ids")
    # Checked on Python ints: an id of 2**63 or more does not fit numpy's int64 (it overflows).
    if prompt and (min(prompt) < 0 or max(prompt) >= n_vocab):
        bad = next(t for t in prompt if t < 0 or t >= n_vocab)
        raise BadRequest(f"invalid token id {bad} in 'prompt' (the vocabulary has {n_vocab} tokens)")
    return np.asarray(prompt, dtype=np.int32)


def cache_namespace(config: Config, body: dict[str, Any], headers: Any) -> str:
    """The request's cache-isolation namespace ("" when it names no key); pops ``cache_salt``.

    The parts are encoded as a JSON array of (source, value) pairs: no value can pose as two
    parts (joined by a separator, salt ``"a\nheader:b"`` equalled salt ``a`` plus header ``b``).
    Control characters in a key are refused outright: no real key has them."""
    parts = []
    salt = body.pop(SALT_FIELD, None)
    if salt is not None and not isinstance(salt, str):
        raise BadRequest(f"'{SALT_FIELD}' must be a string")
    sources = config.cache_isolation
    if "field" in sources and salt:
        parts.append(("salt", _key_text(salt, f"'{SALT_FIELD}'")))
    if "header" in sources and headers.get(SALT_HEADER):
        parts.append(("header", _key_text(headers[SALT_HEADER], SALT_HEADER)))
    key = api_key(headers)  # Authorization: Bearer, else Anthropic's x-api-key
    if "api-key" in sources and key:
        parts.append(("key", _key_text(key, "the API key")))
    if not parts:
        return ""
    return hashlib.sha256(orjson.dumps(parts)).hexdigest()[:32]


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _key_text(value: str, what: str) -> str:
    if _CONTROL.search(value):
        raise BadRequest(f"{what} must not contain control characters")
    return value


def api_key(headers: Any) -> str:
    """The client's API key as llama-server reads it: ``Authorization: Bearer KEY``, else
    Anthropic's ``x-api-key`` ("" when neither)."""
    auth = headers.get("Authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return str(auth[7:].strip())
    return str(headers.get("x-api-key", "")).strip()


# Request fields that would make the server report cache hits by other routes.
CACHE_REVEALING_FIELDS = ("return_progress", "response_fields")


def hide_cache_info_request(body: dict[str, Any]) -> None:
    for field in CACHE_REVEALING_FIELDS:
        body.pop(field, None)


def strip_cache_info(data: Any) -> Any:
    """The answer without what tells a client how much of its prompt was cached."""
    if isinstance(data, dict):
        for key in [k for k in data if k.startswith("timings") or k == "prompt_progress"]:
            del data[key]
        usage = data.get("usage")
        if isinstance(usage, dict):
            usage.pop("prompt_tokens_details", None)
    return data


def strip_cache_info_raw(raw: bytes) -> bytes:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw
    return orjson.dumps(strip_cache_info(data))


_REVEALING = (b'"timings', b'"prompt_tokens_details"', b'"prompt_progress"')


class SseStripper:
    """Rewrites an SSE stream line by line, dropping cache information from each event."""

    def __init__(self) -> None:
        self._lines = LineSplitter()

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(self._line(line) + b"\n" for line in self._lines.feed(chunk))

    def flush(self) -> bytes:
        rest = self._lines.rest()
        return self._line(rest) if rest else b""

    @staticmethod
    def _line(line: bytes) -> bytes:
        if line.startswith(b"data: ") and any(m in line for m in _REVEALING):
            return b"data: " + strip_cache_info_raw(line[6:])
        return line
