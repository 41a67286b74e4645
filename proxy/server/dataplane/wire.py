"""Bytes from a llama-server, read one way everywhere: a stream cut into lines (SSE), and a
body that should be JSON but may not be (an error page, a proxy's HTML, a cut answer)."""

from __future__ import annotations

from typing import Any

import orjson


class LineSplitter:
    """A byte stream cut into lines, ``\\n`` dropped; the line not ended yet is carried over to
    the next chunk. It grows in place while no newline comes: a long line costs its length,
    not its square."""

    def __init__(self) -> None:
        self._partial = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines ``chunk`` ends (the carried part first)."""
        if b"\n" not in chunk:
            self._partial += chunk
            return []
        lines = (bytes(self._partial) + chunk).split(b"\n")
        self._partial = bytearray(lines.pop())
        return lines

    @property
    def pending(self) -> int:
        """Bytes of the line not ended yet."""
        return len(self._partial)

    def rest(self) -> bytes:
        """The line not ended yet (at the stream's end), taken out."""
        rest, self._partial = bytes(self._partial), bytearray()
        return rest


def json_or_error(raw: bytes, limit: int = 200) -> Any:
    """``raw`` as JSON; a body that is not JSON as llama-server's error shape, with its first
    ``limit`` bytes as the message."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"error": {"message": raw[:limit].decode(errors="replace")}}
