"""Waves: requests that arrive together and share part of a prompt nobody has computed yet.

Each would compute the shared part side by side with the others, and waiting for the first
one's whole answer (the server exports only idle slots) often costs more than that. So the
first one (the head) holds its forward for a short window; a request of the wave that finds
it there asks it to compute the shared part alone first (``Lease.split_to``, set by
``Leases._blocker``) and waits. The head then runs a prefix step: the shared tokens as a
completion of one token on its own slot, the export of what the tree lacks, the insert; the
waiters wake, find the prefix in the tree and restore it (route H) while the head goes on
with its own suffix, which the server computes on top of the prefix it now holds (route A).
Every prefix is computed once (issue 28 item 6). A failed step costs the waiters their wait
only: they wake and plan again (computing it themselves), and the head is sent as planned.
"""

from __future__ import annotations

import asyncio
import logging

from proxy.core.radix import RadixTree
from proxy.core.routing import CostModel, compute_s
from proxy.errors import RadixError
from proxy.server.coordinator.state import EMPTY, Lease
from proxy.server.dataplane.backend import TRANSPORT_ERRORS
from proxy.server.metrics import Metrics

log = logging.getLogger("radix")

WAVE_WINDOW_S = 0.05  # the longest a head holds its forward for the rest of its wave
WAVE_WINDOW_SHARE = 0.02  # ... and at most this share of the time its prefill will take
WAVE_WINDOW_MIN_S = 0.005  # a shorter window is none: a prefill that quick is not worth a wave
STEP_SLACK_S = 2.0  # a waiter's patience beyond twice the step's estimated compute time
STEP_ERRORS: tuple[type[Exception], ...] = (TimeoutError, RadixError, ValueError, *TRANSPORT_ERRORS)


def window_s(lease: Lease, min_tokens: int, cost_model: CostModel) -> float:
    """How long the head holds its forward for its wave: none for a short prefill (nothing a
    restore would save), else a small share of the prefill's estimated time."""
    uncached = len(lease.tokens) - lease.plan.predicted_cached
    if uncached < min_tokens or not lease.server.moves:
        return 0.0
    wait = min(WAVE_WINDOW_S, WAVE_WINDOW_SHARE * compute_s(uncached, 0, lease.server.rates, cost_model))
    return wait if wait >= WAVE_WINDOW_MIN_S else 0.0


def patience_s(head: Lease, shared: int, cost_model: CostModel, limit_s: float) -> float:
    """How long a request of the wave waits for the head's prefix step: twice its estimated
    compute time alone, plus slack for the export, within ``limit_s``."""
    gain = max(0, shared - head.plan.predicted_cached)
    return min(2 * compute_s(gain, 0, head.server.rates, cost_model) + STEP_SLACK_S, limit_s)


async def hold_for_wave(lease: Lease, min_tokens: int, cost_model: CostModel, enabled: bool = True) -> None:
    """The head's window: requests of its wave that reach planning meanwhile may ask it for
    a prefix step. From the end of it, nobody can (the request is about to be sent). None
    when nothing could use one: waves off (resident sharing waits for answers instead), or
    a slot whose KV is not to be reused."""
    usable = enabled and lease.splittable and not lease.no_cache and lease.fallback is None
    wait = window_s(lease, min_tokens, cost_model) if usable else 0.0
    if wait > 0:
        await asyncio.sleep(wait)
    lease.splittable = False


async def prefix_step(
    lease: Lease, tree: RadixTree, metrics: Metrics, min_tokens: int, timeout_s: float
) -> None:
    """Compute ``lease.tokens[:lease.split_to]`` on the lease's slot alone, export what the
    tree lacks of it into the tree, and wake the requests waiting for it (on every path)."""
    p = lease.split_to
    if p <= 0:
        return
    if lease.no_cache or lease.fallback is not None or lease.split_waiters == 0:
        lease.wake_waiters()  # the slot's KV is not to be reused, or nobody waits any more
        return
    try:
        async with asyncio.timeout(timeout_s):
            await _step(lease, tree, p, min_tokens)
        metrics.prefix_steps.labels("done").inc()
        metrics.prefix_step_tokens.inc(lease.prefix_step_tokens)
    except asyncio.CancelledError:
        _unknown(lease, p)  # the server may go on computing it
        raise
    except STEP_ERRORS as exc:
        # The head's forward reuses only what the server finds there, token for token.
        _unknown(lease, p)
        metrics.prefix_steps.labels("failed").inc()
        log.warning(
            "prefix step of %s (%d tokens) on %s slot %d failed: %s",
            lease.request_id,
            p,
            lease.server.name,
            lease.slot.slot_id,
            exc or type(exc).__name__,
        )
    finally:
        lease.wake_waiters()


def _unknown(lease: Lease, p: int) -> None:
    """What the slot holds is unknown after a step that failed or was cancelled: no known
    tokens, and up to everything it held or the step may have computed (the books keep
    counting those cells)."""
    slot = lease.slot
    slot.unrecorded = max(slot.unrecorded, len(slot.tokens), p)
    slot.tokens = EMPTY


async def _step(lease: Lease, tree: RadixTree, p: int, min_tokens: int) -> None:
    server, slot = lease.server, lease.slot
    prefix = lease.tokens[:p]
    if lease.plan.predicted_cached < p:
        lease.prefix_step_tokens, lease.prefix_step_ms = await server.backend.prefill(
            slot.slot_id, prefix, lease.adapters.as_json()
        )
        # The server generated one token and did not compute it: the slot holds the prefix.
        slot.confirmed(prefix.copy())
    match = tree.match(prefix, touch=False, ns=lease.ns)
    if p - match.length < min_tokens:
        return
    tree.pin(match)  # what the export goes on from stays in the tree meanwhile
    try:
        run = await server.mover.export({"slot": slot.slot_id}, match.length, prefix)
        tree.insert_run(prefix, run, ns=lease.ns)
    finally:
        tree.unpin(match)
