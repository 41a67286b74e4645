"""The disk tier's file work, run on its threads: the MAC key, the directory scan at startup,
atomic entry writes, checked reads, deletes (proxy/server/tiers/disk.py schedules them)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

import numpy as np

from proxy.core.diskindex import (
    HEADER_BYTES,
    SUFFIX,
    DiskEntryError,
    DiskMatch,
    DropCause,
    EntryHeader,
    decode_header,
    encode_header,
    make_header,
    sha,
    verify_entry,
)
from proxy.core.payload import KvLayout, KvSegment
from proxy.core.radix import Spill
from proxy.server.dataplane.arena import ArenaBlock, rows_into_blocks

log = logging.getLogger("radix")

TMP_SUFFIX = ".tmp"


def default_key_file(directory: Path) -> Path:
    """``<directory>.key``: next to the directory, not in it."""
    return directory.with_name(directory.name + ".key")


class UnsafeKeyFile(OSError):
    """The MAC key file is a link, not ours, readable by others, or too short."""


SECRET_BYTES = 32


def load_secret(path: Path) -> bytes:
    """The tier's MAC key: read from ``path``, or made there (32 random bytes, 0600) when it
    does not exist. Refused unless it is a regular file of ours that only we can read."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
        log.info("disk tier: made its MAC key %s", path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeKeyFile(f"the disk tier's key file {path} is a symbolic link") from exc
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise UnsafeKeyFile(
                f"the disk tier's key file {path} must be a regular file of ours, mode 600 (chmod 600 it)"
            )
        secret = f.read(4096)
    if len(secret) < 16:
        raise UnsafeKeyFile(f"the disk tier's key file {path} holds {len(secret)} bytes; it needs 16 or more")
    return secret


def scan_entries(
    directory: Path, key: bytes, secret: bytes, row_bytes: int
) -> tuple[list[tuple[EntryHeader, np.ndarray]], dict[str, int]]:
    """Entries in the directory, oldest first (by mtime), with their checked headers and
    token ids. Temporary files and broken entries are deleted; foreign ones are left alone."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_directory(directory)
    mode = stat.S_IMODE(directory.stat().st_mode)
    if mode & 0o077:
        log.warning("disk tier: %s is readable by others (mode %o); chmod 700 it", directory, mode)
    drops: dict[str, int] = {}
    found: list[tuple[float, EntryHeader, np.ndarray]] = []
    for path in directory.iterdir():
        if path.name.endswith(TMP_SUFFIX):
            drop_entry(path, DropCause.PARTIAL, drops)
            continue
        if not path.name.endswith(SUFFIX):
            continue
        try:
            with open_entry(path) as f:
                st = os.fstat(f.fileno())
                head = f.read(HEADER_BYTES)
                header = decode_header(head, secret)
                if header.key != key:
                    drops[DropCause.FOREIGN_KEY] = drops.get(DropCause.FOREIGN_KEY, 0) + 1
                    continue  # another model's: not ours to delete
                if header.row_bytes != row_bytes or path.name != header.name:
                    raise DiskEntryError(DropCause.HEADER, "row size or file name differs from the header")
                if st.st_size != header.size:
                    raise DiskEntryError(
                        DropCause.TRUNCATED, f"{st.st_size} bytes, header says {header.size}"
                    )
                raw = f.read(4 * header.n)
            tokens = np.frombuffer(raw, dtype="<i4").astype(np.int32)
            if sha(raw) != header.tokens:
                raise DiskEntryError(DropCause.TOKENS, "token ids do not match their checksum")
        except DiskEntryError as exc:
            if exc.cause == DropCause.UNTRUSTED:  # not ours: counted, neither used nor deleted
                drops[exc.cause] = drops.get(exc.cause, 0) + 1
                continue
            drop_entry(path, exc.cause, drops)
            continue
        except OSError:
            drops[DropCause.IO] = drops.get(DropCause.IO, 0) + 1
            continue
        found.append((st.st_mtime, header, tokens))
    found.sort(key=lambda x: x[0])
    return [(h, t) for _, h, t in found], drops


class UnsafeDirectory(OSError):
    """The tier's directory is a link, not ours, or writable by others: another user could
    delete, replace or fill entries (the MAC refuses forgeries, not those), so the tier is not
    used."""


def check_directory(directory: Path) -> None:
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{directory} is a link or not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(f"{directory} is owned by uid {st.st_uid}, not by us")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(f"{directory} is writable by group or others (chmod go-w)")


def open_entry(path: Path) -> BinaryIO:
    """An entry opened without following a link, and only if it is a regular file of ours that
    nobody else may write (DiskEntryError UNTRUSTED otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DiskEntryError(DropCause.UNTRUSTED, f"{path.name} is a symbolic link") from exc
        raise
    st = os.fstat(fd)
    if (
        not stat.S_ISREG(st.st_mode)
        or st.st_uid != os.geteuid()
        or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    ):
        os.close(fd)
        raise DiskEntryError(
            DropCause.UNTRUSTED, f"{path.name} is not a regular file of ours, writable by us only"
        )
    return os.fdopen(fd, "rb")


def drop_entry(path: Path, cause: DropCause, drops: dict[str, int]) -> None:
    drops[cause] = drops.get(cause, 0) + 1
    with contextlib.suppress(OSError):  # a read-only directory: it stays, skipped again next time
        path.unlink()


def write_entry(directory: Path, key: bytes, secret: bytes, spill: Spill) -> EntryHeader:
    """Write one entry atomically: temporary file, fsync, rename, fsync of the directory."""
    data = spill.segment.rows()  # the entry format keeps per-token rows (docs/disk-tier.md)
    header, tokens = make_header(key, spill.ns, spill.path, spill.start, data)
    final = directory / header.name
    tmp = directory / f".{header.name}.{secrets.token_hex(4)}{TMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb", closefd=True) as f:
            f.write(encode_header(header, secret))
            f.write(tokens.tobytes())
            f.write(data.data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return header


def read_segment(
    directory: Path,
    key: bytes,
    secret: bytes,
    found: DiskMatch,
    tokens: np.ndarray,
    layout: KvLayout,
    p0: int,
    into: tuple[list[ArenaBlock], list[tuple[int, int]]] | None = None,
) -> list[KvSegment]:
    """The entries' KV from ``p0`` on, in the I/O thread: written into arena blocks, one per
    chunk (``into``: the blocks and the positions each holds), else copied into one segment."""
    try:
        rows = read_pieces(directory, key, secret, found, tokens)
        if into is not None:
            return rows_into_blocks(into[0], into[1], layout, rows, p0)
        return [KvSegment.from_rows(p0, layout, rows)]
    except BaseException:
        if into is not None:
            into[0].clear()  # the blocks are free now, not when the traceback goes
        raise


def read_pieces(
    directory: Path, key: bytes, secret: bytes, found: DiskMatch, tokens: np.ndarray
) -> np.ndarray:
    """The rows of positions [found.start, found.reach), every entry checked whole first:
    its header as indexed, its size, its key, its token ids (against the index and the
    request), its bytes."""
    parts = []
    for piece in found.pieces:
        entry = piece.entry
        try:
            with open_entry(directory / entry.name) as f:
                raw = f.read(entry.header.size + 1)
            _, toks, rows = verify_entry(raw, key, secret, entry.header)
            if not np.array_equal(toks, entry.tokens):
                raise DiskEntryError(DropCause.TOKENS, "token ids differ from the index")
            if not np.array_equal(
                toks[piece.a - entry.start : piece.b - entry.start], tokens[piece.a : piece.b]
            ):
                raise DiskEntryError(DropCause.TOKENS, "token ids differ from the request's")
        except DiskEntryError as exc:
            raise DiskEntryError(exc.cause, f"{entry.name}: {exc}", entry.name) from None
        except FileNotFoundError as exc:
            raise DiskEntryError(DropCause.TRUNCATED, f"{entry.name} is gone", entry.name) from exc
        parts.append(rows[piece.a - entry.start : piece.b - entry.start])
    return np.concatenate(parts) if len(parts) > 1 else parts[0]  # the caller copies (from_rows)


def unlink_all(directory: Path, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
