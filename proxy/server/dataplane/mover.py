"""KV moves between one server and the host: export a range, import segments.

Same host: payloads go through files in the shared-memory directory that both the proxy
and the server were given, mapped on both sides: the server copies between the file and
its KV cache, the proxy between the file and its segments (block copies), one copy each. Other
hosts: inline msgpack bytes. Parsing and building payloads run in a worker thread so the
event loop keeps serving while megabytes are copied.

With the arena (proxy/server/dataplane/arena.py, servers with chunked exports), neither file is used:
an export writes each chunk's blob straight into arena blocks and its segments are views of
them; an import names the whole blocks of its segments by offset and stages only the rest (a
tree edge split inside a chunk) into temporary blocks. One copy per move, the server's, for
everything but the staged parts. A full arena falls back to the files (proxy/server/dataplane/payfile.py),
and so does a server that keeps more than its share of the arena quarantined.

Payload files are reused: a fresh tmpfs file costs a page allocation and a fault per page,
about as much as the copy itself. One idle file per direction (pages allocated, kept mapped)
waits for the next move. An import file goes back to its pool only after the server answered
the import: the server reads it in place, so a file whose import failed, timed out or was
cancelled may still be read and is removed, never rewritten. An export file is given to the
server to write in place (``in_place``); the proxy reads it only after the server answered
that it wrote it there, and pools it again only after that read: a file whose export
failed, timed out or was cancelled may still be written and is removed, never read or reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import mmap
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from proxy.core.arena import auto_chunk, chunk_bounds
from proxy.core.payload import KvLayout, KvSegment, blob_size, parse_blob, write_blob
from proxy.core.routing import MeasuredRates
from proxy.errors import FallbackCause, KvMoveError, PayloadError
from proxy.server.dataplane.arena import Arena, ArenaBlock, block_segments, stage_runs
from proxy.server.dataplane.backend import ServerClient, move_timeout_s
from proxy.server.dataplane.paydir import private_dir_fd
from proxy.server.dataplane.payfile import POPULATE, PayloadFile, file_in_thread
from proxy.server.metrics import Metrics

_names = itertools.count()
log = logging.getLogger("radix")
INLINE_LIMIT = 64 << 20  # the server's limit on an inline (in-body) payload


class KvMover:
    def __init__(
        self,
        backend: ServerClient,
        layout: KvLayout | None,
        compat: dict[str, Any],
        shm_dir: Path | None,
        metrics: Metrics,
        rates: MeasuredRates | None = None,
        arena: Arena | None = None,
        chunk_tokens: int = 0,
        n_ctx_slot: int = 1 << 30,
    ) -> None:
        self.backend = backend
        # The arena and its chunk size, for a same-host server with chunked exports (else None).
        self.arena = arena if shm_dir is not None else None
        self._chunk_tokens = chunk_tokens  # 0: auto_chunk of the layout
        self._n_ctx_slot = n_ctx_slot  # the server refuses a chunk longer than a slot
        # The server's rates: each move teaches its export or import rate (the cost model's).
        self.rates = rates if rates is not None else MeasuredRates()
        self.layout = layout  # None: KV moves are off for this server (ServerState.moves_off)
        self.compat = compat
        self.shm_dir = shm_dir
        # Payload files are made, opened and removed relative to this (never by path).
        self._dir_fd = private_dir_fd(shm_dir) if shm_dir is not None else -1
        self.metrics = metrics
        self._idle: PayloadFile | None = None  # the import file waiting for the next import
        self._idle_out: PayloadFile | None = None  # the export file waiting for the next export
        self._over_quarantine = False  # warned that the arena is off for it (too much quarantined)

    @property
    def chunk_tokens(self) -> int:
        """Tokens per arena block for this server's KV layout."""
        return min(self._chunk_tokens or auto_chunk(self.bytes_per_token), self._n_ctx_slot)

    @property
    def bytes_per_token(self) -> int:
        """What one token's KV costs in the host tree (0 when moves are off)."""
        return self.layout.bytes_per_token if self.layout is not None else 0

    def _usable_arena(self) -> Arena | None:
        """The arena, unless this server holds too much of it quarantined (then payload files
        until it is a new process; said once)."""
        if self.arena is None or self.arena.may_move(self):
            self._over_quarantine = False
            return self.arena
        if not self._over_quarantine:
            self._over_quarantine = True
            log.warning(
                "%s: %d MiB of the KV arena are kept for moves it never answered; its moves go "
                "through payload files until it restarts",
                self.backend.url,
                self.arena.quarantined_by(self) >> 20,
            )
        return None

    def _layout(self) -> KvLayout:
        if self.layout is None:  # never planned (routes.py plans no move for it): a guard
            raise KvMoveError(FallbackCause.COMPAT, "KV moves are off for this server")
        return self.layout

    def _new_name(self) -> str:
        return f"radix-{os.getpid()}-{next(_names)}.kv"

    async def export(
        self,
        seq: dict[str, int],
        p0: int,
        tokens: Sequence[int] | np.ndarray,
        hold: contextlib.AbstractAsyncContextManager[Any] | None = None,
    ) -> list[KvSegment]:
        """The KV of positions ``[p0, len(tokens))`` of a slot's or owner's sequence, verified:
        adjacent segments (one per chunk with the arena, else one).

        Bound to ``tokens`` (invariant 6): the server checks that the sequence holds exactly
        these tokens at ``[0, len(tokens))`` when it exports, else KvMoveError(CONFLICT).

        ``hold`` (the server's move lock) is held only around the server's part: reading the
        payload back into rows needs the server no more, and a restore waiting for the lock
        should not wait for it."""
        started = time.perf_counter()
        p1 = len(tokens)
        layout = self._layout()
        if (arena := self._usable_arena()) is not None:
            run = await self._export_to_arena(arena, seq, p0, tokens, hold)
            if run is not None:
                self.metrics.kv_move_bytes.labels("export").inc(sum(s.nbytes for s in run))
                self.metrics.kv_move_seconds.labels("export").inc(time.perf_counter() - started)
                return run
        size = blob_size(layout, p1 - p0)
        file: PayloadFile | None = None
        try:
            if self.shm_dir is not None:
                # Taken on the event loop, so concurrent exports never share a file.
                file, self._idle_out = self._idle_out, None
                try:
                    file = await file_in_thread(self._out_file, file, size)
                except OSError as exc:
                    file = None  # _out_file closed the idle file it was given: never pooled again
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise KvMoveError(
                            FallbackCause.NO_SPACE, f"no room for the export file: {exc}"
                        ) from exc
                    raise
            name = file.name if file is not None else None
            async with hold or contextlib.nullcontext():
                reply = await self.backend.export(seq, p0, tokens, name, move_timeout_s(size), in_place=True)
            if reply.compat != self.compat:
                raise KvMoveError(FallbackCause.COMPAT, "exported payload has another compatibility key")
            copied = time.perf_counter()
            if file is None:
                if reply.data is None:
                    raise KvMoveError(FallbackCause.EXPORT, "an inline export's reply holds no data")
                segment = await asyncio.to_thread(parse_blob, reply.data, layout)
            elif reply.in_place:
                # Answered: the server wrote the file and is done with it.
                segment = await asyncio.to_thread(self._read_mapped, file, size)
                self._put_idle_out(file)
                file = None
            else:
                # A server without in-place exports wrote a new file under the name: our mapping
                # is stale, read the new file and drop both.
                segment = await asyncio.to_thread(self._read_file, file.name)
            proxy_s = time.perf_counter() - copied
        except PayloadError as exc:
            raise KvMoveError(FallbackCause.PAYLOAD, str(exc)) from exc
        except OSError as exc:
            raise KvMoveError(FallbackCause.TRANSPORT, f"export payload unreadable: {exc}") from exc
        finally:
            if file is not None:
                file.close()  # not answered (or not in place): never read or written again
        if (segment.p0, segment.p1) != (p0, p1):
            raise KvMoveError(FallbackCause.VERIFY, f"asked for [{p0},{p1}), got [{segment.p0},{segment.p1})")
        self.rates.observe_move("export", reply.size, _seconds(reply.t_ms), proxy_s)
        self.metrics.kv_move_bytes.labels("export").inc(segment.nbytes)
        self.metrics.arena_move_bytes.labels("export", "file").inc(segment.nbytes)
        self.metrics.kv_move_seconds.labels("export").inc(time.perf_counter() - started)
        return [segment]

    async def _export_to_arena(
        self,
        arena: Arena,
        seq: dict[str, int],
        p0: int,
        tokens: Sequence[int] | np.ndarray,
        hold: contextlib.AbstractAsyncContextManager[Any] | None,
    ) -> list[KvSegment] | None:
        """The export as one blob per chunk, written by the server into arena blocks; the
        segments are views of them. None when the arena has no room (the caller uses a file)."""
        layout = self._layout()
        chunks = chunk_bounds(p0, len(tokens), self.chunk_tokens)
        sizes = [blob_size(layout, c1 - c0) for c0, c1 in chunks]
        blocks = arena.take(sizes, arena.make_room)
        if blocks is None:
            self.metrics.arena_full.labels("export").inc()
            return None
        run: list[KvSegment] = []
        sent = answered = False
        try:
            async with hold or contextlib.nullcontext():
                sent = True  # from here the server may get it: without an answer, it may still run it
                reply = await self.backend.export(
                    seq,
                    p0,
                    tokens,
                    arena.name,
                    move_timeout_s(sum(sizes)),
                    in_place=True,
                    chunk=self.chunk_tokens,
                    offsets=[b.offset for b in blocks],
                )
            answered = True
            if reply.compat != self.compat:
                raise KvMoveError(FallbackCause.COMPAT, "exported payload has another compatibility key")
            want = tuple((c0, c1, b.offset, n) for (c0, c1), b, n in zip(chunks, blocks, sizes, strict=True))
            if reply.chunks != want:
                raise KvMoveError(
                    FallbackCause.VERIFY, f"asked for chunks {want}, the server wrote {reply.chunks}"
                )
            copied = time.perf_counter()
            run = await asyncio.to_thread(block_segments, blocks, layout)
            got = [(seg.p0, seg.p1) for seg in run]
            if got != chunks:
                raise KvMoveError(FallbackCause.VERIFY, f"asked for {chunks}, got {got}")
        except PayloadError as exc:
            run.clear()
            raise KvMoveError(FallbackCause.PAYLOAD, str(exc)) from exc
        except BaseException as exc:
            run.clear()  # freed now, not when the traceback goes
            if sent and not answered:
                arena.quarantine_unanswered(exc, blocks, self)
            raise
        finally:
            blocks.clear()  # from here on only the segments keep their blocks
        self.rates.observe_move("export", reply.size, _seconds(reply.t_ms), time.perf_counter() - copied)
        self.metrics.arena_move_bytes.labels("export", "in_place").inc(sum(seg.nbytes for seg in run))
        return run

    async def import_(
        self,
        slot: int,
        p0: int,
        tokens: Sequence[int],
        segments: Sequence[KvSegment],
        hold: contextlib.AbstractAsyncContextManager[Any] | None = None,
        lora: Sequence[Mapping[str, Any]] | None = None,
        media: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """Write ``segments`` (covering ``[p0, len(tokens))``) into an idle slot; the server verifies.
        ``lora``: the adapters the KV was computed with (None: the server's own), which the slot takes.
        ``media``: the media chunks that start in the range (``Tokenized.chunks_in``), which it takes too.

        ``hold`` (the server's move lock) is held only around the server's part: the payload
        is written before it is taken."""
        started = time.perf_counter()
        p1 = len(tokens)
        n = sum(s.n for s in segments)
        if n != p1 - p0 or (segments and segments[0].p0 != p0):
            raise KvMoveError(
                FallbackCause.VERIFY,
                f"segments cover {n} tokens from {segments[0].p0 if segments else p0}, need [{p0},{p1})",
            )
        body: dict[str, Any] = {
            "slot": slot,
            "p0": p0,
            "p1": p1,
            "tokens": [int(t) for t in tokens],
            "compat": self.compat,
        }
        if lora is not None:
            body["lora"] = list(lora)
        if media:
            body["media"] = list(media)
        arena = self._usable_arena()
        if arena is not None and await self._import_from_arena(arena, body, segments, hold):
            self.metrics.kv_move_seconds.labels("import").inc(time.perf_counter() - started)
            return
        size = blob_size(self._layout(), n)
        file: PayloadFile | None = None
        copied = time.perf_counter()
        try:
            if self.shm_dir is not None:
                # Taken on the event loop, so concurrent imports never share a file.
                file, self._idle = self._idle, None
                try:
                    file = await file_in_thread(self._write_file, file, segments, size)
                    body["segments"] = [{"file": file.name, "offset": 0, "size": size}]
                except OSError as exc:
                    file = None  # _write_file closed the idle file it was given: never pooled again
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or size > INLINE_LIMIT:
                        raise
                    log.warning("payload dir full (%s): importing %d bytes inline instead", exc, size)
            if "segments" not in body:
                buf = bytearray(size)
                await asyncio.to_thread(write_blob, segments, buf)
                body["segments"] = [{"data": bytes(buf)}]
            proxy_s = time.perf_counter() - copied
            async with hold or contextlib.nullcontext():
                reply = await self.backend.import_(body, timeout_s=move_timeout_s(size))
            # Answered: the server is done reading the file, so it may be written again.
            file, done = None, file
            if done is not None:
                self._put_idle(done)
        except OSError as exc:
            cause = (
                FallbackCause.NO_SPACE
                if exc.errno in (errno.ENOSPC, errno.EDQUOT)
                else FallbackCause.TRANSPORT
            )
            raise KvMoveError(cause, f"could not write import payload: {exc}") from exc
        finally:
            if file is not None:
                file.close()  # not answered: the server may still read it, never reuse it
        self.rates.observe_move("import", reply.bytes, _seconds(reply.t_ms), proxy_s)
        self.metrics.kv_move_bytes.labels("import").inc(size)
        self.metrics.arena_move_bytes.labels("import", "file").inc(n * self._layout().bytes_per_token)
        self.metrics.kv_move_seconds.labels("import").inc(time.perf_counter() - started)

    async def _import_from_arena(
        self,
        arena: Arena,
        body: dict[str, Any],
        segments: Sequence[KvSegment],
        hold: contextlib.AbstractAsyncContextManager[Any] | None,
    ) -> bool:
        """The import with each segment that is a whole arena block named by its offset, the
        runs of the others staged into temporary blocks (one proxy copy of those only). False
        when the arena has no room for the staged runs (the caller uses a file)."""
        layout = self._layout()
        pieces = _pieces(arena, segments)
        runs = [p for p in pieces if isinstance(p, list)]
        sizes = [blob_size(layout, run[-1].p1 - run[0].p0) for run in runs]
        staged = arena.take(sizes, arena.make_room) if runs else []
        if staged is None:
            self.metrics.arena_full.labels("import").inc()
            return False
        fill = iter(staged)
        named = [p if isinstance(p, ArenaBlock) else next(fill) for p in pieces]
        size = sum(b.blob_size for b in named)
        sent = answered = False
        try:
            copied = time.perf_counter()
            if runs:
                await asyncio.to_thread(stage_runs, runs, staged)
            proxy_s = time.perf_counter() - copied
            body["segments"] = [{"file": arena.name, "offset": b.offset, "size": b.blob_size} for b in named]
            async with hold or contextlib.nullcontext():
                sent = True  # from here the server may get it: without an answer, it may still read it
                reply = await self.backend.import_(body, timeout_s=move_timeout_s(size))
            answered = True
        except BaseException as exc:
            if sent and not answered:  # the blocks it names: the server reads nothing else
                arena.quarantine_unanswered(exc, named, self)
            raise
        finally:
            named.clear()  # the staged blocks are free now, not when a traceback goes
            staged.clear()
            pieces.clear()
        self.rates.observe_move("import", reply.bytes, _seconds(reply.t_ms), proxy_s)
        self.metrics.kv_move_bytes.labels("import").inc(size)
        n_staged = sum(run[-1].p1 - run[0].p0 for run in runs)
        n_all = sum(s.n for s in segments)
        bpt = layout.bytes_per_token
        self.metrics.arena_move_bytes.labels("import", "in_place").inc((n_all - n_staged) * bpt)
        self.metrics.arena_move_bytes.labels("import", "staged").inc(n_staged * bpt)
        return True

    def _new_file(self, size: int) -> PayloadFile:
        assert self.shm_dir is not None
        return PayloadFile.create(self._dir_fd, self._new_name(), size)  # removes itself if it fails

    def _out_file(self, file: PayloadFile | None, size: int) -> PayloadFile:
        """The export file: ``file`` (the idle one, grown if it is too small), else a new one."""
        if file is not None:
            file.grow(size)  # closes the file if it fails
            return file
        return self._new_file(size)

    def _read_mapped(self, file: PayloadFile, size: int) -> KvSegment:
        with memoryview(file.mm) as view, view[:size] as blob:
            return parse_blob(blob, self._layout())

    def _put_idle_out(self, file: PayloadFile) -> None:
        if self._idle_out is None:
            self._idle_out = file
        else:
            file.close()

    def _read_file(self, name: str) -> KvSegment:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self._dir_fd)
        with open(fd, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            # MAP_POPULATE: the pages are mapped in one call, not one fault at a time.
            with mmap.mmap(
                handle.fileno(), size, flags=mmap.MAP_SHARED | POPULATE, prot=mmap.PROT_READ
            ) as mm:
                return parse_blob(memoryview(mm), self._layout())

    def _write_file(self, file: PayloadFile | None, segments: Sequence[KvSegment], size: int) -> PayloadFile:
        """The import payload written into ``file`` (the idle one, grown if it is too small), else a new one."""
        if file is None:
            file = self._new_file(size)
        else:
            file.grow(size)  # closes the file if it fails
        try:
            write_blob(segments, file.mm)
        except BaseException:
            file.close()
            raise
        return file

    def _put_idle(self, file: PayloadFile) -> None:
        if self._idle is None:
            self._idle = file
        else:
            file.close()

    def new_instance(self) -> None:
        """The server is a new process: arena blocks kept from moves the old one never
        answered can no longer be written or read by it, and are free again."""
        if self.arena is not None:
            self.arena.release_quarantine(self)

    def close(self) -> None:
        """Remove the idle payload files (the server's shutdown or the proxy's)."""
        for file in (self._idle, self._idle_out):
            if file is not None:
                file.close()
        self._idle = self._idle_out = None


def _pieces(arena: Arena, segments: Sequence[KvSegment]) -> list[ArenaBlock | list[KvSegment]]:
    """An import's segments as the arena blocks they wholly are, and runs of the others."""
    pieces: list[ArenaBlock | list[KvSegment]] = []
    for seg in segments:
        block = arena.whole_block(seg)
        if block is not None:
            pieces.append(block)
        elif pieces and isinstance(pieces[-1], list):
            pieces[-1].append(seg)
        else:
            pieces.append([seg])
    return pieces


def _seconds(t_ms: float | None) -> float | None:
    return None if t_ms is None else t_ms / 1000
