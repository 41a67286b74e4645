"""Bounds on client connections: how many (in total and per client address), and the open-file
limit they need.

aiohttp bounds neither. Each connection costs a file descriptor, and with the usual limit of
1,024, 1,100 idle connections left the proxy unable to accept one more (``/health`` and chat
went unanswered). A connection past ``--max-connections`` or ``--max-connections-per-client``
is closed as soon as it is accepted, before it costs anything more.

How long a connection may sit idle, or take to send its request head, is aiohttp's
keep-alive timeout (``--idle-timeout``: see ``app.start_site``); the body has its own deadline
(``--body-timeout``, where handlers read it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import resource
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

log = logging.getLogger("radix")

# Descriptors kept free for everything that is not a client connection: server connections,
# payload and disk tier files, the log.
FD_RESERVE = 256


@dataclass
class ConnectionLimits:
    """Counts shared by every listening socket of one proxy. 0: no cap."""

    total: int
    per_client: int
    open: int = 0
    by_client: collections.Counter[str] = field(default_factory=collections.Counter)
    refused: int = 0

    def admit(self, client: str) -> bool:
        if (self.total and self.open >= self.total) or (
            self.per_client and self.by_client[client] >= self.per_client
        ):
            self.refused += 1
            return False
        self.open += 1
        self.by_client[client] += 1
        return True

    def release(self, client: str) -> None:
        self.open -= 1
        self.by_client[client] -= 1
        if self.by_client[client] <= 0:
            del self.by_client[client]  # the map holds only clients connected now


class _Guard(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the connection caps."""

    def __init__(self, inner: asyncio.Protocol, limits: ConnectionLimits) -> None:
        self._inner = inner
        self._limits = limits
        self._client: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self._limits.admit(client):
            # Never handed to aiohttp: no handler, no task; reset at once, not a lingering close.
            if isinstance(transport, asyncio.Transport):
                transport.abort()
            else:
                transport.close()
            return
        self._client = client
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._client is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._client is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._client is None:
            return
        self._limits.release(self._client)
        self._client = None
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._client is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._client is not None:
            self._inner.resume_writing()


class GuardedSite(web.BaseSite):
    """A TCP site like aiohttp's ``TCPSite`` whose connections pass ``ConnectionLimits``."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limits: ConnectionLimits) -> None:
        super().__init__(runner)
        self._host, self._port, self._limits = host, port, limits

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server: Any = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Guard(server(), self._limits), self._host, self._port, reuse_address=True
        )


def raise_file_limit(connections: int) -> int:
    """Raise the soft open-file limit to the hard one, so that ``connections`` client connections
    fit with ``FD_RESERVE`` to spare; returns the soft limit now, and warns when they do not fit."""
    want = connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit is not a value the kernel takes for the soft one: ask for enough.
    target = max(soft, want) if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning(
            "the open-file limit is %d, below the %d that --max-connections needs (%d kept for "
            "servers and files): raise it (ulimit -n) or lower --max-connections",
            soft,
            want,
            FD_RESERVE,
        )
    return soft
