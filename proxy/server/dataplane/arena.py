"""The arena: one shared-memory file that is the host tree's KV memory (docs/design.md).

Made once at startup in the payload directory (``--shm-dir``), sized by ``--cache-ram``, its
pages allocated (``posix_fallocate``: on tmpfs, every page now exists) and mapped in one call
(``MAP_POPULATE``), so no move pays page creation or faults. Same-host servers map it whole
once (the server keeps its mappings, patch 0008): an export writes each chunk's payload blob
into a block reserved here, and the proxy's segments are views of those blocks (no copy); an
import names whole blocks by offset, and the server reads them in place. So a move is one copy,
the server's.

A block is a ctypes array over its range of the mapping, one Python object per block: the
numpy views of a segment keep it alive, so a block is free exactly when no tree edge, import
in flight or disk write still views it (its finalizer queues its range, freed on the event
loop at the next reservation). A block that a server might still write or read after a failed,
timed-out or cancelled move is quarantined: never reused while that server process lives
(freed when the server comes back as a new instance), counted.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import itertools
import logging
import mmap
import os
import secrets
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from proxy.core.arena import RangeAllocator, aligned
from proxy.core.payload import KvLayout, blob_size, parse_blob, write_blob, write_rows_blob
from proxy.core.segment import KvSegment
from proxy.errors import ConfigError, FallbackCause, KvMoveError
from proxy.server.dataplane.paydir import PAYLOAD_SUFFIX, private_dir_fd

log = logging.getLogger("radix")

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_REMOVE = getattr(mmap, "MADV_REMOVE", getattr(mmap, "MADV_DONTNEED", 4))
ARENA_PREFIX = "radix-arena-"
MAX_EVICTIONS = 256  # per reservation
# A server may keep at most this share of the arena quarantined; past it, its moves go
# through payload files until it is a new process (a hung server cannot eat the arena).
QUARANTINE_SHARE = 8
_SHM_FS = ("tmpfs", "hugetlbfs")


class ArenaBlock(ctypes.Array):  # type: ignore[type-arg]
    """One reserved range of the arena (subclassed per size: ``_block_type``)."""

    _type_ = ctypes.c_ubyte
    _length_ = 0
    arena_id: int
    offset: int
    blob_size: int  # the payload blob written here (the range may be longer: page alignment)
    kv_nbytes: int  # the KV of its segment once parsed (segment.keeps_extra reads it); -1 before


_TYPES: dict[int, type[ArenaBlock]] = {}
_MAX_TYPES = 1024  # one class per block size; dropped in bulk beyond (live blocks keep theirs)
_TOKENS = itertools.count(1)


def _block_type(size: int) -> type[ArenaBlock]:
    cls = _TYPES.get(size)
    if cls is None:
        if len(_TYPES) >= _MAX_TYPES:
            _TYPES.clear()
        cls = type(f"ArenaBlock{size}", (ArenaBlock,), {"_type_": ctypes.c_ubyte, "_length_": size})
        _TYPES[size] = cls
    return cls


class Arena:
    def __init__(self, dir_fd: int, name: str, mm: mmap.mmap, note: str) -> None:
        self.dir_fd, self.name, self.mm = dir_fd, name, mm
        self.alloc = RangeAllocator(len(mm))
        self.token = next(_TOKENS)  # which arena a block is of (never reused, unlike id())
        self.note = note  # which page size and why, for the startup line
        # Evicts the tree's least recently used leaf: its bytes, 0 once there is none (the runtime's).
        self.make_room: Callable[[], int] | None = None
        self._freed: collections.deque[int] = collections.deque()  # appended by finalizers, any thread
        self._quarantine: list[tuple[object, dict[int, ArenaBlock]]] = []  # whose server, blocks by offset
        self.quarantined_bytes = 0
        self._lock_fd = -1  # held open (and flock-ed) while the arena lives

    @property
    def capacity(self) -> int:
        return self.alloc.capacity

    @classmethod
    def create(cls, shm_dir: Path, capacity: int) -> Arena:
        """The arena file, allocated and mapped; ConfigError naming the size and the fix. The
        file stays locked (``flock``) while this process lives: arenas left by a proxy that
        died are removed first (their lock is gone with their process), others are left alone."""
        dir_fd = private_dir_fd(shm_dir)
        remove_stale_arenas(dir_fd)
        name = f"{ARENA_PREFIX}{os.getpid()}-{secrets.token_hex(4)}{PAYLOAD_SUFFIX}"
        # Made and locked under a name no sweep looks at, then renamed: a sweep never sees a live
        # proxy's arena unlocked.
        making = f"making-{name}.part"
        started = time.perf_counter()
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.posix_fallocate(fd, 0, capacity)
            mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | _POPULATE)
            os.rename(making, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(making, dir_fd=dir_fd)
            raise ConfigError(
                f"cannot make the {capacity >> 20} MiB KV arena in {shm_dir}: {exc.strerror}",
                fix="give the payload directory's file system room for --cache-ram "
                "(docker: the kv-payloads tmpfs size), lower --cache-ram, or pass --kv-arena off",
            ) from exc
        note = f"{page_note(shm_dir)}; allocated and mapped in {time.perf_counter() - started:.2f} s"
        arena = cls(dir_fd, name, mm, note)
        arena._lock_fd = fd
        return arena

    def take(
        self, sizes: Sequence[int], make_room: Callable[[], int] | None = None
    ) -> list[ArenaBlock] | None:
        """One block per size, all or none. When they do not fit, ``make_room`` (the tree's
        least recently used leaf evicted: the bytes it held, 0 once there is none) is called
        until they do, at most MAX_EVICTIONS times and only until it evicted as many bytes as
        asked for: an evicted edge that frees nothing now (a disk write still holds it, or it
        lived in ordinary memory) must not make a reservation empty the tree."""
        need = sum(aligned(size) for size in sizes)
        evicted = 0
        for _ in range(MAX_EVICTIONS + 1):
            self._drain()
            offsets: list[int] = []
            for size in sizes:
                offset = self.alloc.alloc(size)
                if offset is None:
                    break
                offsets.append(offset)
            if len(offsets) == len(sizes):
                return [self._block(offset, size) for offset, size in zip(offsets, sizes, strict=True)]
            for offset in offsets:
                self.alloc.free(offset)
            if make_room is None or evicted >= need:
                return None
            got = make_room()
            if got <= 0:
                return None
            evicted += got
        return None

    def _block(self, offset: int, size: int) -> ArenaBlock:
        block = _block_type(aligned(size)).from_buffer(self.mm, offset)
        block.arena_id, block.offset, block.blob_size, block.kv_nbytes = self.token, offset, size, -1
        weakref.finalize(block, self._freed.append, offset)
        return block

    def _drain(self) -> None:
        while self._freed:
            self.alloc.free(self._freed.popleft())

    def copy(self, segment: KvSegment) -> KvSegment:
        """``segment`` in a block of its own (the tree's copier): a whole block, imported in
        place later. Without room (never evicting: the tree calls this while it evicts), a copy
        in ordinary memory."""
        size = blob_size(segment.layout, segment.n)
        blocks = self.take([size])
        if blocks is None:
            return segment.copy()
        (block,) = blocks
        raw = np.frombuffer(cast(Any, block), np.uint8, count=size)
        write_blob([segment], raw)
        out = parse_blob(raw, segment.layout, view=True)
        block.kv_nbytes = out.nbytes
        return out

    def whole_block(self, segment: KvSegment) -> ArenaBlock | None:
        """The block ``segment`` is the whole KV of (an import may name it by offset), else None."""
        owner = segment.owner
        if (
            isinstance(owner, ArenaBlock)
            and owner.arena_id == self.token
            and owner.kv_nbytes == segment.nbytes
        ):
            return owner
        return None

    def quarantine(self, refs: Iterable[ArenaBlock], whose: object = None) -> None:
        """Keep the blocks ``refs`` alive for good: ``whose`` server may still write or read
        them after a move that got no answer. A block kept twice (a hot prefix imported again
        and again) is kept and counted once."""
        kept = next((d for w, d in self._quarantine if w is whose), None)
        if kept is None:
            kept = {}
            self._quarantine.append((whose, kept))
        for block in refs:  # a copy: the caller clears its own lists
            kept[block.offset] = block
        self._count_quarantine()

    def _count_quarantine(self) -> None:
        distinct = {off: len(b) for _, kept in self._quarantine for off, b in kept.items()}
        self.quarantined_bytes = sum(distinct.values())

    def quarantined_by(self, whose: object) -> int:
        return sum(len(b) for w, kept in self._quarantine if w is whose for b in kept.values())

    def may_move(self, whose: object) -> bool:
        """Whether ``whose`` server may move through the arena: not once it keeps 1/QUARANTINE_SHARE
        of it quarantined (moves it never answered; those in flight then may still add theirs)."""
        return self.quarantined_by(whose) < self.capacity // QUARANTINE_SHARE

    def release_quarantine(self, whose: object) -> None:
        """Free what was kept for ``whose`` server (its process is gone: nothing can write or
        read those blocks any more)."""
        self._quarantine = [q for q in self._quarantine if q[0] is not whose]
        self._count_quarantine()

    def quarantine_unanswered(
        self, exc: BaseException, refs: Iterable[ArenaBlock], whose: object = None
    ) -> None:
        """After a move failed with ``exc``: one the server did not answer (timed out,
        connection lost, cancelled) may still be run by it, so its blocks are kept for good
        instead of being given to another move; an answered failure frees them."""
        answered = isinstance(exc, KvMoveError) and exc.cause not in (
            FallbackCause.TRANSPORT,
            FallbackCause.TIMEOUT,
        )
        if not answered:
            self.quarantine(refs, whose)

    def stats(self) -> dict[str, int]:
        self._drain()
        return {"capacity": self.capacity, "used": self.alloc.used, "quarantined": self.quarantined_bytes}

    def close(self, give_back: bool = True) -> None:
        """Remove the file and, with ``give_back``, its memory now. Segments still viewing
        blocks (a tree not yet collected) keep the mapping, so its pages are released by
        punching the whole file out (``MADV_REMOVE``: they read as zeros after, never fault).
        Never while a move may still run: a quarantined one (a server could import zeros into a
        slot and claim its tokens), or a disk write the caller did not see finish (pass False:
        it would write zeros as a valid entry)."""
        with contextlib.suppress(OSError):
            os.unlink(self.name, dir_fd=self.dir_fd)
        give_back = give_back and not any(kept for _, kept in self._quarantine)
        with contextlib.suppress(BufferError):  # blocks still alive: the mapping goes with them
            self.mm.close()
        if give_back and not self.mm.closed:
            with contextlib.suppress(OSError, ValueError):
                self.mm.madvise(_REMOVE)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def sweep_stale_arenas(base: Path, prefix: str) -> None:
    """Remove the arenas left by our proxies that died in the directories ``base/prefix*`` of
    earlier runs (``radixctl up`` makes a new one per run, so a killed run's arena, --cache-ram
    bytes of shared memory, would otherwise stay), and such a directory once it is empty. Only
    real directories owned by us; a live proxy's arena (locked) and other files are left."""
    try:
        entries = list(os.scandir(base))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            removed = remove_stale_arenas(fd)
        finally:
            os.close(fd)
        if removed:  # a dead run's directory; a live one never had an unlocked arena in it
            with contextlib.suppress(OSError):  # not empty: files we leave alone
                os.rmdir(entry.path)


def remove_stale_arenas(dir_fd: int) -> int:
    """Remove the arena files in the directory that no live process holds locked; how many."""
    removed = 0
    for entry in os.scandir(dir_fd):
        making = entry.name.startswith(f"making-{ARENA_PREFIX}")
        if not (entry.name.startswith(ARENA_PREFIX) or making) or not entry.is_file(follow_symlinks=False):
            continue
        # One being made is locked right after it is created: unlocked and older, its maker died.
        if making and time.time() - entry.stat(follow_symlinks=False).st_mtime < 10:
            continue
        try:
            fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held by a live proxy
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(entry.name, dir_fd=dir_fd)
            removed += 1
        log.warning("removed the KV arena %s left by a proxy that is gone", entry.name)
    return removed


def block_segments(blocks: Sequence[ArenaBlock], layout: KvLayout) -> list[KvSegment]:
    """The segments the server wrote into ``blocks``, each a view of its block (checked as any
    payload; a blob whose cells are not in position order is copied out instead)."""
    run = []
    for block in blocks:
        seg = parse_blob(np.frombuffer(cast(Any, block), np.uint8, count=block.blob_size), layout, view=True)
        if seg.owner is block:
            block.kv_nbytes = seg.nbytes  # from now on the tree counts only its KV (keeps_extra)
        run.append(seg)
    return run


def rows_into_blocks(
    blocks: Sequence[ArenaBlock],
    bounds: Sequence[tuple[int, int]],
    layout: KvLayout,
    rows: np.ndarray,
    p0: int,
) -> list[KvSegment]:
    """Per-token rows of positions from ``p0`` written as one blob per block, the block of
    ``bounds[i]`` holding those positions (one copy, on the caller's thread: the disk tier's
    reads); the segments are views of the blocks, imported in place later."""
    for block, (a, b) in zip(blocks, bounds, strict=True):
        write_rows_blob(a, layout, rows[a - p0 : b - p0], np.frombuffer(cast(Any, block), np.uint8))
    return block_segments(blocks, layout)


def stage_runs(runs: Sequence[Sequence[KvSegment]], blocks: Sequence[ArenaBlock]) -> None:
    for run, block in zip(runs, blocks, strict=True):
        write_blob(run, np.frombuffer(cast(Any, block), np.uint8, count=block.blob_size))


def page_note(path: Path) -> str:
    """Which page size the arena gets and why (tmpfs huge pages follow the mount's ``huge=``
    and the kernel's shmem setting)."""
    fs, opts = _mount_of(path)
    if fs == "hugetlbfs":
        return "huge pages (hugetlbfs)"
    if fs not in _SHM_FS:
        return f"4 KiB pages ({fs or 'unknown'} file system, not shared memory)"
    huge = next((o.split("=", 1)[1] for o in opts if o.startswith("huge=")), None)
    shmem = _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    setting = shmem[shmem.find("[") + 1 : shmem.find("]")] if "[" in shmem else shmem or "unknown"
    if huge in ("always", "within_size") or setting in ("force", "always", "within_size"):
        return f"transparent huge pages where aligned (tmpfs huge={huge or 'never'}, shmem_enabled {setting})"
    return f"4 KiB pages (tmpfs huge={huge or 'never'}, shmem_enabled {setting}: no huge pages for shared memory)"


def is_shared_memory(path: Path) -> bool:
    return _mount_of(path)[0] in _SHM_FS


def _mount_of(path: Path) -> tuple[str, list[str]]:
    """(file system type, mount options) of the mount holding ``path``."""
    real = os.path.realpath(path)
    best, found = -1, ("", list[str]())
    for line in _read("/proc/self/mounts").splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > best:
            best, found = len(mount), (fields[2], fields[3].split(","))
    return found


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""
