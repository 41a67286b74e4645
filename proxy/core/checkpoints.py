"""Whole-state checkpoints of recurrent and hybrid models, kept in host memory (pure).

A recurrent layer keeps one state per sequence, the sum of every token so far: it cannot be
cut at a position, so the KV of such a model is never split into the radix tree's segments.
What can be kept is the whole state after ``tokens[0, n)``, exported by the patched server
at a position where it took a context checkpoint (``/kvctl/checkpoint``): valid at exactly
``n``, never at a prefix of it. A request whose prompt starts with those ``n`` tokens, and
has at least one more, can continue from it on any slot of a server of the same model
(``/kvctl/restore``, route H).

The payload is opaque here (the server binds it to the tokens' sha256, its compatibility key
and a hash of the bytes); the store keys it by cache-isolation namespace, the server's
compatibility id and the tokens, and bounds it by bytes (least recently used out first).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# Bookkeeping charged per checkpoint besides its payload (tokens array, entry, dict slot).
ENTRY_OVERHEAD = 256
# At most this many checkpoints: every lookup compares the prompt with each of them.
MAX_ENTRIES = 4096


@dataclass(eq=False)  # identity: entries are told apart by object, not by their arrays
class Checkpoint:
    ns: str
    compat_id: str
    tokens: np.ndarray  # exactly the tokens whose state the payload is
    data: bytes

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return len(self.data) + self.tokens.nbytes + ENTRY_OVERHEAD


Key = tuple[str, str, int, bytes]  # namespace, compat id, token count, the tokens' int32 bytes


def _key(ns: str, compat_id: str, tokens: np.ndarray) -> Key:
    return ns, compat_id, len(tokens), tokens.astype(np.int32, copy=False).tobytes()


@dataclass
class CheckpointStore:
    """Checkpoints under a byte budget. ``on_hold(n)`` / ``on_free(n)`` tell the owner of the
    memory budget (the host tree) what the store holds, so both share ``--cache-ram``.

    Looked up by exact key: ``find`` is one dict lookup, ``match`` one per distinct checkpoint
    length of the namespace and server kind (longest first), so neither scans every entry."""

    budget_bytes: int
    max_entries: int = MAX_ENTRIES
    on_hold: Callable[[int], object] = lambda n: None
    on_free: Callable[[int], None] = lambda n: None
    held_bytes: int = 0
    _lru: OrderedDict[Key, Checkpoint] = field(default_factory=OrderedDict)  # least recent first
    _lengths: dict[tuple[str, str], Counter[int]] = field(default_factory=dict)  # lengths kept

    @property
    def entries(self) -> list[Checkpoint]:
        return list(self._lru.values())

    def find(self, ns: str, compat_id: str, tokens: np.ndarray) -> Checkpoint | None:
        """The checkpoint of exactly ``tokens``, if kept."""
        return self._lru.get(_key(ns, compat_id, tokens))

    def match(self, ns: str, compat_id: str, prompt: np.ndarray, min_tokens: int = 1) -> Checkpoint | None:
        """The longest checkpoint a request can continue from: its tokens start the prompt and
        leave at least one prompt token to compute (the server needs one for the logits)."""
        lengths = self._lengths.get((ns, compat_id))
        if not lengths:
            return None
        for n in sorted((n for n in lengths if min_tokens <= n < len(prompt)), reverse=True):
            cp = self._lru.get(_key(ns, compat_id, prompt[:n]))
            if cp is not None:
                return cp
        return None

    def touch(self, cp: Checkpoint) -> None:
        key = _key(cp.ns, cp.compat_id, cp.tokens)
        if key in self._lru:
            self._lru.move_to_end(key)

    def add(self, ns: str, compat_id: str, tokens: np.ndarray, data: bytes) -> Checkpoint | None:
        """Keep a checkpoint (replacing one of the same tokens), evicting the least recently
        used ones to fit; None when it alone exceeds the budget."""
        cp = Checkpoint(ns, compat_id, tokens.astype(np.int32), data)
        if cp.nbytes > self.budget_bytes:
            return None
        key = _key(ns, compat_id, tokens)
        if key in self._lru:
            self._drop(key)
        while self._lru and (
            self.held_bytes + cp.nbytes > self.budget_bytes or len(self._lru) >= self.max_entries
        ):
            self._drop(next(iter(self._lru)))
        self._lru[key] = cp
        self._lengths.setdefault((ns, compat_id), Counter())[len(tokens)] += 1
        self.held_bytes += cp.nbytes
        self.on_hold(cp.nbytes)
        return cp

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget, least recently used out first until within it."""
        self.budget_bytes = budget_bytes
        while self._lru and self.held_bytes > budget_bytes:
            self._drop(next(iter(self._lru)))

    def clear(self) -> None:
        while self._lru:
            self._drop(next(iter(self._lru)))

    def _drop(self, key: Key) -> None:
        cp = self._lru.pop(key)
        lengths = self._lengths[(cp.ns, cp.compat_id)]
        lengths[cp.n_tokens] -= 1
        if lengths[cp.n_tokens] == 0:
            del lengths[cp.n_tokens]
        self.held_bytes -= cp.nbytes
        self.on_free(cp.nbytes)
