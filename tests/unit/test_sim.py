"""The scale simulator: a tiny scenario worked by hand, determinism, each policy's property."""

from __future__ import annotations

import dataclasses
import socket
from collections import Counter

import numpy as np
import pytest
from click.testing import CliRunner

from proxy.core.planner import Route
from proxy.sim.calibrate import Sample, fit_prefill
from proxy.sim.cli import sim
from proxy.sim.engine import SimConfig, Simulator
from proxy.sim.model import Calibration
from proxy.sim.policies import POLICIES, CacheAware, RoundRobin, least_loaded, session_sticky, stable_hash
from proxy.sim.report import summarize, table
from proxy.sim.state import Request, SimServer
from proxy.sim.workload import Session, Turn, WorkloadSpec, generate

pytestmark = pytest.mark.unit

# Round numbers: 100 prompt tokens/s with no context slowdown, 10 tokens/s decode, free moves.
EXACT = Calibration(
    prefill_tok_s=100.0,
    prefill_ctx_tokens=1e18,
    decode_tok_s=10.0,
    move_mb_s=1e18,
    move_call_s=0.0,
    attach_s=0.0,
    request_overhead_s=0.0,
)
SMALL = WorkloadSpec(sessions=40, rate_per_s=0.5, systems=3, system_tokens=(300, 600), seed=7)


def toks(n: int, start: int = 1000) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def two_turn_session() -> Session:
    """Turn 1: 200 tokens, 10 answered; 1 s later turn 2 = turn 1 + its answer + 100 new."""
    p1, a1 = toks(200), toks(10, 5000)
    p2 = np.concatenate([p1, a1, toks(100, 9000)])
    return Session(0, 0, 0.0, ((Turn(p1, a1),), (Turn(p2, toks(10, 6000)),)), (1.0,))


@pytest.mark.parametrize("host_tree", [True, False])
def test_tiny_scenario_known_answer(host_tree: bool) -> None:
    cfg = SimConfig(servers=1, slots=1, policy="round-robin", host_tree=host_tree, calib=EXACT)
    result = Simulator(cfg).run([two_turn_session()])
    first, second = result.served
    # Turn 1: prefill 200 tokens at 100/s; 10 tokens decoded at 10/s end it at 3.0 s.
    assert (first.route, first.cached, first.ttft_s, first.e2e_s) == (Route.PREFILL, 0, 2.0, 3.0)
    # Turn 2 arrives at 4.0: the slot holds turn 1 and its answer but the last token (209),
    # so route A reuses 209 tokens and computes 101: 1.01 s.
    assert (second.route, second.cached) == (Route.A, 209)
    assert second.ttft_s == pytest.approx(1.01)
    assert summarize(result).hit_rate == pytest.approx(209 / 510)


def test_host_tree_restores_on_another_server() -> None:
    """Two servers, round robin: turn 2 lands on the other server and restores turn 1's KV
    from the host tree (route H) instead of prefilling it."""
    cfg = SimConfig(servers=2, slots=1, policy="round-robin", host_tree=True, calib=EXACT)
    first, second = Simulator(cfg).run([two_turn_session()]).served
    assert (first.server, second.server) == (0, 1)
    assert (second.route, second.cached) == (Route.H, 209)
    stock = dataclasses.replace(cfg, host_tree=False)
    assert Simulator(stock).run([two_turn_session()]).served[1].route == Route.PREFILL


def test_same_seed_same_result_other_seed_differs() -> None:
    cfg = SimConfig(servers=4, policy="cache-aware", workload=SMALL)
    a, b = Simulator(cfg).run(), Simulator(cfg).run()
    assert a.served == b.served and a.busy_s == b.busy_s
    other = dataclasses.replace(cfg, workload=dataclasses.replace(SMALL, seed=8))
    assert Simulator(other).run().served != a.served


def test_round_robin_spreads_evenly() -> None:
    result = Simulator(SimConfig(servers=4, policy="round-robin", workload=SMALL)).run()
    assert max(result.requests) - min(result.requests) <= 1


def test_session_sticky_never_moves_a_session() -> None:
    result = Simulator(SimConfig(servers=4, policy="session-sticky", workload=SMALL)).run()
    assert result.sessions_moved == 0
    for s in result.served:
        assert s.server == stable_hash(f"session-{s.session_id}") % 4


def test_cache_aware_reuses_more_than_the_baselines() -> None:
    hit = {
        name: summarize(
            Simulator(SimConfig(servers=4, policy=name, host_tree=False, workload=SMALL)).run()
        ).hit_rate
        for name in POLICIES
    }
    assert hit["cache-aware"] > max(hit["round-robin"], hit["least-loaded"])
    # The coordinator's own cost model (proxy.core.routing) driven through the simulator.
    assert hit["proxy-cost"] > max(hit["round-robin"], hit["least-loaded"])


def server_with(calib: Calibration, index: int, held: np.ndarray | None = None) -> SimServer:
    sv = SimServer(index, 2, calib, share=False, min_restore_tokens=64)
    if held is not None:
        sv.slots[0].tokens = held
    return sv


def request(tokens: np.ndarray, session: int = 1) -> Request:
    return Request(1, session, 0, tokens, toks(4), 0.0)


CASES = [
    # (name, servers' held prefixes, servers' queued seconds, previous server, expected)
    ("prefix holder wins", [None, 900], [0.0, 0.0], None, 1),
    ("nothing held: lowest index", [None, None], [0.0, 0.0], None, 0),
    ("nothing held: previous server breaks the tie", [None, None], [0.0, 0.0], 1, 1),
    ("holder too busy: the other server", [900, None], [60.0, 0.0], None, 1),
    ("holder a little busy: still the holder", [900, None], [1.0, 0.0], None, 0),
]


@pytest.mark.parametrize(("name", "held", "queued", "prev", "expect"), CASES, ids=[c[0] for c in CASES])
def test_cache_aware_table(
    name: str, held: list[int | None], queued: list[float], prev: int | None, expect: int
) -> None:
    prompt = toks(1000)
    servers = [server_with(EXACT, i, None if h is None else prompt[:h]) for i, h in enumerate(held)]
    for sv, q in zip(servers, queued, strict=True):
        sv.engine_free_at = q
    policy = CacheAware(EXACT)
    if prev is not None:
        policy.last[1] = prev
    assert policy(request(prompt), servers, 0.0) == expect


def test_least_loaded_and_round_robin_on_a_table() -> None:
    servers = [server_with(EXACT, i) for i in range(3)]
    servers[0].slots[0].busy = True
    servers[1].queue.append(request(toks(5)))
    servers[1].queue.append(request(toks(5)))
    assert least_loaded(request(toks(5)), servers, 0.0) == 2
    rr = RoundRobin()
    assert [rr(request(toks(5)), servers, 0.0) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert session_sticky(request(toks(5), 42), servers, 0.0) == session_sticky(
        request(toks(9), 42), servers, 0.0
    )


def test_a_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="policy returned server 5"):
        Simulator(SimConfig(servers=2, workload=SMALL), policy=lambda req, servers, now: 5).run()
    with pytest.raises(ValueError, match="unknown policy"):
        Simulator(SimConfig(policy="random"))


def test_workload_prompts_extend_the_previous_turn() -> None:
    sessions = generate(SMALL)
    assert [s.start_s for s in sessions] == sorted(s.start_s for s in sessions)
    for s in sessions:
        for prev, step in zip(s.steps, s.steps[1:], strict=False):
            base = np.concatenate([prev[0].tokens, prev[0].answer])
            for turn in step:
                assert np.array_equal(turn.tokens[: len(base)], base)
    systems = Counter(s.system_id for s in sessions)
    assert systems.most_common(1)[0][0] == 0  # Zipf: the first system prompt is the most used


@pytest.mark.parametrize(
    ("cached", "n", "ctx", "expect"),
    [(0, 100, 1e18, 1.0), (50, 100, 1e18, 0.5), (100, 100, 1e18, 0.0), (0, 100, 50, 2.0)],
)
def test_prefill_model(cached: int, n: int, ctx: float, expect: float) -> None:
    calib = dataclasses.replace(EXACT, prefill_ctx_tokens=ctx)
    assert calib.prefill_s(cached, n) == pytest.approx(expect)


def test_cli_runs_and_prints_every_row() -> None:
    out = CliRunner().invoke(sim, ["run", "--servers", "2", "--sessions-per-server", "4", "--load", "6"])
    assert out.exit_code == 0, out.output
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 8  # cache-aware, proxy-cost, and each baseline with and without the tree
    bad = CliRunner().invoke(sim, ["run", "--policies", "random"])
    assert bad.exit_code != 0 and "unknown policy" in bad.output
    assert table([]).count("\n") == 1


def test_fit_prefill_recovers_the_model() -> None:
    truth = Calibration(prefill_tok_s=250.0, prefill_ctx_tokens=4000.0)
    a, b = (Sample(n, truth.prefill_s(0, n), 64, 2.0) for n in (400, 2000))
    rate, ctx = fit_prefill(a, b)
    assert rate == pytest.approx(250.0) and ctx == pytest.approx(4000.0)
    rate, ctx = fit_prefill(Sample(100, 1.0, 1, 1.0), Sample(200, 1.5, 1, 1.0))  # faster per token: flat
    assert rate == pytest.approx(300 / 2.5) and ctx == 1e18


def test_proxies_each_own_their_servers_and_tree() -> None:
    """Two proxies of one server each: a session stays behind one proxy (its balancer key),
    so turn 2 finds turn 1 in the same slot; one proxy of two servers round-robins it away
    and restores it from the shared tree instead."""
    split = SimConfig(servers=2, slots=1, proxies=2, policy="round-robin", calib=EXACT)
    first, second = Simulator(split).run([two_turn_session()]).served
    assert first.server == second.server and (second.route, second.cached, second.restored) == (
        Route.A,
        209,
        0,
    )
    shared = dataclasses.replace(split, proxies=1)
    assert Simulator(shared).run([two_turn_session()]).served[1].restored == 209
    result = Simulator(dataclasses.replace(split, servers=8, slots=4, proxies=4, workload=SMALL)).run()
    groups: dict[int, set[int]] = {}
    for s in result.served:
        groups.setdefault(s.session_id, set()).add(s.server % 4)
    assert all(len(g) == 1 for g in groups.values())
    with pytest.raises(ValueError, match="proxies"):
        Simulator(dataclasses.replace(split, proxies=3))


def test_resident_sharing_attaches_and_keeps_the_index_valid() -> None:
    sim_ = Simulator(SimConfig(servers=2, share=True, workload=SMALL))
    result = sim_.run()
    routes = Counter(s.route for s in result.served)
    assert routes[Route.S] + routes[Route.SH] > 0, routes
    for server in sim_.servers:
        assert server.residents is not None
        server.residents.check_invariants()
        assert sum(e.n for e in server.residents.entries.values()) <= sim_.cfg.share_cells
    for tree in sim_.trees:
        assert tree is not None
        tree.check_invariants()


def test_calibrate_without_a_server_is_a_clear_error_not_a_traceback() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = CliRunner().invoke(sim, ["calibrate", "--url", f"http://127.0.0.1:{port}"])
    assert result.exit_code == 1
    assert "did not answer" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
