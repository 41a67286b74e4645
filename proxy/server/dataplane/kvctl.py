"""The /kvctl API's routes and replies, typed: each reply is parsed once, where the client
receives it, into a frozen dataclass (field names as docs/kvctl.md and the patch spell them).

A field the patch renamed, dropped or retyped fails here, in its reply's parser, with one
``KvctlReplyError`` naming the route and the field, not as a ``KeyError`` somewhere later.
Fields that only some patch levels send (``in_place``, ``infill``, ``embedding``, ``dir``)
are optional; everything the proxy relies on is required.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from proxy.errors import FallbackCause, KvMoveError


class KvRoute(StrEnum):
    """The /kvctl routes (GET: caps, slots, cells; POST: the rest)."""

    CAPS = "caps"
    SLOTS = "slots"
    CELLS = "cells"
    EXPORT = "export"
    IMPORT = "import"
    PUBLISH = "publish"
    ATTACH = "attach"
    RELEASE = "release"
    ERASE = "erase"
    CHECKPOINT = "checkpoint"  # patch 0017: whole-state checkpoints of recurrent and hybrid memory
    RESTORE = "restore"
    TOKENIZE = "tokenize"  # patch 0027: a chat request's tokens as the moves key them, media included


class KvctlReplyError(KvMoveError):
    """A /kvctl reply without a field the proxy needs, or with a field of another type: the
    patch and the proxy disagree on the reply's shape."""

    def __init__(self, cause: FallbackCause, route: KvRoute, problem: str) -> None:
        super().__init__(cause, f"/kvctl/{route} reply: {problem}")
        self.route = route


class _Reader:
    """Typed field access on one reply object; every failure is one KvctlReplyError."""

    def __init__(self, obj: object, route: KvRoute, cause: FallbackCause, where: str = "") -> None:
        if not isinstance(obj, Mapping):
            raise KvctlReplyError(
                cause, route, f"{where or 'the reply'} is {type(obj).__name__}, not an object"
            )
        self.obj, self.route, self.cause, self.where = obj, route, cause, where

    def _fail(self, key: str, problem: str) -> KvctlReplyError:
        return KvctlReplyError(self.cause, self.route, f"field {self.where}{key!r} {problem}")

    def _get(self, key: str, types: type | tuple[type, ...], what: str, optional: bool) -> Any:
        if key not in self.obj or (optional and self.obj[key] is None):
            if optional:
                return None
            raise self._fail(key, "is missing")
        value = self.obj[key]
        # bool is an int in Python: never accepted where an int is expected, and the reverse.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            raise self._fail(key, f"is {type(value).__name__}, expected {what}")
        return value

    def integer(self, key: str) -> int:
        return int(self._get(key, int, "an integer", False))

    def number(self, key: str) -> float | None:
        value = self._get(key, (int, float), "a number", True)
        return None if value is None else float(value)

    def flag(self, key: str, default: bool | None = None) -> bool:
        """A boolean; ``default``: the value when the field is absent (else it is required)."""
        value = self._get(key, bool, "a boolean", default is not None)
        if value is None:
            return bool(default)
        return bool(value)

    def string(self, key: str) -> str:
        return str(self._get(key, str, "a string", False))

    def opt_str(self, key: str) -> str | None:
        value = self._get(key, str, "a string", True)
        return None if value is None else str(value)

    def obj_of(self, key: str) -> Mapping[str, Any]:
        return dict(self._get(key, Mapping, "an object", False))

    def opt_obj(self, key: str) -> Mapping[str, Any] | None:
        value = self._get(key, Mapping, "an object", True)
        return None if value is None else dict(value)

    def strs(self, key: str) -> tuple[str, ...]:
        values = self._get(key, list, "a list", False)
        if not all(isinstance(v, str) for v in values):
            raise self._fail(key, "holds a non-string, expected strings")
        return tuple(values)

    def ints(self, key: str, optional: bool = False) -> tuple[int, ...] | None:
        values = self._get(key, list, "a list", optional)
        if values is None:
            return None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise self._fail(key, "holds a non-integer, expected integers")
        return tuple(int(v) for v in values)

    def list_of(self, key: str, default_empty: bool = False) -> list[Any]:
        value = self._get(key, list, "a list", default_empty)
        return [] if value is None else list(value)

    def blob(self, key: str) -> bytes | None:
        value = self._get(key, (bytes, bytearray, memoryview, str), "bytes", True)
        if value is None:
            return None
        if isinstance(value, str):  # base64 in a JSON reply
            try:
                return base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise self._fail(key, f"is not base64 ({exc})") from exc
        return bytes(value)


def _counts(obj: Mapping[str, Any], cause: FallbackCause) -> dict[str, int]:
    r = _Reader(obj, KvRoute.CELLS, cause, "seq.")
    return {key: r.integer(key) for key in obj}


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


@dataclass(frozen=True)
class Embedding:
    on: bool
    pooling: int


@dataclass(frozen=True)
class KvBuffer:
    """One buffer the server's memory (KV cache, recurrent state) lives in, as ggml names it
    (caps ``memory.buffers``, patch 0019): read from the buffers, not inferred from ``-ngl``."""

    name: str  # the buffer type: "CPU", "CUDA0", "Vulkan0", "CUDA_Host", ...
    device: str  # its device: "CPU", "CUDA0", "Vulkan0" ("": the server cannot say)
    description: str  # the device's own words ("NVIDIA H200", "llvmpipe (LLVM 15.0.6, 256 bits)")
    type: str  # cpu, gpu, igpu, accel, meta ("unknown": the server cannot say)
    backend: str  # the ggml backend: "CPU", "CUDA", "Vulkan" ("": the server cannot say)
    host: bool  # in host memory (a move copies it with memcpy; else through the device's API)
    bytes: int

    @classmethod
    def parse(cls, obj: object, cause: FallbackCause, where: str) -> KvBuffer:
        r = _Reader(obj, KvRoute.CAPS, cause, where)
        return cls(
            name=r.string("name"),
            device=r.string("device"),
            description=r.string("description"),
            type=r.string("type"),
            backend=r.string("backend"),
            host=r.flag("host"),
            bytes=r.integer("bytes"),
        )

    @property
    def known(self) -> bool:
        return bool(self.device and self.backend) and self.type != "unknown"


@dataclass(frozen=True)
class Caps:
    """GET /kvctl/caps."""

    format_version: int
    instance: str | None
    compat: Mapping[str, Any]  # the compatibility key, compared and sent back as the server wrote it
    n_ctx_slot: int
    n_cells: int
    n_parallel: int
    owner_ids: tuple[int, int]  # [first, end)
    sharing: bool
    reasons: tuple[str, ...]  # why sharing is off
    moves: bool
    moves_off: tuple[str, ...]  # why KV moves are off
    memory_kind: str
    dir: str | None
    dir_id: str | None
    infill: Mapping[str, Any] | None  # patch 0013 and later
    embedding: Embedding | None  # patch 0014 and later
    fault_injection: bool
    compat_id: str
    checkpoints: bool  # patch 0017: whole-state checkpoints on (recurrent and hybrid memory)
    checkpoints_off: tuple[str, ...]  # why they are off
    # Where the memory lives (patch 0019): None where the server does not say (an older patch).
    kv_buffers: tuple[KvBuffer, ...] | None = None
    # Patch 0020: exports in chunks at the caller's offsets (the arena); an older server would
    # write a whole blob at offset 0 of the arena instead, so it gets payload files.
    export_chunks: bool = False
    # Patch 0024: the server pins the payload files it keeps mapped (the arena) for the device
    # that holds the KV, so copies between them run at the bus's speed.
    pinned_payloads: bool = False
    # Patch 0026: a multimodal projector is loaded; the server marks each media part of a rendered
    # prompt with ``media_marker`` (random per process: /apply-template's prompt carries it).
    multimodal: bool = False
    media_marker: str = ""
    # Patch 0027: media chunks move with the text around them; else ``media_fixed`` says why not
    # (M-RoPE, a draft model): the server reuses them only on the slot that holds them.
    media_moves: bool = False
    media_fixed: str = ""
    # Patch 0028: owners hold movable media too (publish keeps the chunks, attach hands them on).
    media_shared: bool = False
    # A digest of how the server keys media (its projector, image token limits, whether media
    # moves): a tokenization by one server holds for another only where these are equal.
    media_keys: str = ""

    @property
    def media_fixed_why(self) -> str:
        """With a projector whose media does not move, why ("" otherwise)."""
        if not self.multimodal or self.media_moves:
            return ""
        return self.media_fixed or "a patch before 0027"

    @property
    def kv_devices(self) -> tuple[str, ...]:
        """The devices the KV (and recurrent state) is on, in the server's order, each once."""
        return tuple(dict.fromkeys(b.device for b in self.kv_buffers or () if b.device))

    @property
    def kv_backends(self) -> tuple[str, ...]:
        """The ggml backends of those devices, each once."""
        return tuple(dict.fromkeys(b.backend for b in self.kv_buffers or () if b.backend))

    def kv_where_unknown(self) -> str | None:
        """Why the caps cannot say where the KV lives (None: they can). A server that cannot
        say is served without moves (invariant 9: what is not known is not trusted)."""
        if self.kv_buffers is None:
            return "its /kvctl/caps do not say where its KV lives (no memory.buffers: a patch before 0019)"
        if not self.kv_buffers:
            return "its /kvctl/caps list no buffer for its KV (memory.buffers is empty)"
        unknown = [b.name or "?" for b in self.kv_buffers if not b.known]
        if unknown:
            return f"its /kvctl/caps cannot say which device or backend holds KV buffer {', '.join(unknown)}"
        return None

    @classmethod
    def parse(cls, obj: object, cause: FallbackCause = FallbackCause.TRANSPORT) -> Caps:
        r = _Reader(obj, KvRoute.CAPS, cause)
        owners = r.ints("owner_ids")
        if owners is None or len(owners) != 2:
            raise KvctlReplyError(cause, KvRoute.CAPS, "field 'owner_ids' is not [first, end)")
        memory = _Reader(r.obj_of("memory"), KvRoute.CAPS, cause, "memory.")
        ckpt_obj = r.opt_obj("checkpoints")
        ckpt = _Reader(ckpt_obj or {"on": False, "off": []}, KvRoute.CAPS, cause, "checkpoints.")
        buffers = memory.list_of("buffers") if "buffers" in memory.obj else None
        kv_buffers = (
            None
            if buffers is None
            else tuple(KvBuffer.parse(b, cause, f"memory.buffers[{i}].") for i, b in enumerate(buffers))
        )
        mm = _Reader(r.opt_obj("multimodal") or {"on": False}, KvRoute.CAPS, cause, "multimodal.")
        embedding_obj = r.opt_obj("embedding")
        embedding = None
        if embedding_obj is not None:
            e = _Reader(embedding_obj, KvRoute.CAPS, cause, "embedding.")
            embedding = Embedding(on=e.flag("on"), pooling=e.integer("pooling"))
        return cls(
            format_version=r.integer("format_version"),
            instance=r.opt_str("instance"),
            compat=r.obj_of("compat"),
            n_ctx_slot=r.integer("n_ctx_slot"),
            n_cells=r.integer("n_cells"),
            n_parallel=r.integer("n_parallel"),
            owner_ids=(owners[0], owners[1]),
            sharing=r.flag("sharing"),
            reasons=r.strs("reasons"),
            moves=r.flag("moves"),
            moves_off=r.strs("moves_off"),
            memory_kind=memory.string("kind"),
            dir=r.opt_str("dir"),
            dir_id=r.opt_str("dir_id"),
            infill=r.opt_obj("infill"),
            embedding=embedding,
            fault_injection=r.flag("fault_injection", default=False),
            compat_id=r.string("compat_id"),
            checkpoints=ckpt.flag("on"),
            checkpoints_off=ckpt.strs("off"),
            kv_buffers=kv_buffers,
            export_chunks=r.flag("export_chunks", default=False),
            pinned_payloads=memory.flag("pinned_payloads", default=False),
            multimodal=mm.flag("on"),
            media_marker=(mm.opt_str("media_marker") or "") if mm.flag("on") else "",
            media_moves=mm.flag("media_moves", default=False),
            media_fixed=mm.opt_str("media_fixed") or "",
            media_shared=mm.flag("media_shared", default=False),
            media_keys=mm.opt_str("media_keys") or "",
        )


@dataclass(frozen=True)
class SeqInfo:
    """One sequence in GET /kvctl/slots (a slot or an owner), and the publish / attach replies."""

    id: int
    n_tokens: int
    pos_min: int  # -1: empty
    pos_max: int  # -1: empty
    n_cells: int
    busy: bool  # owners: always False
    tokens: np.ndarray | None  # only when asked for (``?tokens=1``)
    checkpoints: tuple[int, ...] = ()  # slots with whole-state checkpoints on: where the server took them
    # A multimodal server's slot: where its first media chunk no move can name starts (None: it
    # holds none; movable chunks are keyed by tokens below -1, patch 0027). The cells from there on
    # hold media (token -1) and what followed it: never moved or recorded.
    media_at: int | None = None

    @classmethod
    def parse(cls, obj: object, route: KvRoute, cause: FallbackCause, where: str = "") -> SeqInfo:
        r = _Reader(obj, route, cause, where)
        tokens = r.ints("tokens", optional=True)
        media = [
            _Reader(m, route, cause, f"{where}media[{i}].")
            for i, m in enumerate(r.list_of("media", default_empty=True))
        ]
        starts = [m.integer("idx") for m in media if not m.flag("movable", default=False)]
        if any(i < 0 for i in starts):
            raise KvctlReplyError(cause, route, f"field {where}'media' starts a chunk before 0")
        return cls(
            id=r.integer("id"),
            n_tokens=r.integer("n_tokens"),
            pos_min=r.integer("pos_min"),
            pos_max=r.integer("pos_max"),
            n_cells=r.integer("n_cells"),
            busy=r.flag("busy", default=False),
            tokens=None if tokens is None else np.asarray(tokens, dtype=np.int32),
            checkpoints=r.ints("checkpoints", optional=True) or (),
            media_at=min(starts) if starts else None,
        )

    def held_tokens(self) -> np.ndarray:
        return self.tokens if self.tokens is not None else np.zeros(0, np.int32)

    def keyed_prefix(self) -> np.ndarray:
        """The tokens before the first media chunk no move can name: all of them without one. A
        -1 the server did not list as media ends them too (it names no cell the proxy can key)."""
        tokens = self.held_tokens()
        end = len(tokens) if self.media_at is None else min(self.media_at, len(tokens))
        unkeyed = np.flatnonzero(tokens[:end] == -1)
        return tokens[: int(unkeyed[0]) if len(unkeyed) else end]

    def as_json(self) -> dict[str, Any]:
        """The fields as the server sent them (tokens left out)."""
        out: dict[str, Any] = {
            "id": self.id,
            "n_tokens": self.n_tokens,
            "pos_min": self.pos_min,
            "pos_max": self.pos_max,
            "n_cells": self.n_cells,
        }
        return out


@dataclass(frozen=True)
class Slots:
    """GET /kvctl/slots."""

    slots: tuple[SeqInfo, ...]
    owners: tuple[SeqInfo, ...]  # non-empty owners only

    @classmethod
    def parse(cls, obj: object, cause: FallbackCause = FallbackCause.TRANSPORT) -> Slots:
        r = _Reader(obj, KvRoute.SLOTS, cause)
        return cls(
            slots=tuple(
                SeqInfo.parse(e, KvRoute.SLOTS, cause, f"slots[{i}].")
                for i, e in enumerate(r.list_of("slots"))
            ),
            owners=tuple(
                SeqInfo.parse(e, KvRoute.SLOTS, cause, f"owners[{i}].")
                for i, e in enumerate(r.list_of("owners", default_empty=True))
            ),
        )

    def slot(self, slot_id: int) -> SeqInfo:
        for entry in self.slots:
            if entry.id == slot_id:
                return entry
        raise KvctlReplyError(FallbackCause.TRANSPORT, KvRoute.SLOTS, f"no entry for slot {slot_id}")


@dataclass(frozen=True)
class Cells:
    """GET /kvctl/cells: the pool's exact cell counts."""

    n_cells: int
    used: int
    free: int
    slot: int  # cells held by any slot
    owner: int  # cells held by any owner
    owner_only: int  # cells held by owners and no slot
    logical: int  # the sum of ``seq``
    seq: Mapping[str, int]  # cells per non-empty sequence id

    @classmethod
    def parse(cls, obj: object, cause: FallbackCause = FallbackCause.TRANSPORT) -> Cells:
        r = _Reader(obj, KvRoute.CELLS, cause)
        return cls(
            n_cells=r.integer("n_cells"),
            used=r.integer("used"),
            free=r.integer("free"),
            slot=r.integer("slot"),
            owner=r.integer("owner"),
            owner_only=r.integer("owner_only"),
            logical=r.integer("logical"),
            seq=_counts(r.obj_of("seq"), cause),
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "n_cells": self.n_cells,
            "used": self.used,
            "free": self.free,
            "slot": self.slot,
            "owner": self.owner,
            "owner_only": self.owner_only,
            "logical": self.logical,
            "seq": dict(self.seq),
        }


@dataclass(frozen=True)
class MediaChunk:
    """One media chunk of a tokenized prompt (``Tokenized``)."""

    idx: int  # its first cell
    n_tokens: int  # its cells
    id: str  # the content hash the server matches chunks by
    movable: bool  # a position per cell (not M-RoPE): keyed by tokens below -1, moved like text
    chunk: str  # its metadata (base64 of mtmd_input_chunk_save): what an import of it names


@dataclass(frozen=True)
class Tokenized:
    """POST /kvctl/tokenize (patch 0027): a chat request's tokens exactly as its completion makes
    them, each cell of a movable media chunk keyed by a token below -1 (from the chunk's content
    hash), any other media cell -1, and the chunks."""

    tokens: np.ndarray
    media: tuple[MediaChunk, ...]
    keys: str = ""  # the tokenizing server's caps ``media_keys``: only servers keying alike take it

    @classmethod
    def parse(cls, obj: object, cause: FallbackCause = FallbackCause.TRANSPORT) -> Tokenized:
        r = _Reader(obj, KvRoute.TOKENIZE, cause)
        tokens = np.asarray(r.ints("tokens") or (), dtype=np.int32)
        media = []
        covered = np.zeros(len(tokens), dtype=bool)
        for i, entry in enumerate(r.list_of("media")):
            m = _Reader(entry, KvRoute.TOKENIZE, cause, f"media[{i}].")
            chunk = MediaChunk(
                m.integer("idx"), m.integer("n_tokens"), m.string("id"), m.flag("movable"), m.string("chunk")
            )
            cells = tokens[chunk.idx : chunk.idx + chunk.n_tokens]
            want_cells = (cells < -1).all() if chunk.movable else (cells == -1).all()
            if chunk.idx < 0 or chunk.n_tokens < 1 or len(cells) != chunk.n_tokens or not want_cells:
                raise KvctlReplyError(
                    cause, KvRoute.TOKENIZE, f"media[{i}] does not match the tokens it covers"
                )
            covered[chunk.idx : chunk.idx + chunk.n_tokens] = True
            media.append(chunk)
        if ((tokens < 0) & ~covered).any():
            raise KvctlReplyError(cause, KvRoute.TOKENIZE, "a token below 0 is in no media chunk")
        return cls(tokens=tokens, media=tuple(media))

    def keyed(self) -> np.ndarray:
        """The tokens a lease plans on: up to the first media cell no move can name (-1)."""
        unmovable = np.flatnonzero(self.tokens == -1)
        return self.tokens[: int(unmovable[0])] if len(unmovable) else self.tokens

    def chunks_in(self, p0: int, p1: int) -> list[dict[str, Any]]:
        """What an import of ``[p0, p1)`` names: the movable chunks that start there."""
        return [{"idx": m.idx, "chunk": m.chunk} for m in self.media if m.movable and p0 <= m.idx < p1]

    def chunk_start(self, p: int) -> int:
        """``p``, or the first cell of the media chunk ``p`` falls inside (a move ends at a chunk's edge)."""
        for m in self.media:
            if m.idx < p < m.idx + m.n_tokens:
                return m.idx
        return p
