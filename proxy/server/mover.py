"""KV moves between one server and the host: export a range, import segments.

Same host: payloads go through files in the shared-memory directory that both the proxy
and the server were given (``mmap`` on both sides, one copy each way). Other hosts: inline
msgpack bytes. Parsing and building payloads run in a worker thread so the event loop
keeps serving while megabytes are copied.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import mmap
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from proxy.core.payload import KvLayout, KvSegment, blob_size, parse_blob, write_blob
from proxy.errors import FallbackCause, KvMoveError, PayloadError
from proxy.server.backend import Backend, move_timeout_s
from proxy.server.metrics import Metrics

_names = itertools.count()
log = logging.getLogger("radix")
INLINE_LIMIT = 64 << 20  # the server's limit on an inline (in-body) payload


class KvMover:
    def __init__(
        self,
        backend: Backend,
        layout: KvLayout,
        compat: dict[str, Any],
        shm_dir: Path | None,
        metrics: Metrics,
    ) -> None:
        self.backend = backend
        self.layout = layout
        self.compat = compat
        self.shm_dir = shm_dir
        self.metrics = metrics

    def _new_name(self) -> str:
        return f"radix-{os.getpid()}-{next(_names)}.kv"

    async def export(self, seq: dict[str, int], p0: int, tokens: Sequence[int] | np.ndarray) -> KvSegment:
        """The KV of positions ``[p0, len(tokens))`` of a slot's or owner's sequence, verified.

        Bound to ``tokens`` (invariant 6): the server checks that the sequence holds exactly
        these tokens at ``[0, len(tokens))`` when it exports, else KvMoveError(CONFLICT)."""
        started = time.perf_counter()
        p1 = len(tokens)
        name = self._new_name() if self.shm_dir else None
        try:
            timeout_s = move_timeout_s(blob_size(self.layout, p1 - p0))
            reply = await self.backend.export(seq, p0, tokens, name, timeout_s)
            if reply.get("compat") not in (None, self.compat):
                raise KvMoveError(FallbackCause.COMPAT, "exported payload has another compatibility key")
            if name is not None:
                segment = await asyncio.to_thread(self._read_file, self._path(name))
            else:
                segment = await asyncio.to_thread(parse_blob, reply["data"], self.layout)
        except PayloadError as exc:
            raise KvMoveError(FallbackCause.PAYLOAD, str(exc)) from exc
        except (OSError, KeyError) as exc:
            raise KvMoveError(FallbackCause.TRANSPORT, f"export payload unreadable: {exc}") from exc
        finally:
            if name is not None:
                _unlink(self._path(name))
        if (segment.p0, segment.p1) != (p0, p1):
            raise KvMoveError(FallbackCause.VERIFY, f"asked for [{p0},{p1}), got [{segment.p0},{segment.p1})")
        self.metrics.kv_move_bytes.labels("export").inc(segment.nbytes)
        self.metrics.kv_move_seconds.labels("export").inc(time.perf_counter() - started)
        return segment

    async def import_(self, slot: int, p0: int, tokens: Sequence[int], segments: Sequence[KvSegment]) -> None:
        """Write ``segments`` (covering ``[p0, len(tokens))``) into an idle slot; the server verifies."""
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
        name = self._new_name() if self.shm_dir else None
        size = blob_size(self.layout, n)
        try:
            if name is not None:
                try:
                    await asyncio.to_thread(self._write_file, self._path(name), segments)
                    body["segments"] = [{"file": name, "offset": 0, "size": size}]
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or size > INLINE_LIMIT:
                        raise
                    log.warning("payload dir full (%s): importing %d bytes inline instead", exc, size)
            if "segments" not in body:
                buf = bytearray(size)
                await asyncio.to_thread(write_blob, segments, buf)
                body["segments"] = [{"data": bytes(buf)}]
            await self.backend.kv_post(
                "import", body, cause=FallbackCause.IMPORT, timeout_s=move_timeout_s(size)
            )
        except OSError as exc:
            cause = (
                FallbackCause.NO_SPACE
                if exc.errno in (errno.ENOSPC, errno.EDQUOT)
                else FallbackCause.TRANSPORT
            )
            raise KvMoveError(cause, f"could not write import payload: {exc}") from exc
        finally:
            if name is not None:
                _unlink(self._path(name))
        self.metrics.kv_move_bytes.labels("import").inc(size)
        self.metrics.kv_move_seconds.labels("import").inc(time.perf_counter() - started)

    def _path(self, name: str) -> Path:
        assert self.shm_dir is not None
        return self.shm_dir / name

    def _read_file(self, path: Path) -> KvSegment:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return parse_blob(memoryview(mm), self.layout)

    def _write_file(self, path: Path, segments: Sequence[KvSegment]) -> int:
        size = blob_size(self.layout, sum(s.n for s in segments))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: a sparse file on a full tmpfs would SIGBUS the mmap writes.
            os.posix_fallocate(fd, 0, size)
            with mmap.mmap(fd, size) as mm:
                write_blob(segments, mm)
        finally:
            os.close(fd)
        return size


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
