"""Saving after the answer: read back what the slot holds, export what the host tree lacks,
share it, and hand the slot on to the next request as early as that allows.

A slot's life after its answer (``Coordinator.finish``; docs/design.md, "Saving"):

1. The answer is done. When the save cannot add a restore's worth of KV to the tree (the part of
   the prompt the tree lacks plus the whole answer is shorter than ``--min-restore-tokens``:
   ``takeable_cells``), it is not worth waiting for: the slot is recorded as holding no known
   tokens and at most that many cells (``SlotState.unrecorded``), and a request that finds no
   idle slot may take it at once, until the save ends (``Leases``). The lease is then
   ``handed_on``: the save writes nothing to the slot from then on, and starts no export or
   erase of it (checked after every ``await``).
2. The slot is read back (``/kvctl/slots``); the proxy records what it holds (a taker plans on it).
3. What the tree lacks is exported, bound to the tokens just read back: the server exports
   only from an idle slot that holds exactly these tokens (``expect_sha256``, invariant 6).
   Once the request is on its way the slot may be taken (``_server_part``): the server runs the
   export first (it came first), or refuses it (409, counted): the save is lost, never wrong.
   Once the server answered, the slot is handed on in any case (released, the queue served),
   and the payload is read into segments and inserted after that, under the tokens the save
   kept, never the slot's. No export is sent after its slot was taken.
4. With --cache-idle-release the slot's KV is erased once the tree holds it, unless the slot
   went to another request meanwhile (its ``gen`` moved on) or a request is queued (it will
   replace that KV anyway); the slot is marked busy during the erase.

No step takes the server's move lock except sharing's publish (it adds owner cells) and
whole-state checkpoints, so a restore never queues behind a save: the server's main loop
orders the moves themselves. With sharing on, the slot is handed on only after the publish
(it reads the slot's cells).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from proxy.config import Config
from proxy.core.checkpoints import CheckpointStore
from proxy.core.prefix import common_prefix
from proxy.core.radix import RadixTree
from proxy.errors import FallbackCause, KvMoveError, RadixError
from proxy.server.coordinator.state import EMPTY, Lease, SlotState
from proxy.server.dataplane.backend import TRANSPORT_ERRORS
from proxy.server.dataplane.kvctl import SeqInfo, Tokenized
from proxy.server.metrics import Metrics

# What a save may meet that is not a bug: a move the server refused, a server gone.
SAVE_ERRORS: tuple[type[Exception], ...] = (RadixError, *TRANSPORT_ERRORS)

log = logging.getLogger("radix")

BUSY_POLLS = 100  # a cancelled request may still be winding down: poll its slot this often
BUSY_POLL_S = 0.02
CHECKPOINTS_PER_ANSWER = 3  # whole-state checkpoints kept from one answer's prompt, newest first


@dataclass(frozen=True)
class SaveHooks:
    """What a save asks of the leases (``Coordinator.finish``)."""

    hand_on: Callable[[], None]  # release the slot to the next request (idempotent)
    offer: Callable[[], None]  # let a request that finds no idle slot take it (export under way)
    queued: Callable[[], bool]  # a request waits for a slot of this model, or for a prefix
    grant: Callable[[], None]  # serve the queue (after the slot was busy erasing)


class KvSaves:
    def __init__(
        self, config: Config, tree: RadixTree, metrics: Metrics, checkpoints: CheckpointStore
    ) -> None:
        self.config = config
        self.tree = tree
        self.metrics = metrics
        self.checkpoints = checkpoints

    def takeable_cells(self, lease: Lease, answer_tokens: int | None) -> int | None:
        """The most KV cells the slot can hold after this answer (prompt and answer) when the part
        of it the tree lacks is shorter than a host restore (``--min-restore-tokens``): waiting
        for its save is not worth it. None otherwise, and for what only the slot keeps (moves
        off), what sharing publishes from the slot, a slot of unknown content, an answer of
        unknown length, a prompt with media (its cells are not known before the read-back)."""
        server, slot = lease.server, lease.slot
        if (
            not server.moves
            or server.sharing is not None
            or lease.no_cache
            or slot.ns is None
            or lease.media is not None
        ):
            return None
        if lease.epoch != server.epoch or not slot.busy:
            return None
        answer = answer_tokens if answer_tokens is not None else (lease.n_predict or None)
        if answer is None or answer < 0:
            return None
        most = min(server.n_ctx_slot, len(lease.tokens) + answer + 1)
        lacking = most - self.tree.match(lease.tokens, ns=lease.ns).length
        return most if lacking < self.config.min_restore_tokens else None

    async def save(self, lease: Lease, hooks: SaveHooks) -> None:
        """After the answer: learn what the slot holds, save what the tree lacks, share it, hand
        the slot on (as soon as it is no longer needed), then release its KV from the pool if it
        is still idle. A failed save loses a future hit, never an answer: it is counted, not
        raised."""
        if lease.handed_on:  # taken before the save started
            return
        lease.finishing = True
        server, slot = lease.server, lease.slot
        if lease.epoch != server.epoch:  # the server restarted meanwhile: nothing to save
            slot.tokens, slot.ns = EMPTY, None
            return
        try:
            if not await self._refresh_slot(lease):
                return  # taken meanwhile: nothing of the slot is this save's any more
            if not server.moves:
                # The slot keeps its KV for the server's own reuse (route A); with whole-state
                # checkpoints the host keeps the states the server took of this prompt too.
                if server.checkpoints:
                    await self._save_checkpoints(lease)
                return
            await self._save(lease, hooks if server.sharing is None else None)
            await self._share(lease)
        except HandedOn:
            return  # taken while the export's file was made ready: nothing sent, nothing to do
        except SAVE_ERRORS as exc:  # a move refused, a server gone: expected
            cause = exc.cause if isinstance(exc, KvMoveError) else FallbackCause.TRANSPORT
            self.metrics.fallbacks.labels(cause).inc()
            log.warning("saving %s slot %d failed: %s", server.name, slot.slot_id, exc)
        except Exception:  # a bug: still never the answer's failure, but loud
            self.metrics.fallbacks.labels(FallbackCause.INTERNAL).inc()
            log.exception("saving %s slot %d failed unexpectedly", server.name, slot.slot_id)
        # Not on cancellation (the deadline): finish() then releases the slot as unknown.
        hooks.hand_on()
        await self._release_idle(lease, hooks)

    async def _refresh_slot(self, lease: Lease) -> bool:
        """Read back what the slot holds (the server is the source of truth). False when the slot
        was handed on meanwhile: then nothing read is written to it."""
        slot = lease.slot
        if lease.handed_on:
            return False
        if lease.no_cache or slot.ns is None:  # unknown provenance (erase failed or never ran)
            slot.tokens, slot.ns = EMPTY, None
            return True
        for _ in range(BUSY_POLLS):
            entry = (await lease.server.backend.slots(tokens=True)).slot(slot.slot_id)
            if lease.handed_on:
                return False
            if not entry.busy:
                break
            await asyncio.sleep(BUSY_POLL_S)
            if lease.handed_on:
                return False
        else:  # still busy: what it will hold is unknown
            slot.tokens, slot.ns = EMPTY, None
            return True
        slot.checkpoints = entry.checkpoints
        if entry.media_at is not None:
            _confirm_text_before_media(slot, entry, lease.server.moves)
            slot.media = lease.media_ids if slot.ns is not None else ()
            return True
        tokens = entry.held_tokens()
        held = entry.pos_max + 1
        # Invariant 1: only tokens whose KV the sequence really holds count. With moves off only
        # the server reuses a slot's KV (route A), and a sliding window's cache forgets the start
        # (pos_min > 0): the tokens then only steer the request to the slot.
        starts_at_0 = entry.pos_min <= 0 or not lease.server.moves
        if held == len(tokens) and starts_at_0:
            slot.confirmed(tokens)
        else:  # holds KV it does not account for: erase before anyone reuses it
            slot.tokens, slot.ns = EMPTY, None
        return True

    async def _save(self, lease: Lease, hooks: SaveHooks | None) -> None:
        """Export what the tree lacks of the slot's tokens and insert it. With ``hooks`` (no
        sharing), the slot may be taken once the export is on its way, and is handed on as soon
        as the server answered it (the payload is read and inserted after that, from ``tokens``,
        kept here: never the slot's, which belong to the next request by then)."""
        tokens = lease.slot.tokens
        match = self.tree.match(tokens, ns=lease.ns)
        if len(tokens) - match.length < self._min_save() or lease.handed_on:
            return
        # Pinned so the prefix the export continues cannot be evicted while we wait; the
        # exported rows count against the budget from now on, not only once inserted.
        self.tree.pin(match)
        held = self.tree.reserve(lease.server.mover.bytes_per_token * (len(tokens) - match.length))
        try:
            run = await lease.server.mover.export(
                {"slot": lease.slot.slot_id}, match.length, tokens, hold=_server_part(lease, hooks)
            )
            self.tree.release(held)  # the same step as the insert that counts them: no await between
            held = 0
            stored = self.tree.insert_run(tokens, run, ns=lease.ns)
        finally:
            self.tree.release(held)
            self.tree.unpin(match)
        self.metrics.tree_saves.inc()
        self.metrics.tree_saved_tokens.inc(stored)

    async def _save_checkpoints(self, lease: Lease) -> None:
        """Keep the whole-state checkpoints the server took while computing this prompt (at
        the start of user messages and just before the prompt's end) that the host lacks, the
        newest first. Each is exported as the state after exactly its tokens, which the slot
        still holds (the server checks them: a 409 means the slot moved on)."""
        slot, server = lease.slot, lease.server
        if lease.fallback or slot.ns != lease.ns:
            return
        # 0 when the slot's content is unknown; a whole-state checkpoint holds text only
        held = min(common_prefix(slot.tokens, lease.tokens), _text_end(slot.tokens))
        todo = [
            n for n in sorted(slot.checkpoints, reverse=True) if self.config.min_restore_tokens <= n <= held
        ][:CHECKPOINTS_PER_ANSWER]
        for n in todo:
            tokens = lease.tokens[:n]
            if self.checkpoints.find(lease.ns, server.compat_id, tokens) is not None:
                continue
            try:
                async with server.move_lock.held(slot.slot_id):
                    data = (await server.backend.checkpoint(slot.slot_id, tokens)).data
            except KvMoveError as exc:
                if exc.cause in (FallbackCause.TRANSPORT, FallbackCause.TIMEOUT, FallbackCause.INSTANCE):
                    raise  # the server is gone or stuck: the next ones would fail alike
                # One refused (larger than the inline limit, the slot moved on): the smaller ones
                # may still be kept. Counted, never the answer's failure.
                self.metrics.fallbacks.labels(exc.cause).inc()
                log.warning("checkpoint %d of %s slot %d not kept: %s", n, server.name, slot.slot_id, exc)
                continue
            if self.checkpoints.add(lease.ns, server.compat_id, tokens, data) is not None:
                self.metrics.checkpoint_saves.inc()
                self.metrics.kv_move_bytes.labels("export").inc(len(data))

    async def _release_idle(self, lease: Lease, hooks: SaveHooks) -> None:
        """--cache-idle-release: erase the slot's KV from the server's pool once the host tree
        holds it (all but a tail too short to save), as stock's idle-slot cache does. Owner
        sequences keep what they share. The slot's next request restores from the host. Only
        while the slot is idle and untouched since this answer, and nobody waits for a slot (a
        waiter replaces the KV anyway); the slot is busy during the erase."""
        slot, server = lease.slot, lease.server
        if slot.busy or slot.gen != lease.gen or hooks.queued():
            return  # handed on to another request, or wanted at once
        tokens = slot.tokens
        if not self.config.idle_release or len(tokens) == 0 or slot.ns != lease.ns or lease.fallback:
            return
        if len(tokens) < self.config.min_restore_tokens:
            return  # shorter than any host restore: erased, it would be computed again
        if slot.media:
            return  # the media and what follows live in the slot only: kept for its next turn
        if server.mover.shm_dir is None:
            # Inline payloads (no shared directory): a restore is a slower HTTP body, refused
            # past the server's 64 MiB: the slot keeps its KV for its next turn.
            return
        if len(tokens) - self.tree.match(tokens, ns=lease.ns).length >= self._min_save():
            return  # the tree lacks part of it: keep it resident
        slot.busy = True  # not leased while the server erases it
        try:
            await server.backend.erase(slot.slot_id)
            # Before the grant below: a request queued during the erase plans on the slot as
            # it is now (empty), not on the KV it held (a route A the server could not serve).
            slot.confirmed(EMPTY)
            if server.sharing is not None:
                server.sharing.index.slot_changed(slot.slot_id, EMPTY)
            self.metrics.idle_releases.inc()
        except KvMoveError as exc:
            slot.tokens, slot.ns = EMPTY, None  # unknown: erased before anyone reuses it
            log.warning("releasing idle %s slot %d failed: %s", server.name, slot.slot_id, exc)
        except asyncio.CancelledError:
            slot.tokens, slot.ns = EMPTY, None  # the erase may have run: unknown
            raise
        finally:
            slot.busy = False
            hooks.grant()  # plans synchronously on the slot's state: everything above is set

    def _min_save(self) -> int:
        """A slot tail shorter than this is not worth an export."""
        return max(1, self.config.min_restore_tokens // 4)

    async def _share(self, lease: Lease) -> None:
        """Record the completed prompt, and a restored host prefix, as resident prefixes."""
        sharing = lease.server.sharing
        if sharing is None:
            return
        tokens = lease.slot.tokens
        sharing.index.slot_changed(lease.slot.slot_id, tokens)
        lengths = share_lengths(
            tokens, lease.tokens, lease.plan.host_to, lease.media, lease.server.media_shared
        )
        if not lengths or lease.fallback:
            return
        async with lease.server.move_lock:  # the whole server: owner sequences
            await sharing.publish_prefixes(lease.slot.slot_id, tokens, lengths, lease.ns)


def share_lengths(
    slot_tokens: np.ndarray, tokens: np.ndarray, host_to: int, media: Tokenized | None, media_shared: bool
) -> list[int]:
    """The prefixes of a slot worth publishing after a request (its prompt, and the host part it
    restored) that the slot holds and an owner can: text, and movable media where the server
    shares it (patch 0028), each ending at a media chunk's edge (else the server refuses)."""
    held = min(common_prefix(slot_tokens, tokens), _text_end(slot_tokens, media_shared))
    lengths = [n for n in (len(tokens), host_to) if 0 < n <= held]
    if media is not None:
        lengths = sorted({media.chunk_start(n) for n in lengths} - {0})
    return lengths


def _text_end(tokens: np.ndarray, movable_too: bool = False) -> int:
    """Where the first media cell (a token below 0) is, or with ``movable_too`` the first cell
    of media no move can name (-1): what an owner or a whole-state checkpoint can hold."""
    media = np.flatnonzero(tokens == -1 if movable_too else tokens < 0)
    return int(media[0]) if len(media) else len(tokens)


class HandedOn(Exception):
    """The slot went to another request before the export was sent: it is not sent."""


def _confirm_text_before_media(slot: SlotState, entry: SeqInfo, moves: bool) -> None:
    """A slot holding media no move can name (M-RoPE's images): only the tokens before it are
    recorded, the server's cells from there on count as held (unrecorded). Those tokens are plain
    KV at positions 0..n-1, exported, restored and shared like any; the server reuses the rest
    itself (route A), matching media chunks by their content hash. With moves off (a window-sized cache forgets its start)
    the tokens only steer a request to the slot, as in ``_refresh_slot``."""
    text = entry.keyed_prefix()
    if entry.pos_min <= 0 or not moves:
        slot.tokens, slot.unrecorded = text, max(0, entry.n_cells - len(text))
    else:  # the cells do not start at 0: nothing of it is known
        slot.tokens, slot.ns = EMPTY, None


@contextlib.asynccontextmanager
async def _server_part(lease: Lease, hooks: SaveHooks | None) -> AsyncIterator[None]:
    """Around the server's part of an export, entered right before the request is sent (the
    payload file is ready): not sent at all if the slot was taken meanwhile. Once it is on its
    way the slot is offered to requests that find no idle one (from the loop's next turn: the
    request is written first, so the server's main loop, first come first served, runs the
    export before a taker's first move; should it not, the server refuses the export, 409). The
    slot is handed on once the server answered or failed (no longer needed then, whatever the
    payload holds), not when cancelled (the save's deadline: the server may still be at it, and
    finish() releases the slot as unknown)."""
    if lease.handed_on:
        raise HandedOn(f"slot {lease.slot.slot_id} was taken before its export was sent")
    after = hooks.hand_on if hooks is not None else None
    if hooks is not None:
        asyncio.get_running_loop().call_soon(hooks.offer)
    try:
        yield
    except asyncio.CancelledError:
        raise
    except BaseException:
        if after is not None:
            after()
        raise
    if after is not None:
        after()
