"""Resident KV sharing on one server: publish prefixes into owner sequences, attach them
to slots, and release owners to respect the cell budget and the free-cell headroom.

Every method here does server I/O and must run under that server's move lock; the index
it updates is plain data (proxy/core/resident.py), changed only after the server confirmed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from proxy.core.payload import tokens_sha256
from proxy.core.resident import ResidentIndex
from proxy.errors import FallbackCause, KvMoveError
from proxy.server.dataplane.kvctl import Cells
from proxy.server.dataplane.ports import KvServer

log = logging.getLogger("radix")


class Sharing:
    def __init__(
        self, backend: KvServer, index: ResidentIndex, *, budget_cells: int, headroom: int, min_tokens: int
    ) -> None:
        self.backend = backend
        self.index = index
        self.budget_cells = budget_cells
        self.headroom = headroom
        self.min_tokens = min_tokens
        self.last_cells: Cells | None = None  # the pool's counts, as last measured

    async def cells(self) -> Cells:
        self.last_cells = await self.backend.cells()
        return self.last_cells

    async def attach(
        self, owner_id: int, slot_id: int, m: int, lora: Sequence[Mapping[str, Any]] | None = None
    ) -> None:
        entry = self.index.entries.get(owner_id)
        if entry is None or m > entry.n:
            raise KvMoveError(FallbackCause.ATTACH, f"owner {owner_id} is not known to hold {m} tokens")
        # Bound to the tokens the index files under this owner: the server refuses (409) if it holds others.
        await self.backend.attach(owner_id, slot_id, m, tokens_sha256(entry.tokens[:m]), lora)
        self.index.attached(owner_id, slot_id, m, time.monotonic())

    async def publish_prefixes(
        self, slot_id: int, slot_tokens: np.ndarray, lengths: Iterable[int], ns: str = ""
    ) -> int:
        """Publish ``[0,n)`` of the slot for each length worth sharing, in namespace ``ns``;
        returns entries added."""
        added = 0
        for n in sorted(set(lengths)):
            if n < self.min_tokens or n > len(slot_tokens) or self.index.has(slot_tokens[:n], ns):
                continue
            owner = self.index.free_owner()
            if owner is None:
                for victim in self.index.release_order():
                    await self._release(victim)
                    owner = self.index.free_owner()
                    if owner is not None:
                        break
            if owner is None:
                return added
            before = (await self.cells()).owner
            await self.backend.publish(slot_id, owner, n, tokens_sha256(slot_tokens[:n]))
            self.index.add(owner, slot_tokens[:n], slot_id, time.monotonic(), ns)
            added += 1
            if not await self._within_budget(owner, before):
                break
        return added

    async def _within_budget(self, new_owner: int, before: int) -> bool:
        """Admission by the real growth of the owners' cell union: evict others, else the newcomer."""
        owner_cells = (await self.cells()).owner
        if owner_cells <= self.budget_cells:
            return True
        self.index.pin(new_owner)
        try:
            for victim in self.index.release_order():
                await self._release(victim)
                owner_cells = (await self.cells()).owner
                if owner_cells <= self.budget_cells:
                    return True
        finally:
            self.index.unpin(new_owner)
        log.info(
            "resident: owner %d grew owner cells by %d past the budget %d; released",
            new_owner,
            owner_cells - before,
            self.budget_cells,
        )
        await self._release(new_owner)
        return False

    async def ensure_free(self, need: int) -> bool:
        """Release owners until ``need`` cells plus the headroom are free; False when owners
        could not give that many."""
        cells = await self.cells()
        for victim in self.index.release_order():
            if cells.free >= need + self.headroom:
                return True
            await self._release(victim)
            cells = await self.cells()
        return cells.free >= need + self.headroom

    async def _release(self, owner_id: int) -> None:
        try:
            await self.backend.release(owner_id)
        except KvMoveError as exc:
            log.warning("resident: release of owner %d failed: %s", owner_id, exc)
        finally:  # cancelled too: the owner may be gone, so it is no longer offered
            self.index.remove(owner_id)
