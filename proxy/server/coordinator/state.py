"""What the coordinator knows: each server's slots, and each request's lease on one slot."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from proxy.core.adapters import NO_ADAPTERS, Adapters
from proxy.core.admission import CellNeed
from proxy.core.checkpoints import Checkpoint
from proxy.core.infill import InfillParams
from proxy.core.planner import Plan, Route
from proxy.core.radix import HostMatch, RadixTree
from proxy.core.routing import MeasuredRates
from proxy.errors import FallbackCause
from proxy.server.coordinator.movelock import MoveLock
from proxy.server.dataplane.backend import ServerClient
from proxy.server.dataplane.kvctl import Caps, Tokenized
from proxy.server.dataplane.ports import KvServer, Mover
from proxy.server.dataplane.sharing import Sharing

EMPTY = np.zeros(0, dtype=np.int32)


@dataclass
class SlotState:
    slot_id: int
    tokens: np.ndarray = field(default_factory=lambda: EMPTY)  # exactly what its KV holds
    busy: bool = False
    last_used: float = 0.0
    # Cache-isolation namespace of the KV it holds; None: unknown (erase before any reuse).
    ns: str | None = ""
    # Recurrent and hybrid memory: where the server took context checkpoints of its tokens (as
    # /kvctl/slots lists them after each answer): how far its own reuse can go back.
    checkpoints: tuple[int, ...] = ()
    # KV cells it may hold past ``tokens`` (at most): an answer that was not read back because
    # the slot was taken while its save was pending. Counted as held; cleared when the server
    # confirms what the slot holds (read back, import, erase).
    unrecorded: int = 0
    # The lease whose answer is done and whose save is not worth waiting for: busy, yet a waiting
    # request may take the slot (``Leases``); its save then stops before it touches the slot.
    saver: Lease | None = None
    gen: int = 0  # bumped at every lease: a save after its slot was handed on sees it moved on
    # A multimodal server's slot holding media no move can name: the content hashes of that
    # request's media chunks, which follow ``tokens`` in its cells (counted in ``unrecorded``).
    media: tuple[str, ...] = ()

    def confirmed(self, tokens: np.ndarray) -> None:
        """The server confirmed the slot holds exactly ``tokens`` (nothing unrecorded)."""
        self.tokens, self.unrecorded, self.media = tokens, 0, ()


@dataclass(frozen=True)
class KvPlace:
    """Where a server's KV (and recurrent state) lives, as its caps say (``memory.buffers``)."""

    devices: tuple[str, ...] = ()  # "CPU", "CUDA0", "Vulkan0", ... (): unknown
    backends: tuple[str, ...] = ()  # "CPU", "CUDA", "Vulkan", ...
    host: bool | None = None  # every buffer in host memory (None: unknown)
    unknown: str | None = "not read yet"  # why the caps cannot say (None: they can)
    pairs: tuple[tuple[str, str], ...] = ()  # (device, backend) of each buffer, each once

    @classmethod
    def from_caps(cls, caps: Caps) -> KvPlace:
        buffers = caps.kv_buffers or ()
        return cls(
            devices=caps.kv_devices,
            backends=caps.kv_backends,
            host=all(b.host for b in buffers) if buffers else None,
            unknown=caps.kv_where_unknown(),
            pairs=tuple(dict.fromkeys((b.device or "unknown", b.backend or "unknown") for b in buffers)),
        )

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kv_devices": list(self.devices), "kv_backends": list(self.backends)}
        if self.host is not None:
            out["kv_on_host"] = self.host
        return out


@dataclass
class ServerState:
    name: str
    backend: KvServer  # its client (a ServerClient; a fake in the coordinator's unit tests)
    mover: Mover
    slots: list[SlotState]
    n_ctx_slot: int
    sharing: Sharing | None = None
    move_lock: MoveLock = field(default_factory=MoveLock)
    healthy: bool = True  # answering: may get new leases
    down_reason: str = ""
    instance: str | None = None  # the server process's id (/kvctl "instance"); a new one: it restarted
    epoch: int = 0  # bumped when the server restarted: what leases from before knew is gone
    reserved_cells: int = 0  # KV cells that admitted, unfinished requests will still fill
    admitted_cells: int = 0  # their whole reservations, computed prompts included (no-I/O check)
    model: str = ""  # the name clients ask for ("" in tests: any request)
    named: bool = False  # the operator named the model (--backend-url NAME=URL)
    model_ns: str = ""  # the model's tree namespace (its compatibility key): see routes.py
    n_cells: int = 0  # the KV pool's size (0: unknown)
    # Why KV moves are off for this server ((): on). Off, it is served with routes A and prefill
    # only: the server's own prefix reuse, no host restore, save or sharing (invariant 9).
    moves_off: tuple[str, ...] = ()
    # Recurrent and hybrid memory with moves off: whole-state checkpoints (caps checkpoints.on)
    # restore a prompt's exact prefix on any slot (route H), and are saved after each answer.
    checkpoints: bool = False
    compat_id: str = ""  # the server's compatibility id: which checkpoints it can restore
    infill: InfillParams | None = None  # what /infill builds its prompt from (caps; None: not reported)
    embeddings: bool = False  # started with --embeddings (caps embedding.on): serves /v1/embeddings
    pooling: int = -1  # its pooling type (caps embedding.pooling; 4: --reranking, serves /v1/rerank)
    # A multimodal projector is loaded (caps multimodal): what marks a media part in the prompt its
    # /apply-template renders ("": none loaded; such a server refuses media).
    media_marker: str = ""
    media_fixed: str = ""  # with a projector: why its media does not move ("" when it does)
    media_shared: bool = False  # its owners hold movable media too (caps multimodal.media_shared)
    media_keys: str = ""  # how it keys media (caps multimodal.media_keys): requests tokenized alike
    rates: MeasuredRates = field(default_factory=MeasuredRates)  # from its answers' timings and its moves
    kv: KvPlace = field(default_factory=KvPlace)  # where its KV lives (caps memory.buffers)
    # Set (and replaced) when a reservation ends: requests waiting for room look again.
    room_freed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when the health checks take the server out of routing, replaced when it is back: a
    # restore waiting on a hung server gives up then, not at its move deadline.
    went_down: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def moves(self) -> bool:
        return not self.moves_off

    @property
    def client(self) -> ServerClient:
        """The server's HTTP client for what is not a /kvctl operation (completions, tokenize,
        health): always the real one, never a test fake."""
        if not isinstance(self.backend, ServerClient):
            raise TypeError(f"{self.name}: no HTTP client ({type(self.backend).__name__})")
        return self.backend

    def reservation_ended(self, cells: int) -> None:
        self.reserved_cells -= cells
        if cells:
            self.room_freed.set()
            self.room_freed = asyncio.Event()

    def take_media_caps(self, caps: Caps) -> bool:
        """What its caps say of media (at connect, and after a restart: another projector, or
        none); True when that changed."""
        before = (self.media_marker, self.media_fixed, self.media_shared, self.media_keys)
        on = caps.multimodal
        self.media_marker = caps.media_marker if on else ""
        self.media_fixed = caps.media_fixed_why
        self.media_shared = on and caps.media_moves and caps.media_shared
        self.media_keys = caps.media_keys if on else ""
        return before != (self.media_marker, self.media_fixed, self.media_shared, self.media_keys)

    def admit(self, lease: Lease, need: CellNeed) -> None:
        """Reserve the cells an admitted request will fill (one step with its room check)."""
        self.reserved_cells += need.total
        self.admitted_cells += need.total
        lease.reserved_cells, lease.answer_cells, lease.admitted_cells = need.total, need.answer, need.total

    def admission_ended(self, lease: Lease) -> None:
        """The request is finished: its cells are in its slot's tokens (or gone)."""
        self.admitted_cells -= lease.admitted_cells
        lease.admitted_cells = 0
        self.reservation_ended(lease.reserved_cells)
        lease.reserved_cells = 0

    def free_cells_estimate(self) -> int:
        """Free KV cells as the proxy knows them (no I/O): the pool less what idle and busy
        slots hold, what admitted requests reserved, and cells only owner sequences hold."""
        if self.n_cells <= 0:
            return 1 << 30
        held = sum(len(s.tokens) + s.unrecorded for s in self.slots) + self.reserved_cells
        if self.sharing is not None:
            held += self.sharing.last_cells.owner_only if self.sharing.last_cells else 0
        return max(0, self.n_cells - held)


def prompt_cells(n_keyed: int, media: Tokenized | None) -> int:
    """The cells a prompt fills: its ``n_keyed`` tokens, or with media its whole tokenization
    (under M-RoPE the keyed part ends at the first image; the cells past it fill too)."""
    return len(media.tokens) if media is not None else n_keyed


@dataclass(frozen=True)
class Divergence:
    """Where the longest prefix held anywhere (a slot, a resident owner, the host tree) stopped
    matching a prompt, with the token windows around that position."""

    host_match: int  # tokens the host tree holds
    best_slot_match: int  # tokens the best slot holds
    at: int  # first position no cached sequence matches
    source: str | None  # "slot s0/1", "resident s0/9", "host" or None (nothing cached)
    ctx_from: int  # position of request_ctx[0] (and cached_ctx[0])
    request_ctx: tuple[int, ...]
    cached_ctx: tuple[int, ...] | None  # the holder's tokens there; None when the host tree reached furthest


@dataclass
class Lease:
    """One request's hold on one slot, from plan to release."""

    request_id: str
    server: ServerState
    slot: SlotState
    plan: Plan
    tokens: np.ndarray
    host: HostMatch | None  # pinned host path the plan imports from, until the restore ends
    why: Divergence  # where cached prefixes stopped matching, at plan time
    checkpoint: Checkpoint | None = None  # a whole-state checkpoint to restore (route H, moves off)
    ns: str = ""  # cache-isolation namespace of the request
    adapters: Adapters = NO_ADAPTERS  # its LoRA scales: every move into the slot names them
    epoch: int = 0  # the server's epoch when leased
    reserved_cells: int = 0  # its part of server.reserved_cells, returned on release
    answer_cells: int = 0  # of which for the answer (the rest is the prompt's)
    admitted_cells: int = 0  # its whole reservation, until released (server.admitted_cells)
    overdue: bool = False  # sent past the queue deadline without room on the books (no sharing)
    erase_first: bool = False  # the slot holds another namespace's KV: clear it before use
    no_cache: bool = False  # the slot's KV could not be cleared: the server must not reuse it
    queued_s: float = 0.0
    prefix_wait_s: float = 0.0  # before planning: waiting for a request in flight with its prefix
    n_predict: int = 0  # tokens the answer may add (routes._n_predict)
    # A request with media: its tokenization (the chunks an import names), and its chunks' ids.
    media: Tokenized | None = None
    media_ids: tuple[str, ...] = ()
    restore_s: float = 0.0  # in restore: making room, erasing, attaching, importing
    lock_wait_s: float = 0.0  # of which waiting for the server's move lock (saves, other restores)
    import_s: float = 0.0  # of which the host import (payload written, server's /kvctl/import)
    route: Route = Route.PREFILL
    fallback: FallbackCause | None = None
    owner_pinned: bool = False
    finishing: bool = False  # the answer is complete; the slot is being saved
    answered_at: float = 0.0  # when the answer was complete (the save's start)
    gen: int = 0  # the slot's ``gen`` when leased
    # The slot went on to the next request (released after the save's export, or taken while the
    # save was not worth waiting for): from then on the save touches no state of the slot.
    handed_on: bool = False
    took_saving: bool = False  # this request took a slot whose previous answer's save was pending
    takeable: bool = False  # its save is not worth waiting for (``KvSaves.takeable_cells``)
    started: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Waves (waves.py): while ``splittable`` (planned, not sent yet) a request of its wave may
    # ask it to compute its first ``split_to`` tokens alone first (a prefix step); ``wake``
    # is set when that step ended, or when the lease is done.
    splittable: bool = True
    split_to: int = 0
    split_waiters: int = 0  # requests waiting for its prefix step now
    planned_restore: bool = False  # counted in its server's restores from plan to import
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    prefix_step_tokens: int = 0  # the server's prompt_n and prompt_ms of the prefix step
    prefix_step_ms: float = 0.0

    @property
    def n_cells_prompt(self) -> int:
        return prompt_cells(len(self.tokens), self.media)

    def wake_waiters(self) -> None:
        """Requests waiting for this one's prefix look again; those that wait on it again get
        a fresh event (the old one stays set)."""
        woken, self.wake = self.wake, asyncio.Event()
        woken.set()

    def set_done(self) -> None:
        self.done.set()
        self.wake.set()

    def end_planned_restore(self) -> None:
        """Its planned restore is under way or will not happen (idempotent)."""
        if self.planned_restore:
            self.planned_restore = False
            self.server.move_lock.unplanned()

    def prompt_computed(self) -> None:
        """The server sent the first token: the prompt's cells are filled (the pool's free count
        shows them now), so only the answer's stay reserved."""
        drop = self.reserved_cells - self.answer_cells
        if drop > 0:
            self.reserved_cells -= drop
            self.server.reservation_ended(drop)

    def unpin(self, tree: RadixTree) -> None:
        """Drop the plan's pins on the host path and the resident owner (idempotent)."""
        if self.host is not None:
            tree.unpin(self.host)
            self.host = None
        sharing = self.server.sharing
        if self.owner_pinned and sharing is not None and self.plan.owner_id is not None:
            if self.epoch == self.server.epoch:  # a restart emptied the index and its pins
                sharing.index.unpin(self.plan.owner_id)
            self.owner_pinned = False
