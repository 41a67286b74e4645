"""The disk tier's I/O: the directory, atomic segment files, demotion, promotion, startup scan.

Segments the RAM tree evicts are queued (bounded in bytes) and written by one writer task;
a match that ends where the disk goes on is read back, every byte checked, and inserted
into the RAM tree before the request is planned, so the restore is an ordinary host hit.
All file work runs on a small thread pool, each call under a deadline: the event loop
never waits on the disk. Writes are atomic (a temporary file in the same directory,
fsync, rename, fsync of the directory), so a proxy killed mid-write leaves at most a
temporary file, which the next start deletes. Any write error (a full or read-only disk)
is counted by cause and serving goes on; any entry that fails a check is deleted, counted
by cause, and the request is prefilled. See docs/disk-tier.md.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from proxy.core.arena import auto_chunk, chunk_bounds
from proxy.core.diskindex import (
    HEADER_BYTES,
    DemoteFailure,
    DiskEntry,
    DiskEntryError,
    DiskIndex,
    DiskMatch,
    DropCause,
    sha,
)
from proxy.core.payload import KvLayout, KvSegment, blob_size
from proxy.core.radix import HostMatch, RadixTree, Spill
from proxy.server.dataplane.arena import Arena, ArenaBlock
from proxy.server.metrics import DiskMetrics
from proxy.server.tiers.disk_files import (
    default_key_file,
    load_secret,
    read_segment,
    scan_entries,
    unlink_all,
    write_entry,
)

log = logging.getLogger("radix")

T = TypeVar("T")


def compat_key(compat: dict[str, Any]) -> bytes:
    """sha256 of the servers' compatibility key as canonical JSON."""
    return sha(json.dumps(compat, sort_keys=True, separators=(",", ":")).encode())


@dataclass
class _Job:
    spill: Spill
    nbytes: int


def _failure(exc: OSError) -> DemoteFailure:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return DemoteFailure.NO_SPACE
    if exc.errno == errno.EROFS:
        return DemoteFailure.READ_ONLY
    if exc.errno in (errno.EACCES, errno.EPERM):
        return DemoteFailure.PERMISSION
    return DemoteFailure.IO


class DiskTier:
    def __init__(
        self,
        directory: Path,
        budget_bytes: int,
        key: bytes,
        layout: KvLayout,
        metrics: DiskMetrics,
        *,
        min_tokens: int,
        queue_bytes: int,
        timeout_s: float,
        key_file: Path | None = None,
        arena: Arena | None = None,
        chunk_tokens: int = 0,
        on_arena_full: Callable[[], None] = lambda: None,
    ) -> None:
        self.directory = directory
        self.key = key
        # The entries' MAC key: outside the directory, so write access to the entries alone
        # cannot forge one (docs/disk-tier.md).
        self.key_file = key_file or default_key_file(directory)
        self.secret = b""
        self.layout = layout
        self.metrics = metrics
        self.arena = arena  # promotions are read into its blocks (the tree's KV memory)
        self.chunk_tokens = chunk_tokens or auto_chunk(layout.bytes_per_token)
        self.on_arena_full = on_arena_full
        self.min_tokens = min_tokens
        self.queue_bytes = queue_bytes
        self.timeout_s = timeout_s
        self.index = DiskIndex(budget_bytes)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="radix-disk")
        self._queue: deque[_Job] = deque()
        self._queued = 0
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._closing = False
        self.usable = True  # False when the directory could not be opened at all

    # ---- start and stop ----------------------------------------------------------------

    async def open(self) -> None:
        """Create the directory (owner only), delete temporary files, index valid entries."""
        try:
            self.secret = await self._io(load_secret, self.key_file, timeout=None)
            found, drops = await self._io(
                scan_entries, self.directory, self.key, self.secret, self.layout.bytes_per_token, timeout=None
            )
        except OSError as exc:
            self.usable = False
            log.error("disk tier %s cannot be used, serving from RAM only: %s", self.directory, exc)
            return
        for cause, n in drops.items():
            self.metrics.dropped.labels(cause).inc(n)
        for header, tokens in found:
            self.index.add(DiskEntry(header, tokens))
        await self._delete(self.index.evict_for(0))
        self._sync()
        st = self.index.stats()
        log.info(
            "disk tier %s: %d entries, %d tokens, %.1f MiB of %.1f MiB%s",
            self.directory,
            st.entries,
            st.tokens,
            st.bytes / 2**20,
            st.budget_bytes / 2**20,
            "".join(f", {n} dropped ({c})" for c, n in drops.items()),
        )
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())

    async def close(self, tree: RadixTree | None, timeout_s: float) -> bool:
        """Copy what RAM holds and the disk lacks (when `tree` is given), finish the queue
        within `timeout_s`, stop. What is not written by then is lost, not half-written; False
        then (a write may still be running in the pool)."""
        if tree is not None and self.usable:
            for spill in tree.spill_all():
                self.demote(spill, flush=True)
        self._closing = True
        self._wake.set()
        if self._writer is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._writer), timeout_s)
            except TimeoutError:
                log.warning("disk tier: %d segments not written by the shutdown deadline", len(self._queue))
                self._writer.cancel()
                self._pool.shutdown(wait=False, cancel_futures=True)
                return False
        self._pool.shutdown(wait=False, cancel_futures=True)
        return True

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every queued demotion is written or failed; False past `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._queue or self._queued:
                    await asyncio.sleep(0.01)
        except TimeoutError:
            return False
        return True

    # ---- demotion ----------------------------------------------------------------------

    def demote(self, spill: Spill, flush: bool = False) -> None:
        """The RAM tree dropped (or, at shutdown, offers: `flush`, views of what it keeps, so
        not bounded by the queue) this segment: queue it for the disk. Synchronous and
        quick: called from inside the tree's eviction."""
        if not self.usable:
            self.metrics.demotion_failures.labels(DemoteFailure.IO).inc()
            return
        rest = self._uncovered(spill)
        if rest is None:
            return
        seg = rest.segment
        nbytes = HEADER_BYTES + seg.n * (4 + seg.layout.bytes_per_token)
        if nbytes > self.index.budget_bytes:
            self.metrics.demotion_failures.labels(DemoteFailure.TOO_LARGE).inc()
        elif (not flush and self._queued + seg.nbytes > self.queue_bytes) or self._closing:
            self.metrics.demotion_failures.labels(DemoteFailure.QUEUE_FULL).inc()
        else:
            self._queue.append(_Job(rest, nbytes))
            self._queued += seg.nbytes
            self._wake.set()

    def _uncovered(self, spill: Spill) -> Spill | None:
        """The part of `spill` the disk does not hold yet (None: all of it is there, e.g. it
        was promoted from there). What is there is marked used: it was in use until now."""
        seg = spill.segment
        held = self.index.covers(spill.path, spill.ns, seg.p0)
        self.index.touch(p.entry for p in held.pieces)
        if held.reach >= seg.p1:
            return None
        if held.reach > seg.p0:  # a shared part is stored once: write only the rest
            return Spill(spill.ns, spill.path, seg.slice(held.reach, seg.p1))
        return spill

    async def _write_loop(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            job = self._queue.popleft()
            try:
                await self._write(job)
            except Exception:  # a bug here must not stop demotions for the process's life
                log.exception("disk tier: writing a segment failed")
                self.metrics.demotion_failures.labels(DemoteFailure.IO).inc()
            finally:
                self._queued -= job.spill.segment.nbytes

    async def _write(self, job: _Job) -> None:
        rest = self._uncovered(job.spill)
        if rest is None:
            return
        spill = rest
        await self._delete(self.index.evict_for(job.nbytes))
        try:
            header = await self._io(write_entry, self.directory, self.key, self.secret, spill)
        except OSError as exc:
            cause = _failure(exc)
            self.metrics.demotion_failures.labels(cause).inc()
            log.warning("disk tier: a demotion failed (%s): %s", cause, exc)
            return
        except TimeoutError:
            self.metrics.demotion_failures.labels(DemoteFailure.TIMEOUT).inc()
            return
        tokens = np.asarray(spill.path[spill.start :], dtype=np.int32)
        # Others may have filled the disk while this one was written: keep to the budget.
        await self._delete(self.index.evict_for(header.size))
        if self.index.add(DiskEntry(header, tokens.copy())):
            self.metrics.demotions.inc()
            self.metrics.demoted_bytes.inc(header.size)
        self._sync()

    # ---- promotion ---------------------------------------------------------------------

    def would_promote(self, tree: RadixTree, tokens: np.ndarray, ns: str, floor: int = 0) -> bool:
        """Whether ``promote`` would read from the disk (and wait for it); else it returns 0 at
        once, without yielding to the event loop."""
        return self._worth(tree, tokens, ns, floor) is not None

    def _worth(
        self, tree: RadixTree, tokens: np.ndarray, ns: str, floor: int
    ) -> tuple[HostMatch, DiskMatch] | None:
        if not self.usable:
            return None
        ram = tree.match(tokens, touch=False, ns=ns)
        found = self.index.walk(tokens, ns, ram.length)
        if found.gain <= 0 or found.reach - max(floor, ram.length) < self.min_tokens:
            return None
        return ram, found

    async def promote(self, tree: RadixTree, tokens: np.ndarray, ns: str, floor: int = 0) -> int:
        """When the disk carries the request's match past both the RAM tree and `floor` (what a
        slot or a resident prefix already offers) by at least `min_tokens`, read those entries,
        check every byte, and insert them into the RAM tree. Returns the tokens inserted; 0
        when nothing was worth it or anything failed (then the request is planned as before)."""
        worth = self._worth(tree, tokens, ns, floor)
        if worth is None:
            return 0
        ram, found = worth
        entries = [p.entry for p in found.pieces]
        tree.pin(ram)
        self.index.pin(entries)
        # The blocks first: the edges they evict count for the tree's budget too (a reserve
        # first would evict as much again for the same room).
        into = self._blocks(ram.length, found.reach)
        held = tree.reserve(self.layout.bytes_per_token * found.gain)
        try:
            run = await self._read(found, tokens, ram.length, into)
            if run is None:
                return 0
            tree.release(held)  # the same step as the insert that counts them
            held = 0
            stored = tree.insert_run(tokens[: found.reach], run, ns=ns)
        finally:
            tree.release(held)
            self.index.unpin(entries)
            tree.unpin(ram)
        self.index.touch(entries)
        self.metrics.promotions.inc()
        self.metrics.promoted_tokens.inc(stored)
        self._sync()
        return stored

    def _blocks(self, p0: int, p1: int) -> tuple[list[ArenaBlock], list[tuple[int, int]]] | None:
        """Arena blocks for positions [p0, p1), one per chunk as an export's (each an edge of
        the tree, imported in place later); None without an arena or room in it (then the
        read goes into ordinary memory, counted)."""
        if self.arena is None:
            return None
        bounds = chunk_bounds(p0, p1, self.chunk_tokens)
        blocks = self.arena.take([blob_size(self.layout, b - a) for a, b in bounds], self.arena.make_room)
        if blocks is None:
            self.on_arena_full()
            return None
        return blocks, bounds

    async def _read(
        self,
        found: DiskMatch,
        tokens: np.ndarray,
        p0: int,
        into: tuple[list[ArenaBlock], list[tuple[int, int]]] | None,
    ) -> list[KvSegment] | None:
        # A read past its deadline still runs on its thread: its arguments keep the blocks it
        # writes alive until it returns, so no other move is given them meanwhile.
        try:
            return await self._io(
                read_segment, self.directory, self.key, self.secret, found, tokens, self.layout, p0, into
            )
        except DiskEntryError as exc:
            self.metrics.dropped.labels(exc.cause).inc()
            log.warning("disk tier: entry dropped, the request is prefilled: %s", exc)
            bad = self.index.get(exc.name) if exc.name else None
            if bad is not None:
                self.index.remove(bad)  # its pins are this read's: unpin() of a dead entry is a no-op
                await self._delete([bad], evicted=False)
                self._sync()
        except (OSError, TimeoutError) as exc:
            self.metrics.dropped.labels(DropCause.IO).inc()
            log.warning("disk tier: a read failed, the request is prefilled: %s", exc)
        return None

    # ---- helpers -----------------------------------------------------------------------

    async def _delete(self, entries: list[DiskEntry], evicted: bool = True) -> None:
        if not entries:
            return
        if evicted:
            self.metrics.evictions.inc(len(entries))
        names = [e.name for e in entries]
        try:
            await self._io(unlink_all, self.directory, names)
        except (OSError, TimeoutError) as exc:
            log.warning("disk tier: deleting %d entries failed: %s", len(names), exc)

    async def _io(self, fn: Callable[..., T], *args: Any, timeout: float | None = -1.0) -> T:
        """`fn(*args)` on the tier's threads, bounded by the tier's deadline."""
        limit = self.timeout_s if timeout == -1.0 else timeout
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        return await asyncio.wait_for(fut, limit)

    def _sync(self) -> None:
        st = self.index.stats()
        self.metrics.tier_bytes.labels("disk").set(st.bytes)
        self.metrics.tier_budget.labels("disk").set(st.budget_bytes)
        self.metrics.tier_entries.labels("disk").set(st.entries)
