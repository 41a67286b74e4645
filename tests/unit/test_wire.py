"""proxy/server/dataplane/wire.py: the one line splitter of the streams and the one JSON-or-error reading
of a server's body."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.server.api.anthropic import convert_error
from proxy.server.dataplane.wire import LineSplitter, json_or_error

pytestmark = pytest.mark.unit

SERVER = Path(__file__).resolve().parents[2] / "proxy" / "server"


@given(st.binary(max_size=200), st.lists(st.integers(0, 200), max_size=6))
def test_lines_whatever_the_chunks(stream: bytes, cuts: list[int]) -> None:
    points = sorted({0, len(stream), *(min(c, len(stream)) for c in cuts)})
    splitter, lines = LineSplitter(), []
    for start, end in zip(points, points[1:], strict=False):
        lines += splitter.feed(stream[start:end])
        assert splitter.pending == len(stream[:end]) - (stream[:end].rfind(b"\n") + 1)
    assert lines + [splitter.rest()] == stream.split(b"\n")
    assert splitter.pending == 0 and splitter.rest() == b""


def test_a_long_line_is_carried_until_it_ends() -> None:
    splitter = LineSplitter()
    for _ in range(1000):
        assert splitter.feed(b"x" * 100) == []
    assert splitter.pending == 100_000
    assert splitter.feed(b"\ndata: 2\n") == [b"x" * 100_000, b"data: 2"]


def test_json_or_error() -> None:
    assert json_or_error(b'{"a": 1}') == {"a": 1}
    assert json_or_error(b"<html>" + b"x" * 300) == {"error": {"message": "<html>" + "x" * 194}}
    assert json_or_error(b"\xff oops", limit=3) == {"error": {"message": "\ufffd o"}}
    # Anthropic's error shape keeps 500 bytes of a body that is not JSON.
    assert b"x" * 494 + b'"' in convert_error(b"<html>" + b"x" * 600, 502)


def test_the_streams_split_lines_only_in_wire() -> None:
    splitting = [p.name for p in sorted(SERVER.rglob("*.py")) if 'split(b"\\n")' in p.read_text()]
    assert splitting == ["wire.py"], splitting
