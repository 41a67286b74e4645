"""Startup check of a server's KV payload layout against a real move (invariant 9).

`/kvctl/caps` describes the layout (per-layer K/V types and rows, the cells' metadata size);
the proxy builds its payload parser and writer from it. Before any request is steered to the
server, a few tokens' KV is exported through the mover, parsed with that layout, imported back
into the same slot and exported again: the second export must be byte-identical to the first.
A model whose layout the proxy cannot parse or write is then served without moves, loudly,
instead of failing every save and restore.
"""

from __future__ import annotations

import logging

import aiohttp
import numpy as np

from proxy.core.payload import build_blob
from proxy.errors import FallbackCause, KvMoveError, RadixError
from proxy.server.backend import Backend
from proxy.server.mover import KvMover

log = logging.getLogger("radix")

# Enough tokens to hold more than one cell and fit any context; the text only has to tokenize.
_PROBE_PROMPT = "Check the KV layout: one, two, three."
_PROBE_TOKENS = 8


async def check_layout(backend: Backend, mover: KvMover) -> tuple[str, ...]:
    """() when a round trip of a few tokens' KV through the mover is exact; else why moves are
    off. Uses an idle slot (an empty one if there is one) and erases it afterwards: read the
    slots after this check."""
    try:
        return await _round_trip(backend, mover)
    except (RadixError, aiohttp.ClientError, TimeoutError) as exc:  # the check must never stop startup
        message = exc.message if isinstance(exc, RadixError) else f"{type(exc).__name__}: {exc}"
        return (f"the layout check could not run: {message}",)


async def _round_trip(backend: Backend, mover: KvMover) -> tuple[str, ...]:
    slot_id = await _idle_slot(backend)
    if slot_id is None:
        return ("the layout check found no idle slot",)
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
        await mover.import_(slot_id, 0, tokens.tolist(), [first])
        again = await mover.export({"slot": slot_id}, 0, tokens)
    except KvMoveError as exc:
        return (f"a test move of a few tokens failed: {exc.message}",)
    finally:
        try:
            await backend.kv_post("erase", {"slot": slot_id}, cause=FallbackCause.ERASE)
        except (RadixError, aiohttp.ClientError, TimeoutError) as exc:
            # The slots are read after the check: one holding unknown KV is erased before reuse.
            log.warning("%s: erasing the layout check's slot %d failed: %s", backend.url, slot_id, exc)
    if build_blob([first]) != build_blob([again]):
        return (f"a test move of {len(tokens)} tokens did not round-trip byte for byte",)
    log.info(
        "%s: KV layout checked: %d tokens exported, imported, exported again: identical",
        backend.url,
        len(tokens),
    )
    return ()


async def _idle_slot(backend: Backend) -> int | None:
    info = await backend.slots(tokens=False)
    idle = [e for e in info["slots"] if not e.get("busy")]
    if not idle:
        return None
    empty = [e for e in idle if int(e.get("n_tokens", 0)) == 0]
    return int((empty or idle)[-1]["id"])


async def _held_tokens(backend: Backend, slot_id: int) -> np.ndarray:
    """The first tokens whose KV the slot holds (at most _PROBE_TOKENS)."""
    info = await backend.slots(tokens=True)
    entry = next(e for e in info["slots"] if int(e["id"]) == slot_id)
    tokens = np.asarray(entry.get("tokens", []), dtype=np.int32)
    if int(entry.get("pos_min", 0)) > 0:
        return tokens[:0]
    held = int(entry.get("pos_max", -1)) + 1
    return tokens[: min(held, len(tokens), _PROBE_TOKENS)]
