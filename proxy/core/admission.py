"""KV-cell admission on pure data: the cells a planned request will fill, the pool's free
cells as the proxy's own books show them (``free_estimate``), and the invariant that ties one
server's reservations to its leases. The room checks against a measured pool (the reserved
cells on top, owners' headroom with sharing) are made where the pool is measured
(``KvMoves._make_room``, ``Sharing.ensure_free``).

Every request admitted to a slot reserves the cells it will add to the pool: its prompt
past what the slot keeps or attaches (an import of host KV writes new cells, an attach of a
resident prefix does not), plus its answer. The reservation is taken in the same synchronous
step as the room check, so requests admitted together never each count the same free cells
as theirs; the coordinator measures the pool (``/kvctl/cells``) only when this arithmetic
cannot show room without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from proxy.core.planner import Plan, Route
from proxy.core.prefix import common_prefix

# Routes whose first ``reuse_len`` cells the slot holds already (A) or shares with an owner (S).
HELD_ROUTES = (Route.A, Route.AH, Route.S, Route.SH)


@dataclass(frozen=True)
class CellNeed:
    """New KV cells a request fills: its prompt's (``prompt``) and its answer's (``answer``)."""

    prompt: int
    answer: int

    @property
    def total(self) -> int:
        return self.prompt + self.answer


def cells_needed(plan: Plan, n_prompt: int, n_predict: int, n_ctx_slot: int) -> CellNeed:
    """The cells a request with this plan adds to the pool. Imported host KV occupies new
    cells as much as computed KV does: only what the slot keeps (A) or attaches (S) is not
    new. The answer is clamped to what the slot can still hold."""
    held = plan.reuse_len if plan.route in HELD_ROUTES else 0
    answer = max(0, min(n_predict, n_ctx_slot - n_prompt))
    return CellNeed(max(0, n_prompt - held), answer)


def own_tail(slot_tokens: np.ndarray, tokens: np.ndarray) -> int:
    """Cells the leased slot gives back when the request starts: the server keeps at most
    the common prefix of what it holds and the prompt, and drops the rest first."""
    return len(slot_tokens) - common_prefix(slot_tokens, tokens)


def free_estimate(n_cells: int, held_by_slots: Iterable[int], admitted: int) -> int | None:
    """Free cells as far as the proxy can tell without asking the server, never more than
    there are: the pool less every slot's known tokens and the whole reservation of every
    request admitted and not finished (a computed prompt shows in neither yet, so it counts
    in full here). None when the pool's size is unknown."""
    if n_cells <= 0:
        return None
    return n_cells - sum(held_by_slots) - admitted


def check_reservations(n_cells: int, reserved: int, admitted: int, leases: Iterable[tuple[int, int]]) -> None:
    """One server's books: ``reserved`` (cells admitted requests will still fill) and
    ``admitted`` (their whole reservations) are the sums over its unfinished leases'
    ``(reserved, admitted)``; a lease never has more still to fill than it reserved; and no
    more cells are outstanding than the pool has (admission never oversubscribes it)."""
    parts = list(leases)
    assert reserved == sum(r for r, _ in parts), f"reserved {reserved} != leases {parts}"
    assert admitted == sum(a for _, a in parts), f"admitted {admitted} != leases {parts}"
    assert all(0 <= r <= a for r, a in parts), f"a lease's reservation is out of range: {parts}"
    assert n_cells <= 0 or reserved <= n_cells, f"{reserved} cells reserved in a pool of {n_cells}"
