"""The answer as the server wrote it: the shape ``forward`` relays when an API gives none.

Each client API's own shape derives from :class:`AnswerShape` (``proxy/server/api/shapes.py``).
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from proxy.server.http.front import SseStripper, strip_cache_info_raw


class Rewriter(Protocol):
    def feed(self, chunk: bytes) -> bytes: ...
    def flush(self) -> bytes: ...


def _loads(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


class AnswerShape:
    """The server's answer as it wrote it (OpenAI chat and completions, llama.cpp's own)."""

    api = "openai"

    def __init__(self, show: bool) -> None:
        self.show = show

    def timings(self, raw: bytes) -> dict[str, Any] | None:
        """The server's ``timings`` (``cache_n``, ``prompt_n``) of a non-streamed answer."""
        data = _loads(raw)
        timings = data.get("timings") if isinstance(data, dict) else None
        return timings if isinstance(timings, dict) else None

    def answer(self, raw: bytes, status: int) -> bytes:
        return raw if self.show else strip_cache_info_raw(raw)

    def stream(self) -> Rewriter | None:
        """What rewrites a streamed answer, None to pass it on unchanged."""
        return None if self.show else SseStripper()
