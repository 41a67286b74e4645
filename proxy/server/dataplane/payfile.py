"""Payload files in the shared-memory directory (moves without the arena): made with their
pages allocated, mapped in one call, grown in place, removed relative to the directory's fd."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
from collections.abc import Callable
from typing import Any

POPULATE = getattr(mmap, "MAP_POPULATE", 0)


async def file_in_thread(fn: Callable[..., PayloadFile], *args: Any) -> PayloadFile:
    """``fn(*args)`` in a worker thread. If this task is cancelled meanwhile (a client gone, a
    server taken out of routing), the thread still finishes, and the file it made is removed
    then instead of being left in the directory."""
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(_close_made_file)
        raise


def _close_made_file(future: asyncio.Future[PayloadFile]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


class PayloadFile:
    """An import payload file in the shared-memory directory, pages allocated, kept mapped."""

    def __init__(self, dir_fd: int, name: str, mm: mmap.mmap) -> None:
        self.dir_fd, self.name = dir_fd, name  # the file is ``name`` in the directory ``dir_fd``
        self.mm = mm

    @property
    def capacity(self) -> int:
        return len(self.mm)

    @classmethod
    def create(cls, dir_fd: int, name: str, size: int) -> PayloadFile:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
        try:
            mm = map_allocated(fd, size)
        except BaseException:
            _unlink(dir_fd, name)
            raise
        finally:
            os.close(fd)
        return cls(dir_fd, name, mm)

    def grow(self, size: int) -> None:
        """At least ``size`` bytes, the same file grown in place: the server keeps its mapping
        of the file between moves (patch 0008), so a new file would hold the old one's pages on
        the payload volume until the server's next /kvctl request. Closed if it fails."""
        if self.capacity >= size:
            return
        try:
            fd = os.open(self.name, os.O_RDWR | os.O_NOFOLLOW, dir_fd=self.dir_fd)
            try:
                mm = map_allocated(fd, size)
            finally:
                os.close(fd)
        except BaseException:
            self.close()
            raise
        old, self.mm = self.mm, mm
        with contextlib.suppress(BufferError):
            old.close()

    def close(self) -> None:
        _unlink(self.dir_fd, self.name)
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
            self.mm.close()


def map_allocated(fd: int, size: int) -> mmap.mmap:
    """The first ``size`` bytes of the file, pages reserved first (a sparse file on a full
    tmpfs would SIGBUS the writes through the mapping) and mapped in one call."""
    os.posix_fallocate(fd, 0, size)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | POPULATE)


def _unlink(dir_fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)
