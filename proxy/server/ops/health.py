"""Health of every server: who may get new requests, and who came back as a new process.

Every ``health_interval_s`` each server is asked ``GET /health`` and ``GET /kvctl/caps``
(under ``health_timeout_s``). A server that does not answer, or answers an error, is taken
out of routing; when it answers again it is put back, and if its instance id changed (it
restarted) its slot table and resident index are reset. A server that comes back with
another model or KV layout, or that no longer says where its KV lives while its moves are on,
is kept out, with a log line saying why; one whose KV moved (another device) is followed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp

from proxy.errors import RadixError
from proxy.server.coordinator import Coordinator, KvPlace, ServerState
from proxy.server.dataplane.kvctl import Caps

log = logging.getLogger("radix")


class HealthMonitor:
    def __init__(
        self,
        coordinator: Coordinator,
        interval_s: float,
        timeout_s: float,
        connect_pending: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.connect_pending = connect_pending  # servers that did not answer at startup
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(s) for s in list(self.coordinator.servers)))
        if self.connect_pending is not None:
            await self.connect_pending()

    async def check(self, server: ServerState) -> None:
        """Liveness from GET /health (answered outside the server's main loop); identity and
        compatibility from /kvctl/caps, which waits for the main loop: a slow caps while the
        server is generating is no sign of death, so only a failed /health takes it out."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await server.client.get_json("/health")
        except (TimeoutError, aiohttp.ClientError, RadixError, ValueError) as exc:
            self.coordinator.server_down(server, _why(exc))
            return
        try:
            async with asyncio.timeout(self.timeout_s * 5):
                caps = await server.client.caps()
        except TimeoutError:
            return  # busy: alive, as /health said; a server that was down stays down until caps answers
        except (aiohttp.ClientError, RadixError, ValueError) as exc:
            self.coordinator.server_down(server, _why(exc))
            return
        reason = self._incompatible(server, caps)
        if reason:
            self.coordinator.server_down(server, reason)
            return
        self._follow_checkpoints(server, caps)
        self._follow_kv_place(server, caps)
        if server.take_media_caps(caps):  # restarted with another projector, or none
            if caps.multimodal:
                log_media(server.name, caps)
            else:
                log.warning("%s: no multimodal projector now", server.name)
        self.coordinator.server_up(server, caps.instance)

    def _follow_kv_place(self, server: ServerState, caps: Caps) -> None:
        """A restarted server may hold its KV elsewhere now (another -ngl, another device)."""
        place = KvPlace.from_caps(caps)
        if place == server.kv:
            return
        log.warning(
            "%s: its KV lives on %s (%s) now, not %s",
            server.name,
            ",".join(place.devices) or "an unknown device",
            ",".join(place.backends) or "unknown backend",
            ",".join(server.kv.devices) or "an unknown device",
        )
        server.kv = place
        self.coordinator.metrics.set_kv_place(server.name, place.pairs)

    def _follow_checkpoints(self, server: ServerState, caps: Caps) -> None:
        """A restarted server may take whole-state checkpoints now, or no longer (another
        --ctx-checkpoints, its startup probe): route H from them follows what it says."""
        on = not server.moves and caps.checkpoints and caps.compat_id == server.compat_id
        if on == server.checkpoints:
            return
        server.checkpoints = on
        self.coordinator.metrics.server_checkpoints.labels(server.name).set(1 if on else 0)
        log.warning(
            "%s: whole-state checkpoints are %s now%s",
            server.name,
            "on" if on else "off",
            "" if on else f" ({'; '.join(caps.checkpoints_off) or 'another compatibility id'})",
        )

    @staticmethod
    def _incompatible(server: ServerState, caps: Caps) -> str:
        """Why the server cannot take this proxy's requests any more ("" when it can)."""
        if caps.compat != server.mover.compat:
            return "it now runs another model or KV layout (restart the proxy to serve it)"
        if caps.n_parallel != len(server.slots):
            return f"it now has {caps.n_parallel} slots, not {len(server.slots)} (restart the proxy)"
        unknown = caps.kv_where_unknown()
        if server.moves and unknown is not None:  # moves were on for where its KV was
            return f"{unknown} (restart the proxy to serve it without moves)"
        return ""


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def log_media(name: str, caps: Caps) -> None:
    """A server with a projector: whether images move with the text around them, or why not."""
    if caps.media_moves:
        log.info(
            "%s: a multimodal projector: media is keyed by content and moves with the text%s",
            name,
            ", owners share it" if caps.media_shared else "",
        )
    else:
        log.warning(
            "%s: a multimodal projector: media does not move (%s); the text before it moves, the "
            "server reuses media itself only on the slot that holds it (route A)",
            name,
            caps.media_fixed_why,
        )
