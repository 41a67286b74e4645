"""The ``Coordinator``: the one owner of mutable state (see the package's docstring). It leases
slots (``leases``), moves KV (``moves``), logs decisions (``decisions``), and follows the
servers going and coming."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import numpy as np

from proxy.config import Config
from proxy.core.adapters import NO_ADAPTERS, Adapters
from proxy.core.checkpoints import CheckpointStore
from proxy.core.radix import RadixTree
from proxy.errors import FallbackCause, RadixError
from proxy.server.coordinator.decisions import Decision, DecisionLog
from proxy.server.coordinator.leases import Leases
from proxy.server.coordinator.moves import KvMoves
from proxy.server.coordinator.saves import KvSaves, SaveHooks
from proxy.server.coordinator.scan import PrefixScan
from proxy.server.coordinator.scan import scan as scan_prefixes
from proxy.server.coordinator.state import EMPTY, Lease, ServerState
from proxy.server.dataplane.kvctl import Tokenized
from proxy.server.metrics import Metrics
from proxy.server.tiers.disk import DiskTier
from proxy.server.tiers.remote import RemoteTier

log = logging.getLogger("radix")

CHECKPOINT_SHARE = 4  # with KV moves on some server: checkpoints take at most 1/4 of --cache-ram


class Coordinator:
    def __init__(self, config: Config, servers: list[ServerState], tree: RadixTree, metrics: Metrics) -> None:
        self.config = config
        self.servers = servers
        self.tree = tree
        self.metrics = metrics
        # Whole-state checkpoints (servers with moves off): their bytes count in the tree's budget,
        # of which they may take a quarter when a server's KV goes to the tree too (the tree
        # cannot evict them), all of it when none's does.
        share = CHECKPOINT_SHARE if any(s.moves for s in servers) else 1
        self.checkpoints = CheckpointStore(
            tree.budget_bytes // share, on_hold=tree.reserve, on_free=tree.release
        )
        self.leases = Leases(
            config,
            servers,
            tree,
            on_reject=lambda reason: metrics.rejected.labels(reason).inc(),
            checkpoints=self.checkpoints,
            on_take=self._taken,
        )
        self.moves = KvMoves(
            config, tree, metrics, self.checkpoints, self.leases.cost_model, grant=self.leases.grant_waiters
        )
        self.saves = KvSaves(config, tree, metrics, self.checkpoints)
        self.log = DecisionLog(metrics)
        self.disk: DiskTier | None = None  # set by startup with --cache-disk
        self.remote: RemoteTier | None = None  # set by startup with --cache-remote

    async def acquire(
        self,
        request_id: str,
        tokens: np.ndarray,
        ns: str = "",
        *,
        model: str = "",
        session: str = "",
        n_predict: int = 0,
        adapters: Adapters = NO_ADAPTERS,
        media: Tokenized | None = None,
    ) -> Lease:
        """A slot for the request, with its plan (may wait: see ``Leases.acquire``). A match
        the disk tier carries further than anything in RAM or a slot is read into the host
        tree first, so the plan sees it as a host hit. The prefix scan that decides it is the
        one the lease plans on, unless the disk was read (an ``await``: the slots may have
        changed meanwhile, so the lease scans again)."""
        found = None
        if self.disk is not None:
            found = scan_prefixes(tokens, self.servers, self.tree, ns, self.checkpoints)
            floor = found.best_available()
            if self.disk.would_promote(self.tree, tokens, ns, floor):
                found = None
                try:
                    await self.disk.promote(self.tree, tokens, ns, floor)
                except (RadixError, ValueError) as exc:
                    # The tree changed under the read (an admin clear) or refused the segment:
                    # the request is planned without the disk's KV (a prefill), never failed.
                    log.warning("disk tier: promotion for %s skipped: %s", request_id, exc)
        if self.remote is not None:
            found = await self._from_remote(request_id, tokens, ns, found)
        return await self.leases.acquire(
            request_id,
            tokens,
            ns,
            model=model,
            session=session,
            n_predict=n_predict,
            scanned=found,
            adapters=adapters,
            media=media,
        )

    async def _from_remote(
        self, request_id: str, tokens: np.ndarray, ns: str, found: PrefixScan | None
    ) -> PrefixScan | None:
        """The remote tier, under RAM and disk: a match the store carries further than the
        local tiers and the slots is read into the host tree (docs/scale-out.md). Returns the
        scan the lease may plan on (None after any await: the slots may have changed)."""
        assert self.remote is not None
        floor = (
            found or scan_prefixes(tokens, self.servers, self.tree, ns, self.checkpoints)
        ).best_available()
        prefill = min(s.rates.prefill_s_per_token for s in self.servers)
        try:
            await self.remote.promote(self.tree, tokens, ns, floor, prefill)
        except (RadixError, ValueError) as exc:
            log.warning("remote tier: promotion for %s skipped: %s", request_id, exc)
        return None

    async def restore(self, lease: Lease, n_predict: int) -> None:
        await self.moves.restore(lease, n_predict)

    async def finish(self, lease: Lease, answer_tokens: int | None = None) -> None:
        """After the answer (``answer_tokens`` long, when the server said): save what the tree
        lacks, handing the slot on as soon as the save no longer needs it, and on every path
        (``saves.py``). A save not worth waiting for leaves the slot to a request that finds no
        idle one. A save past its deadline while it still held the slot leaves the slot's
        content unknown: it is emptied (and erased before anyone reuses it)."""
        lease.answered_at = time.monotonic()
        self.leases.finishing(lease, self.saves.takeable_cells(lease, answer_tokens))

        def hand_on() -> None:
            if not lease.handed_on:
                lease.handed_on = True
                self._held_for_save(lease)
                # Requests waiting for this prefix wake when the tree has it (below), not now.
                self.leases.release(lease, done=False)

        def queued() -> bool:  # a request waits for a slot, or for a prefix in flight
            return self.leases.queued_for(lease.server.model) or self.leases.waiting_for_prefix > 0

        hooks = SaveHooks(hand_on, lambda: self.leases.offer(lease), queued, self.leases.grant_waiters)
        try:
            async with asyncio.timeout(self.config.finish_timeout_s):
                await self.saves.save(lease, hooks)
            if self.remote is not None:  # what the tree now holds of the prompt, for the fleet
                self.remote.publish(self.tree, lease.tokens, lease.ns)
        except TimeoutError:
            self.metrics.fallbacks.labels(FallbackCause.TIMEOUT).inc()
            if not lease.handed_on:
                lease.slot.tokens, lease.slot.ns = EMPTY, None
            log.warning(
                "saving %s slot %d took over %g s%s",
                lease.server.name,
                lease.slot.slot_id,
                self.config.finish_timeout_s,
                "" if lease.handed_on else "; the slot is released as unknown",
            )
        finally:
            hand_on()
            self.leases.saved(lease)

    def _held_for_save(self, lease: Lease) -> None:
        """How long the slot stayed leased after its answer, for its save."""
        self.metrics.save_hold.labels(lease.server.name).observe(time.monotonic() - lease.answered_at)

    def _taken(self, lease: Lease) -> None:
        """A request took this lease's slot while its save was pending (not worth waiting for)."""
        self._held_for_save(lease)
        self.metrics.saving_slot_takes.labels(lease.server.name).inc()

    def release(self, lease: Lease) -> None:
        self.leases.release(lease)

    def release_unknown(self, lease: Lease) -> None:
        """Release a slot whose KV the request replaced with something the tree does not track
        (embedding inputs): it is erased before anyone's prefix is reused from it."""
        lease.slot.tokens, lease.slot.ns = EMPTY, None
        self.leases.release(lease)

    # ---- servers going and coming (see health.py) ------------------------------------------

    def server_down(self, server: ServerState, reason: str) -> None:
        if server.healthy:
            log.error(
                "%s (%s) is down, no new requests go there: %s", server.name, server.backend.url, reason
            )
        server.healthy, server.down_reason = False, reason
        server.went_down.set()
        self.metrics.backend_up.labels(server.name).set(0)

    def server_up(self, server: ServerState, instance: str | None) -> None:
        """The server answers again; if it was down, or is another instance, what the proxy knew
        of its slots and owner sequences is gone."""
        new_instance = server.instance is not None and instance is not None and instance != server.instance
        # Down and back without an instance id to tell: it may have restarted, so forget its state.
        if new_instance or (not server.healthy and instance is None):
            self.server_restarted(server)
        if new_instance:  # the process that may still have run our unanswered moves is gone
            server.mover.new_instance()
        server.instance = instance if instance is not None else server.instance
        if not server.healthy:
            log.warning("%s (%s) is serving again", server.name, server.backend.url)
            server.went_down = asyncio.Event()
        server.healthy, server.down_reason = True, ""
        self.metrics.backend_up.labels(server.name).set(1)
        self.leases.grant_waiters()

    def server_restarted(self, server: ServerState) -> None:
        """A new server process: its slots and owner sequences are empty. The host tree, which
        lives here, is kept and warms the new process up."""
        server.epoch += 1
        for slot in server.slots:
            if not slot.busy:  # a busy slot is reset when its lease ends (epoch check)
                slot.tokens, slot.ns = EMPTY, None  # erased before first use: a late request may have run
        if server.sharing is not None:
            server.sharing.index.entries.clear()
        log.warning(
            "%s (%s) restarted: its slot table and resident prefixes were reset",
            server.name,
            server.backend.url,
        )

    def add_server(self, server: ServerState) -> None:
        """A server that did not answer at startup does now: it takes requests from here on."""
        self.servers.append(server)  # the same list the leases plan over
        if server.moves:  # its KV goes to the tree too: checkpoints keep to their share
            self.checkpoints.set_budget(
                min(self.checkpoints.budget_bytes, self.tree.budget_bytes // CHECKPOINT_SHARE)
            )
        self.metrics.backend_up.labels(server.name).set(1)
        log.warning("%s (%s) answers: taken into routing", server.name, server.backend.url)
        self.leases.grant_waiters()

    def close(self) -> None:
        """Shutting down: queued requests are answered 503 now, new ones at once."""
        self.leases.close()

    def record_decision(
        self, lease: Lease, timings: dict[str, Any] | None, ttft_s: float | None, status: int
    ) -> Decision:
        """Log the request's decision, and learn the server's prefill and decode rates from
        its timings (what the wait for a prefix in flight is weighed with)."""
        # A server that reports no usable numbers keeps the rates it had.
        if timings and status == 200:
            with contextlib.suppress(TypeError, ValueError):
                lease.server.rates.observe(
                    int(timings.get("prompt_n", 0)),
                    float(timings.get("prompt_ms", 0.0)),
                    int(timings.get("predicted_n", 0)),
                    float(timings.get("predicted_ms", 0.0)),
                )
        return self.log.add(lease, timings, ttft_s, status)
