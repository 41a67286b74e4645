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

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from proxy.core.prefix import common_prefix

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
    last_used: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return len(self.data) + self.tokens.nbytes + ENTRY_OVERHEAD


@dataclass
class CheckpointStore:
    """Checkpoints under a byte budget. ``on_hold(n)`` / ``on_free(n)`` tell the owner of the
    memory budget (the host tree) what the store holds, so both share ``--cache-ram``."""

    budget_bytes: int
    max_entries: int = MAX_ENTRIES
    on_hold: Callable[[int], object] = lambda n: None
    on_free: Callable[[int], None] = lambda n: None
    entries: list[Checkpoint] = field(default_factory=list)
    held_bytes: int = 0
    _clock: int = 0

    def find(self, ns: str, compat_id: str, tokens: np.ndarray) -> Checkpoint | None:
        """The checkpoint of exactly ``tokens``, if kept."""
        for cp in self.entries:
            if cp.ns == ns and cp.compat_id == compat_id and np.array_equal(cp.tokens, tokens):
                return cp
        return None

    def match(self, ns: str, compat_id: str, prompt: np.ndarray, min_tokens: int = 1) -> Checkpoint | None:
        """The longest checkpoint a request can continue from: its tokens start the prompt and
        leave at least one prompt token to compute (the server needs one for the logits)."""
        best: Checkpoint | None = None
        for cp in self.entries:
            n = cp.n_tokens
            if cp.ns != ns or cp.compat_id != compat_id or not min_tokens <= n < len(prompt):
                continue
            if (best is None or n > best.n_tokens) and common_prefix(cp.tokens, prompt) == n:
                best = cp
        return best

    def touch(self, cp: Checkpoint) -> None:
        self._clock += 1
        cp.last_used = self._clock

    def add(self, ns: str, compat_id: str, tokens: np.ndarray, data: bytes) -> Checkpoint | None:
        """Keep a checkpoint (replacing one of the same tokens), evicting the least recently
        used ones to fit; None when it alone exceeds the budget."""
        cp = Checkpoint(ns, compat_id, tokens.copy(), data)
        if cp.nbytes > self.budget_bytes:
            return None
        old = self.find(ns, compat_id, tokens)
        if old is not None:
            self._drop(old)
        while self.entries and (
            self.held_bytes + cp.nbytes > self.budget_bytes or len(self.entries) >= self.max_entries
        ):
            self._drop(min(self.entries, key=lambda e: e.last_used))
        self.entries.append(cp)
        self.held_bytes += cp.nbytes
        self.on_hold(cp.nbytes)
        self.touch(cp)
        return cp

    def clear(self) -> None:
        for cp in list(self.entries):
            self._drop(cp)

    def _drop(self, cp: Checkpoint) -> None:
        self.entries.remove(cp)
        self.held_bytes -= cp.nbytes
        self.on_free(cp.nbytes)
