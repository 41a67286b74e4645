"""Route choice on pure data: which idle slot, and where its prefix KV comes from.

Routes (where the planner sits on a request's path: docs/design.md, "From a request to a
KV move"): A = the slot already holds the prefix; S = attach a resident prefix (shared
cells, no copy); H = import KV from the host radix tree; PREFILL = compute everything;
A+H / S+H = A or S for [0, base) plus H for [base, host).

Rules, in order:
1. Every usable length is capped at n_prompt - 1: the server always recomputes the last
   prompt token, so it never writes into cells another sequence shares.
2. A move shorter than `min_restore_tokens` is not worth doing: S and H candidates below
   it are dropped, and H on top of a base must add at least that many tokens. A costs
   nothing and is always a candidate.
3. Policy "longest" (default): the longest executable prefix wins; ties A > S > H.
   When H wins and the host extends an A or S base by >= min_restore_tokens, only
   [base, host) is imported on top of the base (A+H / S+H): same length, fewer bytes moved.
   Policy "share": the longer of A and S when either is usable (ties A); H only when
   neither is. Mixed extends the A or S base the same way.
   A whole-state checkpoint (``host_whole``) is never mixed: H replaces the base whole, and
   only when it is at least `min_restore_tokens` longer than the base.
4. Slot: for A (and A+H) the idle slot with the longest lcp, ties most recently used.
   For S, H and PREFILL the slot's KV is replaced: prefer the idle slot whose lcp is the
   longest when that lcp is > 0 (the server may still reuse it), else the least recently
   used idle slot, ties fewest tokens.
5. No idle slot: no plan (None); the caller queues or picks another server.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from proxy.config import Config

Policy = Literal["longest", "share"]


class Route(StrEnum):
    """The route label of a request (metrics, headers, logs), in the order reports list them."""

    A = "A"
    S = "S"
    H = "H"
    AH = "A+H"
    SH = "S+H"
    PREFILL = "prefill"


@dataclass(frozen=True)
class SlotView:
    """One slot of the server. `lcp`: common prefix of the request with what the slot
    verifiably holds."""

    slot_id: int
    idle: bool
    lcp: int
    n_tokens: int
    last_used: float
    # Leading media parts of the request the slot holds right after the shared text (a
    # multimodal server reuses those itself): the tie-break between slots of equal lcp.
    media_match: int = 0


@dataclass(frozen=True)
class ResidentView:
    """A resident prefix on the same server, held by owner sequence `owner_id`."""

    owner_id: int
    lcp: int


@dataclass(frozen=True)
class PlanInput:
    n_prompt: int
    slots: tuple[SlotView, ...]
    host_len: int  # host radix tree match length
    residents: tuple[ResidentView, ...] = ()
    policy: Policy = Config.kv_share_route
    min_restore_tokens: int = Config.min_restore_tokens
    share_enabled: bool = True
    # The host match is a whole-state checkpoint (recurrent or hybrid memory): valid at exactly
    # host_len, restored whole, never on top of an A or S base (no A+H or S+H).
    host_whole: bool = False

    def __post_init__(self) -> None:
        if self.policy not in ("longest", "share"):
            raise ValueError(f"policy must be 'longest' or 'share', not {self.policy!r}")
        if self.min_restore_tokens < 0:
            raise ValueError("min_restore_tokens must be >= 0")


@dataclass(frozen=True)
class Plan:
    """`reuse_len`: tokens from A or S (0 for H / PREFILL); H imports [host_from, host_to)
    (empty when host_from == host_to); `predicted_cached`: prompt tokens not computed."""

    route: Route
    slot_id: int
    reuse_len: int
    owner_id: int | None
    host_from: int
    host_to: int
    predicted_cached: int


def plan(inp: PlanInput) -> Plan | None:
    """Choose route and slot by the module's rules; None when no slot is idle."""
    idle = [s for s in inp.slots if s.idle]
    if not idle:
        return None
    cap = max(inp.n_prompt - 1, 0)
    a_slot = _best_lcp_slot(idle)
    a = min(a_slot.lcp, cap)
    owner, s = _best_resident(inp, cap)
    h = min(inp.host_len, cap)
    if h < inp.min_restore_tokens:
        h = 0

    # Base: A or S, the longer (ties A).
    base_route, base = (Route.S, s) if s > a else (Route.A, a)
    if h <= base or (inp.host_whole and h - base < inp.min_restore_tokens):
        return _base_plan(idle, a_slot, base_route, base, owner)
    if base > 0 and h - base >= inp.min_restore_tokens and not inp.host_whole:
        return _mixed_plan(idle, a_slot, base_route, base, owner, h)
    if inp.policy == "share" and base > 0:  # "share" uses H alone only when A and S give nothing
        return _base_plan(idle, a_slot, base_route, base, owner)
    # Full import of [0, h): replaces the slot's KV.
    return Plan(Route.H, _victim_slot(idle).slot_id, 0, None, 0, h, h)


def _best_lcp_slot(idle: list[SlotView]) -> SlotView:
    """Longest lcp; ties most recently used, then lowest id (deterministic)."""
    return max(idle, key=lambda s: (s.lcp, s.media_match, s.last_used, -s.slot_id))


def _victim_slot(idle: list[SlotView]) -> SlotView:
    """A slot whose KV will be replaced: longest lcp if any, else LRU with fewest tokens."""
    best = _best_lcp_slot(idle)
    if best.lcp > 0:
        return best
    return min(idle, key=lambda s: (s.last_used, s.n_tokens, s.slot_id))


def _best_resident(inp: PlanInput, cap: int) -> tuple[int | None, int]:
    """(owner, usable length) of the longest resident prefix, or (None, 0)."""
    if not inp.share_enabled or not inp.residents:
        return None, 0
    best = max(inp.residents, key=lambda r: (r.lcp, -r.owner_id))
    length = min(best.lcp, cap)
    if length < inp.min_restore_tokens:
        return None, 0
    return best.owner_id, length


def _base_plan(idle: list[SlotView], a_slot: SlotView, route: Route, base: int, owner: int | None) -> Plan:
    if route == Route.S:
        return Plan(Route.S, _victim_slot(idle).slot_id, base, owner, 0, 0, base)
    if base > 0:
        return Plan(Route.A, a_slot.slot_id, base, None, 0, 0, base)
    return Plan(Route.PREFILL, _victim_slot(idle).slot_id, 0, None, 0, 0, 0)


def _mixed_plan(
    idle: list[SlotView], a_slot: SlotView, route: Route, base: int, owner: int | None, h: int
) -> Plan:
    if route == Route.S:
        return Plan(Route.SH, _victim_slot(idle).slot_id, base, owner, base, h, h)
    return Plan(Route.AH, a_slot.slot_id, base, None, base, h, h)
