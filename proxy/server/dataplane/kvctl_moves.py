"""The /kvctl replies of KV moves, typed: export, import, release, erase, checkpoint and
restore (the routes and the other replies: ``kvctl.py``, which tells how they are parsed)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.errors import FallbackCause
from proxy.server.dataplane.kvctl import KvctlReplyError, KvRoute, _Reader


@dataclass(frozen=True)
class ExportReply:
    """POST /kvctl/export."""

    size: int  # the payload's bytes
    n_cells: int
    p0: int
    p1: int
    compat: Mapping[str, Any]
    in_place: bool  # written into the caller's file (a server before patch 0006 omits it)
    file: str | None  # with ``file``: the payload's name in the payload directory
    data: bytes | None  # without ``file``: the payload inline
    t_ms: float | None  # the time the export held the server's main loop
    # With ``chunk``: each chunk's [c0, c1, offset, size] in the file (patch 0020), else empty.
    chunks: tuple[tuple[int, int, int, int], ...] = ()

    @classmethod
    def parse(cls, obj: object, cause: FallbackCause = FallbackCause.EXPORT) -> ExportReply:
        r = _Reader(obj, KvRoute.EXPORT, cause)
        chunks = []
        for item in r.list_of("chunks", default_empty=True):
            if not (isinstance(item, list) and len(item) == 4 and all(type(v) is int for v in item)):
                raise KvctlReplyError(
                    cause, KvRoute.EXPORT, f"'chunks' holds {item!r}, not [c0, c1, offset, size]"
                )
            chunks.append((item[0], item[1], item[2], item[3]))
        reply = cls(
            size=r.integer("size"),
            n_cells=r.integer("n_cells"),
            p0=r.integer("p0"),
            p1=r.integer("p1"),
            compat=r.obj_of("compat"),
            in_place=r.flag("in_place", default=False),
            file=r.opt_str("file"),
            data=r.blob("data"),
            t_ms=r.number("t_ms"),
            chunks=tuple(chunks),
        )
        if reply.file is None and reply.data is None:
            raise KvctlReplyError(cause, KvRoute.EXPORT, "neither 'file' nor 'data'")
        return reply


@dataclass(frozen=True)
class ImportReply:
    """POST /kvctl/import."""

    slot: int
    n_tokens: int
    n_cells: int
    bytes: int
    t_ms: float | None

    @classmethod
    def parse(cls, obj: object, cause: FallbackCause = FallbackCause.IMPORT) -> ImportReply:
        r = _Reader(obj, KvRoute.IMPORT, cause)
        return cls(
            slot=r.integer("slot"),
            n_tokens=r.integer("n_tokens"),
            n_cells=r.integer("n_cells"),
            bytes=r.integer("bytes"),
            t_ms=r.number("t_ms"),
        )


@dataclass(frozen=True)
class ReleaseReply:
    """POST /kvctl/release."""

    owner: int
    n_released: int

    @classmethod
    def parse(cls, obj: object, cause: FallbackCause = FallbackCause.RELEASE) -> ReleaseReply:
        r = _Reader(obj, KvRoute.RELEASE, cause)
        return cls(owner=r.integer("owner"), n_released=r.integer("n_released"))


@dataclass(frozen=True)
class EraseReply:
    """POST /kvctl/erase."""

    slot: int
    n_erased: int

    @classmethod
    def parse(cls, obj: object, cause: FallbackCause = FallbackCause.ERASE) -> EraseReply:
        r = _Reader(obj, KvRoute.ERASE, cause)
        return cls(slot=r.integer("slot"), n_erased=r.integer("n_erased"))


@dataclass(frozen=True)
class CheckpointReply:
    """POST /kvctl/checkpoint: a whole-state checkpoint, inline (opaque: the server checks it)."""

    size: int
    n_tokens: int
    data: bytes
    t_ms: float | None

    @classmethod
    def parse(cls, obj: object, cause: FallbackCause = FallbackCause.EXPORT) -> CheckpointReply:
        r = _Reader(obj, KvRoute.CHECKPOINT, cause)
        data = r.blob("data")
        size = r.integer("size")
        if data is None or len(data) != size:
            raise KvctlReplyError(cause, KvRoute.CHECKPOINT, f"no payload of the {size} bytes it names")
        return cls(size=size, n_tokens=r.integer("n_tokens"), data=data, t_ms=r.number("t_ms"))


@dataclass(frozen=True)
class RestoreReply:
    """POST /kvctl/restore."""

    slot: int
    n_tokens: int
    bytes: int
    t_ms: float | None

    @classmethod
    def parse(cls, obj: object, cause: FallbackCause = FallbackCause.IMPORT) -> RestoreReply:
        r = _Reader(obj, KvRoute.RESTORE, cause)
        return cls(
            slot=r.integer("slot"),
            n_tokens=r.integer("n_tokens"),
            bytes=r.integer("bytes"),
            t_ms=r.number("t_ms"),
        )
