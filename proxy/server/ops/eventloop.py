"""The event loop the proxy runs on: uvloop when it is installed (``auto``), else asyncio's.

The proxy's time on a miss is mostly event-loop work around two local HTTP hops (the
client's request, the upstream POST, the relayed stream): uvloop (libuv) does the socket
reads, writes and wake-ups in C where asyncio's selector loop does them in Python. Both run
the same code; nothing in the proxy depends on which one it is (docs/bench.md, "overhead").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from proxy.errors import ConfigError

EventLoopKind = Literal["auto", "uvloop", "asyncio"]
EVENT_LOOPS: tuple[EventLoopKind, ...] = ("auto", "uvloop", "asyncio")

T = TypeVar("T")


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes a new loop of ``kind``; ``uvloop`` when it is not installed is a ConfigError,
    ``auto`` falls back to asyncio's loop."""
    if kind not in EVENT_LOOPS:
        raise ConfigError(f"unknown event loop {kind!r}: one of {', '.join(EVENT_LOOPS)}")
    if kind == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError as exc:
        if kind == "auto":
            return asyncio.new_event_loop
        raise ConfigError(
            "--event-loop uvloop: uvloop is not installed", fix="pip install uvloop, or --event-loop asyncio"
        ) from exc
    return uvloop.new_event_loop


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    return loop_factory(kind)()


def run(coro: Coroutine[Any, Any, T], kind: str) -> T:
    """``asyncio.run`` on a loop of ``kind``."""
    with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
        return runner.run(coro)


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``, for the startup log line."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
