"""Startup check of a server's KV payload layout against a real move (invariant 9).

`/kvctl/caps` describes the layout (per-layer K/V types and rows, the cells' metadata size);
the proxy builds its payload parser and writer from it. Before any request is steered to the
server, a few tokens' KV is exported through the mover, parsed with that layout, imported back
into the same slot and exported again: the second export must be byte-identical to the first.
A model whose layout the proxy cannot parse or write is then served without moves, loudly,
instead of failing every save and restore.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import numpy as np

from proxy.core.payload import build_blob
from proxy.errors import BackendError, FallbackCause, KvMoveError, RadixError
from proxy.server.dataplane.backend import ServerClient
from proxy.server.dataplane.mover import KvMover

log = logging.getLogger("radix")

# Enough tokens to hold more than one cell and fit any context; the text only has to tokenize.
_PROBE_PROMPT = "Check the KV layout: one, two, three."
_PROBE_TOKENS = 8

# Move failures that say nothing about the layout: the server was busy, restarting or slow.
_TRANSIENT_CAUSES = frozenset(
    {
        FallbackCause.TRANSPORT,
        FallbackCause.TIMEOUT,
        FallbackCause.CONFLICT,
        FallbackCause.INSTANCE,
        FallbackCause.NO_SPACE,
        FallbackCause.DOWN,
    }
)


class LayoutCheckDeferred(RadixError):
    """The check could not run to a verdict (no idle slot, the server busy or gone): it is
    retried, and the server is not routed to until it has one. Never a reason to turn moves off
    for good: a server restarted under load would otherwise lose its moves until the proxy
    restarts."""


class LayoutChecks:
    """The verdicts of the layout check, one per server instance (``caps.instance``): a server
    is checked once per start, a deferred check is retried a few times before the caller hears
    of it."""

    TRIES = 3

    def __init__(self, pause: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._verdicts: dict[str, tuple[str, ...]] = {}
        self._pause = pause  # between tries (a test passes one that does not wait)

    async def verdict(self, instance: str, backend: ServerClient, mover: KvMover) -> tuple[str, ...]:
        """() when moves are exact on this instance, else why they are off; raises
        LayoutCheckDeferred when no verdict could be reached in TRIES attempts."""
        known = self._verdicts.get(instance)
        if known is not None:
            return known
        for attempt in range(1, self.TRIES + 1):
            try:
                verdict = await check_layout(backend, mover)
                break
            except LayoutCheckDeferred as exc:
                if attempt == self.TRIES:
                    raise
                log.info("%s: layout check deferred (%s); trying again", backend.url, exc.message)
                await self._pause(0.5 * attempt)
        self._verdicts[instance] = verdict
        return verdict

    def forget(self, instance: str) -> None:
        """Drop a verdict once the server is taken into routing (a restart gets a new instance)."""
        self._verdicts.pop(instance, None)


async def check_layout(backend: ServerClient, mover: KvMover) -> tuple[str, ...]:
    """() when a round trip of a few tokens' KV through the mover is exact; else why moves are
    off. Uses an idle slot (an empty one if there is one) and erases it afterwards: read the
    slots after this check. Raises LayoutCheckDeferred when the server could not be checked
    now (busy, restarting, unreachable): that is no verdict on the layout."""
    try:
        return await _round_trip(backend, mover)
    except LayoutCheckDeferred:
        raise
    except KvMoveError as exc:
        if exc.cause in _TRANSIENT_CAUSES:
            raise LayoutCheckDeferred(f"a test move could not run: {exc.message}") from exc
        return (f"a test move of a few tokens failed: {exc.message}",)
    except BackendError as exc:
        if exc.backend_status >= 500 or exc.backend_status in (0, 408, 429):
            raise LayoutCheckDeferred(f"the server could not run the check: {exc.message}") from exc
        return (f"the layout check could not run: {exc.message}",)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise LayoutCheckDeferred(f"the server could not be reached: {type(exc).__name__}: {exc}") from exc
    except RadixError as exc:  # any other verdict must never stop startup
        return (f"the layout check could not run: {exc.message}",)


async def _round_trip(backend: ServerClient, mover: KvMover) -> tuple[str, ...]:
    slot_id = await _idle_slot(backend)
    if slot_id is None:
        raise LayoutCheckDeferred("every slot is busy")
    try:
        await backend.post_json(
            "/completion",
            {
                "prompt": _PROBE_PROMPT,
                "n_predict": 1,
                "id_slot": slot_id,
                "cache_prompt": True,
                "temperature": 0,
            },
        )
        tokens = await _held_tokens(backend, slot_id)
        if len(tokens) < 2:
            return (f"the layout check's slot {slot_id} holds {len(tokens)} tokens after a completion",)
        first = await mover.export({"slot": slot_id}, 0, tokens)
        await mover.import_(slot_id, 0, tokens.tolist(), first)
        again = await mover.export({"slot": slot_id}, 0, tokens)
    finally:
        try:
            await backend.erase(slot_id)
        except (RadixError, aiohttp.ClientError, TimeoutError) as exc:
            # The slots are read after the check: one holding unknown KV is erased before reuse.
            log.warning("%s: erasing the layout check's slot %d failed: %s", backend.url, slot_id, exc)
    if build_blob(first) != build_blob(again):
        return (f"a test move of {len(tokens)} tokens did not round-trip byte for byte",)
    log.info(
        "%s: KV layout checked: %d tokens exported, imported, exported again: identical",
        backend.url,
        len(tokens),
    )
    return ()


async def _idle_slot(backend: ServerClient) -> int | None:
    info = await backend.slots(tokens=False)
    idle = [e for e in info.slots if not e.busy]
    if not idle:
        return None
    empty = [e for e in idle if e.n_tokens == 0]
    return (empty or idle)[-1].id


async def _held_tokens(backend: ServerClient, slot_id: int) -> np.ndarray:
    """The first tokens whose KV the slot holds (at most _PROBE_TOKENS)."""
    entry = (await backend.slots(tokens=True)).slot(slot_id)
    tokens = entry.held_tokens()
    if entry.pos_min > 0:
        return tokens[:0]
    held = entry.pos_max + 1
    return tokens[: min(held, len(tokens), _PROBE_TOKENS)]
