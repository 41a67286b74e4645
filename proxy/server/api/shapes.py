"""The shape of an answer on its way back to the client, one per API.

:class:`AnswerShape` (``proxy/server/http/answer.py``) is the OpenAI / llama-server shape the
server already writes: the answer is passed on, with cache information stripped when it is
hidden (``--cache-info off``). :class:`AnthropicShape` rewrites a chat answer as Anthropic Messages
(``proxy/server/api/anthropic.py``); :class:`ResponsesShape` passes the server's Responses
answer on and strips every field that tells how much of the prompt was cached.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from proxy.server.api.anthropic import convert_error, message_of
from proxy.server.api.anthropic_stream import EventStream
from proxy.server.dataplane.wire import LineSplitter
from proxy.server.http.answer import AnswerShape, Rewriter, _loads
from proxy.server.metrics import Metrics

log = logging.getLogger("radix")


class AnthropicShape(AnswerShape):
    """A chat answer written as an Anthropic Messages answer or event stream."""

    api = "anthropic"

    def __init__(self, show: bool, prompt_tokens: int) -> None:
        super().__init__(show)
        self.prompt_tokens = prompt_tokens

    def answer(self, raw: bytes, status: int) -> bytes:
        if status >= 400:
            return convert_error(raw, status)
        data = _loads(raw)
        if not isinstance(data, dict):
            return convert_error(raw, 502)
        return orjson.dumps(message_of(data, self.show))

    def stream(self) -> Rewriter:
        return EventStream(self.show, self.prompt_tokens)


# Fields of the Responses API's answers and events that tell how much of the prompt was cached.
_REVEALING = ("timings", "prompt_progress", "input_tokens_details", "prompt_tokens_details")
_MARKS = tuple(f'"{k}"'.encode() for k in _REVEALING)


def strip_deep(data: Any) -> Any:
    """``data`` without any cache-revealing field, at any depth."""
    if isinstance(data, dict):
        for key in [k for k in data if k in _REVEALING or k.startswith("timings")]:
            del data[key]
        for value in data.values():
            strip_deep(value)
    elif isinstance(data, list):
        for value in data:
            strip_deep(value)
    return data


class _DeepStripper:
    def __init__(self) -> None:
        self._lines = LineSplitter()

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(self._line(line) + b"\n" for line in self._lines.feed(chunk))

    def flush(self) -> bytes:
        rest = self._lines.rest()
        return self._line(rest) if rest else b""

    @staticmethod
    def _line(line: bytes) -> bytes:
        if line.startswith(b"data: ") and any(m in line for m in _MARKS):
            data = _loads(line[6:])
            if data is not None:
                return b"data: " + orjson.dumps(strip_deep(data))
        return line


class ResponsesShape(AnswerShape):
    """The server's own Responses answer; its cached-token counts stand in for ``timings``."""

    api = "responses"

    def timings(self, raw: bytes) -> dict[str, Any] | None:
        found = super().timings(raw)
        if found is not None:
            return found
        data = _loads(raw)
        use = data.get("usage") if isinstance(data, dict) else None
        if not isinstance(use, dict):
            return None
        cached = int((use.get("input_tokens_details") or {}).get("cached_tokens", 0))
        return {"cache_n": cached, "prompt_n": int(use.get("input_tokens", 0)) - cached}

    def answer(self, raw: bytes, status: int) -> bytes:
        if self.show:
            return raw
        data = _loads(raw)
        return raw if data is None else orjson.dumps(strip_deep(data))

    def stream(self) -> Rewriter | None:
        return None if self.show else _DeepStripper()


def check_prompt_count(
    metrics: Metrics, api: str, tokens: int, timings: dict[str, Any] | None, request_id: str
) -> bool:
    """Whether the server computed a prompt as long as the proxy's tokens for it. One that
    differs (an API conversion, template or tokenizer that is not the server's) costs cache
    hits, never correctness: counted in ``radix_prompt_mismatch`` and logged."""
    if not timings or "cache_n" not in timings or "prompt_n" not in timings:
        return True
    served = int(timings["cache_n"]) + int(timings["prompt_n"])
    if served == tokens:
        return True
    metrics.prompt_mismatch.labels(api).inc()
    log.warning(
        "request %s (%s): the server's prompt has %d tokens, the proxy's %d: the cache matched less",
        request_id,
        api,
        served,
        tokens,
    )
    return False
