"""Resident prefixes of one server: token prefixes held by owner sequences in its KV pool.

Pure bookkeeping (no I/O): which owner id holds which tokens, which slots still share
its cells, pins while an attach is in flight, and the order in which to release entries
when the cell budget or the free-cell headroom needs room. The coordinator measures real
cell counts on the server (``/kvctl/cells``) and decides with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from proxy.core.planner import ResidentView
from proxy.core.prefix import common_prefix


@dataclass
class ResidentEntry:
    owner_id: int
    tokens: np.ndarray
    last_used: float
    pins: int = 0
    hits: int = 0
    # slot id -> how many leading cells that slot still shares with this owner
    sharers: dict[int, int] = field(default_factory=dict)
    ns: str = ""  # cache-isolation namespace: only requests of the same one may attach it

    @property
    def n(self) -> int:
        return len(self.tokens)

    def frees_on_release(self) -> int:
        """Cells a release would free, ignoring overlap with other owners (an estimate)."""
        return self.n - max(self.sharers.values(), default=0)


@dataclass(frozen=True)
class ResidentStats:
    entries: int
    tokens: int
    pinned: int
    admitted: int
    evicted: int
    hits: int


class ResidentIndex:
    def __init__(self, owner_ids: range, max_entries: int) -> None:
        self.owner_ids = owner_ids
        self.max_entries = min(max_entries, len(owner_ids)) if max_entries > 0 else min(64, len(owner_ids))
        self.entries: dict[int, ResidentEntry] = {}
        self.admitted = 0
        self.evicted = 0
        self.hits = 0

    # ---- lookups ---------------------------------------------------------------------

    def views(self, tokens: np.ndarray, ns: str = "") -> tuple[ResidentView, ...]:
        """Each entry's usable prefix of ``tokens`` in namespace ``ns`` (entries that share
        nothing are left out)."""
        out = []
        for entry in self.entries.values():
            if entry.ns != ns:
                continue
            lcp = common_prefix(entry.tokens, tokens)
            if lcp > 0:
                out.append(ResidentView(entry.owner_id, lcp))
        return tuple(out)

    def has(self, tokens: np.ndarray, ns: str = "") -> bool:
        return any(
            e.ns == ns and e.n == len(tokens) and common_prefix(e.tokens, tokens) == e.n
            for e in self.entries.values()
        )

    def free_owner(self) -> int | None:
        if len(self.entries) >= self.max_entries:
            return None
        return next((o for o in self.owner_ids if o not in self.entries), None)

    def release_order(self) -> list[int]:
        """Unpinned entries, those whose release frees physical cells first, then least recently used."""
        candidates = [e for e in self.entries.values() if e.pins == 0]
        candidates.sort(key=lambda e: (e.frees_on_release() <= 0, e.last_used))
        return [e.owner_id for e in candidates]

    def stats(self) -> ResidentStats:
        return ResidentStats(
            len(self.entries),
            sum(e.n for e in self.entries.values()),
            sum(1 for e in self.entries.values() if e.pins),
            self.admitted,
            self.evicted,
            self.hits,
        )

    # ---- mutations (one synchronous step each) ---------------------------------------

    def add(self, owner_id: int, tokens: np.ndarray, source_slot: int, now: float, ns: str = "") -> None:
        if owner_id in self.entries or owner_id not in self.owner_ids:
            raise ValueError(f"owner {owner_id} is taken or out of range")
        self.entries[owner_id] = ResidentEntry(
            owner_id, tokens.copy(), now, sharers={source_slot: len(tokens)}, ns=ns
        )
        self.admitted += 1

    def remove(self, owner_id: int) -> None:
        if self.entries.pop(owner_id, None) is not None:  # gone already when the server restarted
            self.evicted += 1

    def pin(self, owner_id: int) -> None:
        self.entries[owner_id].pins += 1

    def unpin(self, owner_id: int) -> None:
        entry = self.entries.get(owner_id)
        if entry is not None:
            if entry.pins <= 0:
                raise ValueError(f"unpin of owner {owner_id} without pin")
            entry.pins -= 1

    def attached(self, owner_id: int, slot_id: int, m: int, now: float) -> None:
        entry = self.entries.get(owner_id)
        if entry is None:  # the server restarted while attaching: the index was reset
            return
        entry.sharers[slot_id] = m
        entry.last_used = now
        entry.hits += 1
        self.hits += 1

    def slot_changed(self, slot_id: int, tokens: np.ndarray) -> None:
        """A slot now holds ``tokens``: it shares only the still-common prefix with each owner."""
        for entry in self.entries.values():
            shared = entry.sharers.get(slot_id)
            if shared is None:
                continue
            keep = min(shared, common_prefix(entry.tokens, tokens))
            if keep > 0:
                entry.sharers[slot_id] = keep
            else:
                del entry.sharers[slot_id]

    def check_invariants(self) -> None:
        assert len(self.entries) <= self.max_entries, "more entries than allowed"
        for owner_id, entry in self.entries.items():
            assert owner_id == entry.owner_id and owner_id in self.owner_ids, f"bad owner id {owner_id}"
            assert entry.pins >= 0, f"owner {owner_id} has negative pins"
            assert entry.n > 0, f"owner {owner_id} holds nothing"
            assert all(0 < m <= entry.n for m in entry.sharers.values()), (
                f"owner {owner_id} sharers out of range"
            )
