"""The remote tier: KV chunks shared by a fleet of proxies through Valkey (or Redis).

After a save, the chunks of the prompt's KV that the host tree holds and the store is not
known to hold are copied out and queued (bounded in bytes; past the cap a write is dropped
and counted) for one writer task, which writes each once (``SET NX``: another proxy's copy
is kept). Before a request is planned, the store is asked (one pipelined ``EXISTS`` per
chunk) how far it carries the request past the RAM tree, a slot or a resident prefix; when
that is at least ``min_tokens`` and reading it is cheaper than computing it at the measured
rates, the chunks are read (one ``MGET``), every byte checked (``remotekeys.verify_chunk``:
the disk tier's MAC and header checks), and inserted into the RAM tree, so the plan sees an
ordinary host hit (route H). Every store call runs under a deadline; any failure (timeout,
refused connection, an error reply, a missing or forged chunk) is counted by cause and the
request goes on with the local tiers or a prefill. After a failure the store is left alone
for ``backoff_s`` (counted ``down``), so a dead store costs no request its deadline.
See docs/scale-out.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from redis import asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.core.arena import chunk_bounds
from proxy.core.diskindex import DiskEntryError
from proxy.core.payload import KvLayout, KvSegment, blob_size
from proxy.core.radix import RadixTree
from proxy.core.remotekeys import (
    ChunkRef,
    RemoteFallback,
    StoreRate,
    WriteDrop,
    chunk_refs,
    chunk_spans,
    encode_chunk,
    verify_chunk,
)
from proxy.server.dataplane.arena import Arena, ArenaBlock, rows_into_blocks
from proxy.server.metrics.remote import RemoteMetrics

log = logging.getLogger("radix")

T = TypeVar("T")
KNOWN_KEYS = 1 << 16  # keys this proxy wrote or saw lately: not offered to the store again


@dataclass(frozen=True)
class RemoteSettings:
    key_prefix: str
    min_tokens: int
    queue_bytes: int
    timeout_s: float
    backoff_s: float
    ttl_s: int  # 0: no expiry (the store's maxmemory-policy evicts)


@dataclass
class _Write:
    key: str
    ns: str
    path: np.ndarray  # tokens[0:b]
    rows: np.ndarray  # uint8 (b - a, row bytes), a copy

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes)


def _cause(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | RedisTimeoutError):
        return RemoteFallback.TIMEOUT
    if isinstance(exc, RedisConnectionError | OSError):
        return RemoteFallback.CONNECTION
    return RemoteFallback.ERROR


class RemoteTier:
    def __init__(
        self,
        client: aioredis.Redis,
        compat: bytes,
        secret: bytes,
        layout: KvLayout,
        chunk_tokens: int,
        metrics: RemoteMetrics,
        settings: RemoteSettings,
        *,
        arena: Arena | None = None,
        on_arena_full: Callable[[], None] = lambda: None,
        where: str = "",
    ) -> None:
        self.client = client
        self.compat = compat
        self.secret = secret
        self.layout = layout
        self.chunk = chunk_tokens
        self.metrics = metrics
        self.settings = settings
        self.arena = arena
        self.on_arena_full = on_arena_full
        self.where = where  # the store's address without credentials, for logs and stats
        self.rate = StoreRate()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="radix-remote")
        self._queue: deque[_Write] = deque()
        self._queued = 0
        self._known: OrderedDict[str, None] = OrderedDict()
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._closing = False
        self._down_until = 0.0

    # ---- start and stop ----------------------------------------------------------------

    async def open(self) -> None:
        """Start the writer; a store that does not answer now is only logged (asked again
        after the backoff), never a reason not to serve."""
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                await self.client.ping()
            log.info("remote tier: %s answers; chunks of %d tokens", self.where, self.chunk)
            self.metrics.up.set(1)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(exc, "ping")
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())

    async def close(self, timeout_s: float) -> bool:
        """Finish the queue within `timeout_s`, stop; False when writes were left."""
        self._closing = True
        self._wake.set()
        done = True
        if self._writer is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._writer), timeout_s)
            except TimeoutError:
                log.warning("remote tier: %d chunks not written by the shutdown deadline", len(self._queue))
                self._writer.cancel()
                done = False
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                await self.client.aclose()
        except (RedisError, OSError, TimeoutError):
            pass
        return done

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every queued write is done or dropped; False past `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._queue or self._queued:
                    await asyncio.sleep(0.01)
        except TimeoutError:
            return False
        return True

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    # ---- writes ------------------------------------------------------------------------

    def publish(self, tree: RadixTree, tokens: np.ndarray, ns: str) -> None:
        """Queue the whole chunks of `tokens` the RAM tree holds and the store is not known to
        hold. Synchronous: the rows are copied now (the tree may evict them after)."""
        if self._closing:
            return
        match = tree.match(tokens, touch=False, ns=ns)
        spans = chunk_spans(0, match.length, self.chunk)
        if not spans:
            return
        refs = chunk_refs(tokens, ns, self.compat, self.secret, spans, self.settings.key_prefix)
        fresh = [r for r in refs if r.key not in self._known]
        if not fresh:
            return
        if self.down:
            self.metrics.write_dropped.labels(WriteDrop.DOWN).inc(len(fresh))
            return
        for ref in fresh:
            nbytes = (ref.b - ref.a) * self.layout.bytes_per_token
            if self._queued + nbytes > self.settings.queue_bytes:
                self.metrics.write_dropped.labels(WriteDrop.QUEUE_FULL).inc()
                continue
            segs = tree.segments(match, ref.a, ref.b)
            rows = segs[0].rows() if len(segs) == 1 else np.concatenate([s.rows() for s in segs])
            self._queue.append(_Write(ref.key, ns, np.array(tokens[: ref.b], dtype=np.int32), rows))
            self._queued += nbytes
            self._remember(ref.key)  # queued once: a second save of it does not queue it again
        self.metrics.queue_bytes.set(self._queued)
        self._wake.set()

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
            except Exception:  # a bug here must not stop writes for the process's life
                log.exception("remote tier: writing a chunk failed")
                self.metrics.write_dropped.labels(WriteDrop.ERROR).inc()
                self._forget(job.key)
            finally:
                self._queued -= job.nbytes
                self.metrics.queue_bytes.set(self._queued)

    async def _write(self, job: _Write) -> None:
        if self.down:
            self.metrics.write_dropped.labels(WriteDrop.DOWN).inc()
            self._forget(job.key)
            return
        try:
            value = await self._io(encode_chunk, self.compat, self.secret, job.ns, job.path, job.rows)
            async with asyncio.timeout(self.settings.timeout_s):
                if await self.client.exists(job.key):
                    return  # another proxy wrote it: not sent again
                ttl = self.settings.ttl_s or None
                written = await self.client.set(job.key, value, ex=ttl, nx=True)
        except (RedisError, OSError, TimeoutError) as exc:
            self.metrics.write_dropped.labels(_cause(exc)).inc()
            self._failed(exc, "write")
            self._forget(job.key)
            return
        self.metrics.up.set(1)
        if written:
            self.metrics.writes.inc()
            self.metrics.written_bytes.inc(len(value))

    # ---- reads -------------------------------------------------------------------------

    async def promote(
        self,
        tree: RadixTree,
        tokens: np.ndarray,
        ns: str,
        floor: int = 0,
        prefill_s_per_token: float = 1 / 200,
    ) -> int:
        """When the store carries the request past the RAM tree and `floor` (a slot's or a
        resident prefix's match) by at least ``min_tokens``, and reading is cheaper than
        computing, read those chunks, check them, insert them into the RAM tree. Returns the
        tokens inserted; 0 when nothing was worth it or anything failed."""
        ram = tree.match(tokens, touch=False, ns=ns)
        have = max(floor, ram.length)
        spans = chunk_spans(ram.length, len(tokens), self.chunk)
        if not spans or spans[-1][1] - have < self.settings.min_tokens:
            return 0
        if self.down:
            self.metrics.fallbacks.labels(RemoteFallback.DOWN).inc()
            return 0
        refs = chunk_refs(tokens, ns, self.compat, self.secret, spans, self.settings.key_prefix)
        try:
            found = await self._lookup(refs)
        except (RedisError, OSError, TimeoutError) as exc:
            self.metrics.fallbacks.labels(_cause(exc)).inc()
            self._failed(exc, "lookup")
            return 0
        self.metrics.lookups.inc()
        self.metrics.up.set(1)
        if found < len(refs):
            self._forget(refs[found].key)  # gone from the store (evicted, flushed): written again
        refs = refs[:found]
        if not refs or refs[-1].b - have < self.settings.min_tokens:
            return 0
        nbytes = (refs[-1].b - refs[0].a) * (self.layout.bytes_per_token + 4)
        if not self.rate.worth(nbytes, refs[-1].b - have, prefill_s_per_token, self.settings.timeout_s):
            self.metrics.fallbacks.labels(RemoteFallback.PRICED_OUT).inc()
            return 0
        return await self._read_into(tree, tokens, ns, ram.length, refs)

    async def _lookup(self, refs: list[ChunkRef]) -> int:
        """How many of `refs`, from the first, the store holds."""
        async with asyncio.timeout(self.settings.timeout_s):
            pipe = self.client.pipeline(transaction=False)
            for ref in refs:
                pipe.exists(ref.key)
            held = await pipe.execute()
        n = 0
        while n < len(held) and held[n]:
            n += 1
        return n

    async def _read_into(
        self, tree: RadixTree, tokens: np.ndarray, ns: str, p0: int, refs: list[ChunkRef]
    ) -> int:
        reach = refs[-1].b
        ram = tree.match(tokens, touch=False, ns=ns)
        if ram.length != p0:  # the tree changed during the lookup: plan without the store
            return 0
        tree.pin(ram)
        into = self._blocks(p0, reach)
        held = tree.reserve(self.layout.bytes_per_token * (reach - p0))
        try:
            run = await self._read(refs, ns, p0, into)
            if run is None:
                return 0
            tree.release(held)  # the same step as the insert that counts them
            held = 0
            stored = tree.insert_run(tokens[:reach], run, ns=ns)
        finally:
            tree.release(held)
            tree.unpin(ram)
        for ref in refs:
            self._remember(ref.key)
        self.metrics.promotions.inc()
        self.metrics.promoted_tokens.inc(stored)
        return stored

    async def _read(
        self,
        refs: list[ChunkRef],
        ns: str,
        p0: int,
        into: tuple[list[ArenaBlock], list[tuple[int, int]]] | None,
    ) -> list[KvSegment] | None:
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                values = await self.client.mget([r.key for r in refs])
        except (RedisError, OSError, TimeoutError) as exc:
            self.metrics.fallbacks.labels(_cause(exc)).inc()
            self._failed(exc, "read")
            values = None
        if values is not None:
            self.rate.observe(sum(len(v) for v in values if v is not None), time.monotonic() - t0)
            if any(v is None for v in values):
                self.metrics.fallbacks.labels(RemoteFallback.MISSING).inc()
                values = None
        if values is None:
            if into is not None:
                into[0].clear()  # the blocks are free now (no thread writes them)
            return None
        try:
            # Local work bounded by the bytes read (priced above), not by the store's deadline:
            # a check cut short would leave its thread writing blocks given to another move.
            return await self._io(self._checked, refs, values, ns, p0, into)
        except DiskEntryError as exc:
            self.metrics.fallbacks.labels(RemoteFallback.REFUSED).inc()
            self.metrics.refused.labels(exc.cause).inc()
            log.warning("remote tier: a chunk was refused, the request is planned without it: %s", exc)
            if exc.name:
                self._forget(exc.name)
                await self._delete(exc.name)
        return None

    def _checked(
        self,
        refs: list[ChunkRef],
        values: list[Any],
        ns: str,
        p0: int,
        into: tuple[list[ArenaBlock], list[tuple[int, int]]] | None,
    ) -> list[KvSegment]:
        """Every chunk verified (on the tier's threads), then its rows from `p0` on."""
        try:
            return self._rows(refs, values, ns, p0, into)
        except BaseException:
            if into is not None:
                into[0].clear()  # the blocks are free now, not when the traceback goes
            raise

    def _rows(
        self,
        refs: list[ChunkRef],
        values: list[Any],
        ns: str,
        p0: int,
        into: tuple[list[ArenaBlock], list[tuple[int, int]]] | None,
    ) -> list[KvSegment]:
        parts = []
        for ref, raw in zip(refs, values, strict=True):
            try:
                rows = verify_chunk(raw, ref, self.compat, self.secret, ns, self.layout.bytes_per_token)
            except DiskEntryError as exc:
                raise DiskEntryError(exc.cause, f"{ref.key}: {exc}", ref.key) from None
            parts.append(rows)
        allrows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        allrows = allrows[p0 - refs[0].a :]
        if into is not None:
            return rows_into_blocks(into[0], into[1], self.layout, allrows, p0)
        return [KvSegment.from_rows(p0, self.layout, allrows)]

    def _blocks(self, p0: int, p1: int) -> tuple[list[ArenaBlock], list[tuple[int, int]]] | None:
        """Arena blocks for [p0, p1), one per chunk as an export's; None without an arena or
        room in it (the read then goes into ordinary memory, counted)."""
        if self.arena is None:
            return None
        bounds = chunk_bounds(p0, p1, self.chunk)
        blocks = self.arena.take([blob_size(self.layout, b - a) for a, b in bounds], self.arena.make_room)
        if blocks is None:
            self.on_arena_full()
            return None
        return blocks, bounds

    # ---- helpers -----------------------------------------------------------------------

    async def _delete(self, key: str) -> None:
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                await self.client.delete(key)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(exc, "delete")

    def _failed(self, exc: BaseException, what: str) -> None:
        if not self.down:
            log.warning(
                "remote tier %s: %s failed (%s: %s); not asked for %g s",
                self.where,
                what,
                _cause(exc),
                exc,
                self.settings.backoff_s,
            )
        self._down_until = time.monotonic() + self.settings.backoff_s
        self.metrics.up.set(0)

    def _remember(self, key: str) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)

    def _forget(self, key: str) -> None:
        self._known.pop(key, None)

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
