"""Planner: table of route choices plus properties over random inputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.planner import Plan, PlanInput, Policy, ResidentView, Route, SlotView, plan

pytestmark = pytest.mark.unit

MIN = 10


def slot(
    slot_id: int, lcp: int = 0, *, idle: bool = True, n_tokens: int | None = None, last_used: float = 0.0
) -> SlotView:
    return SlotView(slot_id, idle, lcp, lcp if n_tokens is None else n_tokens, last_used)


@dataclass
class Case:
    name: str
    slots: list[SlotView]
    expect: tuple[Route, int, int, int | None, int, int, int]  # route, slot, reuse, owner, from, to, cached
    n_prompt: int = 100
    host: int = 0
    residents: list[ResidentView] = field(default_factory=list)
    policy: Policy = "longest"
    share: bool = True
    whole: bool = False  # the host match is a whole-state checkpoint


CASES = [
    Case(
        "cold: prefill on the LRU slot",
        [slot(0, last_used=5), slot(1, last_used=2)],
        (Route.PREFILL, 1, 0, None, 0, 0, 0),
    ),
    Case(
        "cold: LRU tie -> fewest tokens",
        [slot(0, n_tokens=50), slot(1, n_tokens=10)],
        (Route.PREFILL, 1, 0, None, 0, 0, 0),
    ),
    Case("A on the longest-lcp slot", [slot(0, 20), slot(1, 50)], (Route.A, 1, 50, None, 0, 0, 50)),
    Case(
        "A: tie -> most recently used",
        [slot(0, 50, last_used=1), slot(1, 50, last_used=9)],
        (Route.A, 1, 50, None, 0, 0, 50),
    ),
    Case("A below min is still fine", [slot(0, 3)], (Route.A, 0, 3, None, 0, 0, 3)),
    Case("busy slot ignored", [slot(0, 90, idle=False), slot(1, 20)], (Route.A, 1, 20, None, 0, 0, 20)),
    Case("A capped at n_prompt - 1", [slot(0, 50)], (Route.A, 0, 49, None, 0, 0, 49), n_prompt=50),
    Case(
        "one-token prompt: nothing reusable, keep the best slot",
        [slot(0), slot(1, 1)],
        (Route.PREFILL, 1, 0, None, 0, 0, 0),
        n_prompt=1,
    ),
    Case("empty prompt", [slot(0)], (Route.PREFILL, 0, 0, None, 0, 0, 0), n_prompt=0),
    Case("H from cold", [slot(0), slot(1, last_used=-1)], (Route.H, 1, 0, None, 0, 80, 80), host=80),
    Case("H below min ignored", [slot(0)], (Route.PREFILL, 0, 0, None, 0, 0, 0), host=MIN - 1),
    Case("H capped", [slot(0)], (Route.H, 0, 0, None, 0, 99, 99), host=150),
    Case("A ties H -> A", [slot(0, 60)], (Route.A, 0, 60, None, 0, 0, 60), host=60),
    Case(
        "A+H when host reaches min further",
        [slot(0, 30), slot(1)],
        (Route.AH, 0, 30, None, 30, 90, 90),
        host=90,
    ),
    Case(
        "host only a bit further: full H is still longest",
        [slot(0, 85)],
        (Route.H, 0, 0, None, 0, 90, 90),
        host=90,
    ),
    Case(
        "S longer than A",
        [slot(0, 10), slot(1)],
        (Route.S, 0, 70, 5, 0, 0, 70),
        residents=[ResidentView(5, 70), ResidentView(6, 40)],
    ),
    Case(
        "S on the LRU slot when no lcp",
        [slot(0, last_used=3), slot(1, last_used=1)],
        (Route.S, 1, 70, 5, 0, 0, 70),
        residents=[ResidentView(5, 70)],
    ),
    Case("S ties A -> A", [slot(0, 70)], (Route.A, 0, 70, None, 0, 0, 70), residents=[ResidentView(5, 70)]),
    Case(
        "S below min ignored",
        [slot(0)],
        (Route.PREFILL, 0, 0, None, 0, 0, 0),
        residents=[ResidentView(5, MIN - 1)],
    ),
    Case(
        "sharing off",
        [slot(0, 10)],
        (Route.A, 0, 10, None, 0, 0, 10),
        residents=[ResidentView(5, 70)],
        share=False,
    ),
    Case("S capped", [slot(0)], (Route.S, 0, 99, 5, 0, 0, 99), residents=[ResidentView(5, 300)]),
    Case("S ties H -> S", [slot(0)], (Route.S, 0, 70, 5, 0, 0, 70), host=70, residents=[ResidentView(5, 70)]),
    Case("S+H", [slot(0)], (Route.SH, 0, 40, 5, 40, 95, 95), host=95, residents=[ResidentView(5, 40)]),
    Case(
        "share: A wins over a longer host, mixed tops it up",
        [slot(0, 20)],
        (Route.AH, 0, 20, None, 20, 90, 90),
        host=90,
        policy="share",
    ),
    Case(
        "share: A alone when the host adds less than min",
        [slot(0, 20)],
        (Route.A, 0, 20, None, 0, 0, 20),
        host=20 + MIN - 1,
        policy="share",
    ),
    Case(
        "share: S alone when the host adds less than min",
        [slot(0)],
        (Route.S, 0, 30, 5, 0, 0, 30),
        host=30 + MIN - 1,
        residents=[ResidentView(5, 30)],
        policy="share",
    ),
    Case(
        "share: H when neither A nor S", [slot(0)], (Route.H, 0, 0, None, 0, 90, 90), host=90, policy="share"
    ),
    Case(
        "checkpoint: never on top of A, replaces the slot whole",
        [slot(0, 20)],
        (Route.H, 0, 0, None, 0, 90, 90),
        host=90,
        whole=True,
    ),
    Case(
        "checkpoint: a gain under min keeps A",
        [slot(0, 85)],
        (Route.A, 0, 85, None, 0, 0, 85),
        host=85 + MIN - 1,
        whole=True,
    ),
    Case(
        "checkpoint: a gain of min restores it",
        [slot(0, 80)],
        (Route.H, 0, 0, None, 0, 80 + MIN, 80 + MIN),
        host=80 + MIN,
        whole=True,
    ),
    Case(
        "checkpoint: cold",
        [slot(0), slot(1, last_used=3)],
        (Route.H, 0, 0, None, 0, 50, 50),
        host=50,
        whole=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan_table(case: Case) -> None:
    inp = PlanInput(
        case.n_prompt,
        tuple(case.slots),
        case.host,
        tuple(case.residents),
        case.policy,
        MIN,
        case.share,
        case.whole,
    )
    got = plan(inp)
    assert got is not None
    assert (
        got.route,
        got.slot_id,
        got.reuse_len,
        got.owner_id,
        got.host_from,
        got.host_to,
        got.predicted_cached,
    ) == case.expect


def test_no_idle_slot() -> None:
    assert plan(PlanInput(100, (slot(0, 50, idle=False),), 90)) is None
    assert plan(PlanInput(100, (), 90)) is None


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        PlanInput(10, (), 0, policy="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PlanInput(10, (), 0, min_restore_tokens=-1)


def test_route_values() -> None:
    # The order is the one reports and metrics list routes in (ROUTES).
    assert [r.value for r in Route] == ["A", "S", "H", "A+H", "S+H", "prefill"]


slots_st = st.lists(
    st.builds(
        SlotView,
        st.integers(0, 7),
        st.booleans(),
        st.integers(0, 300),
        st.integers(0, 300),
        st.floats(0, 100),
    ),
    max_size=5,
).map(lambda ss: tuple({s.slot_id: s for s in ss}.values()))
residents_st = st.lists(st.builds(ResidentView, st.integers(8, 12), st.integers(0, 300)), max_size=3)


@settings(max_examples=400, deadline=None)
@given(
    n_prompt=st.integers(0, 300),
    slots=slots_st,
    host=st.integers(0, 300),
    residents=residents_st,
    policy=st.sampled_from(["longest", "share"]),
    min_restore=st.integers(0, 64),
    share=st.booleans(),
)
def test_plan_properties(
    n_prompt: int,
    slots: tuple[SlotView, ...],
    host: int,
    residents: list[ResidentView],
    policy: Policy,
    min_restore: int,
    share: bool,
) -> None:
    inp = PlanInput(n_prompt, slots, host, tuple(residents), policy, min_restore, share)
    got = plan(inp)
    idle = [s for s in slots if s.idle]
    if not idle:
        assert got is None
        return
    assert got is not None
    _check_executable(inp, got, idle)
    if policy == "longest":
        assert got.predicted_cached == _longest_available(inp, idle)


def _check_executable(inp: PlanInput, p: Plan, idle: list[SlotView]) -> None:
    """Every plan must be something the executor can actually do."""
    cap = max(inp.n_prompt - 1, 0)
    chosen = next(s for s in idle if s.slot_id == p.slot_id)
    assert 0 <= p.predicted_cached <= cap
    assert p.host_from <= p.host_to <= min(inp.host_len, cap)
    has_host = p.route in (Route.H, Route.AH, Route.SH)
    assert has_host == (p.host_to > p.host_from)
    if has_host:
        assert p.host_to >= p.host_from + inp.min_restore_tokens or p.route == Route.H
        assert p.host_to >= inp.min_restore_tokens
        assert p.predicted_cached == p.host_to and p.host_from == p.reuse_len
    if p.route in (Route.A, Route.AH):
        assert 0 < p.reuse_len <= chosen.lcp and p.owner_id is None
    if p.route in (Route.S, Route.SH):
        assert inp.share_enabled and p.owner_id is not None
        owner = max((r for r in inp.residents if r.owner_id == p.owner_id), key=lambda r: r.lcp)
        assert inp.min_restore_tokens <= p.reuse_len <= min(owner.lcp, cap)
    if p.route in (Route.A, Route.S):
        assert p.predicted_cached == p.reuse_len
    if p.route == Route.PREFILL:
        assert p.predicted_cached == 0


def _longest_available(inp: PlanInput, idle: list[SlotView]) -> int:
    cap = max(inp.n_prompt - 1, 0)
    a = min(max(s.lcp for s in idle), cap)
    s = min(max((r.lcp for r in inp.residents), default=0), cap) if inp.share_enabled else 0
    h = min(inp.host_len, cap)
    return max(a, s if s >= inp.min_restore_tokens else 0, h if h >= inp.min_restore_tokens else 0)
