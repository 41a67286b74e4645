"""The limit of every benchmark: minimum prefill over arrival order, the oracle time, the
report's section, and the multi-round workload."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.bench import limit as lim
from proxy.bench.report import build_report, write_report
from proxy.bench.workloads import DEFAULT_ARMS, make_workload
from proxy.traffic.runner import RequestResult

pytestmark = pytest.mark.unit


# ---- minimum prefill over arrival order ----------------------------------------------------------


@pytest.mark.parametrize(
    ("prompts", "new", "minimum"),
    [
        ([], [], []),
        ([[1, 2, 3]], [3], [3]),
        ([[]], [0], [1]),  # an empty prompt still computes one token
        ([[1, 2, 3], [1, 2, 3]], [3, 0], [3, 1]),  # the same prompt again: one token for the logits
        ([[1, 2], [1, 2, 3, 4]], [2, 2], [2, 2]),  # an extension computes its tail only
        ([[1, 2, 3, 4], [1, 2]], [4, 0], [4, 1]),  # a prefix of an earlier prompt: the order matters
        ([[1, 2, 3], [1, 2, 4], [1, 5]], [3, 1, 1], [3, 1, 1]),  # siblings off a common trunk
        ([[1, 2, 3], [7, 8], [1, 2, 9]], [3, 2, 1], [3, 2, 1]),  # an earlier prompt, not the last one
        ([[1, 2, 3], [1, 2, 4], [1, 2, 3, 5]], [3, 1, 1], [3, 1, 1]),  # the longest of the matches
        ([[5, 1, 2], [1, 2]], [3, 2], [3, 2]),  # common tokens count only from the start
    ],
)
def test_new_tokens_and_min_prefill(prompts: list[list[int]], new: list[int], minimum: list[int]) -> None:
    assert lim.new_tokens(prompts) == new
    assert lim.min_prefill(prompts) == minimum


def _naive_new(prompts: list[list[int]]) -> list[int]:
    out = []
    for k, p in enumerate(prompts):
        best = 0
        for q in prompts[:k]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n)
        out.append(len(p) - best)
    return out


@given(st.lists(st.lists(st.integers(0, 3), max_size=8), max_size=10))
def test_new_tokens_agrees_with_the_pairwise_definition(prompts: list[list[int]]) -> None:
    assert lim.new_tokens(prompts) == _naive_new(prompts)


@given(st.lists(st.lists(st.integers(0, 3), max_size=8), max_size=10), st.randoms())
def test_without_the_floor_the_total_does_not_depend_on_the_order(prompts: list[list[int]], rnd: Any) -> None:
    shuffled = list(prompts)
    rnd.shuffle(shuffled)
    assert sum(lim.new_tokens(prompts)) == sum(lim.new_tokens(shuffled))


def test_workload_limit_sums_by_group_and_checks_lengths() -> None:
    out = lim.workload_limit(["a", "b", "c"], ["g1", "g2", "g1"], [[1, 2, 3], [1, 2, 4], [1, 2, 3]])
    assert out["min_prefill_tokens"] == 3 + 1 + 1
    assert out["prompt_tokens"] == 9
    assert out["min_prefill_by_group"] == {"g1": 4, "g2": 1}
    assert out["min_prefill_by_request"] == {"a": 3, "b": 1, "c": 1}
    with pytest.raises(ValueError):
        lim.workload_limit(["a"], ["g"], [])


# ---- time ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("windows", "total"),
    [
        ([], 0.0),
        ([(0.0, 1.0)], 1.0),
        ([(0.0, 1.0), (2.0, 3.5)], 2.5),  # disjoint
        ([(0.0, 2.0), (1.0, 3.0)], 3.0),  # overlapping
        ([(0.0, 4.0), (1.0, 2.0)], 4.0),  # nested
        ([(1.0, 2.0), (0.0, 1.0)], 2.0),  # touching, out of order
        ([(2.0, 1.0), (0.0, 0.0)], 0.0),  # reversed and empty count nothing
        ([(0.0, 1.0), (0.5, 1.5), (1.2, 2.0), (5.0, 6.0)], 3.0),
    ],
)
def test_union_s(windows: list[tuple[float, float]], total: float) -> None:
    assert lim.union_s(windows) == pytest.approx(total)


@pytest.mark.parametrize(
    ("min_tokens", "prefilled", "prefill_s", "decode_s", "oracle"),
    [
        (100, 100, 2.0, 3.0, 5.0),  # the arm prefilled the minimum: the oracle is its own time
        (100, 400, 8.0, 3.0, 5.0),  # four times the minimum at 50 tok/s: 2 s of it needed
        (0, 400, 8.0, 3.0, 3.0),
        (100, 0, 0.0, 3.0, None),  # no prefill measured: no rate
        (100, 50, 0.0, 3.0, None),
    ],
)
def test_oracle_s(
    min_tokens: int, prefilled: int, prefill_s: float, decode_s: float, oracle: float | None
) -> None:
    got = lim.oracle_s(min_tokens, prefilled, prefill_s, decode_s)
    assert got == (None if oracle is None else pytest.approx(oracle))


def result(
    rid: str,
    sent: float,
    ttft: float,
    e2e: float,
    prompt_n: int | None,
    prompt_ms: float | None,
    status: int = 200,
) -> RequestResult:
    return RequestResult(
        rid, "s", "g", "front", sent, status, ttft, e2e, prompt_n=prompt_n, prompt_ms=prompt_ms
    )


@pytest.mark.parametrize(
    ("results", "mins", "expect"),
    [
        # One after the other: 2 s + 1 s of prefill (300 tokens: 100 tok/s), 1 s + 2 s of decode,
        # 1 s in between with nothing outstanding, 0.5 s queued before the second prefill.
        (
            [result("a", 0.0, 2.0, 3.0, 200, 2000.0), result("b", 4.0, 1.5, 3.5, 100, 1000.0)],
            {"a": 200, "b": 50},
            {
                "prefilled_tokens": 300,
                "prefilled_vs_min": 300 / 250,
                "prefill_s": 3.0,
                "prefill_tokens_per_s": 100.0,
                "decode_s": 3.0,
                "busy_s": 6.5,
                "oracle_s": 5.5,
                "extra_prefill_s": 0.5,
                "other_s": 0.5,
            },
        ),
        # Two prompts prefilled together (one batch, 2 s for 400 tokens), then decoded together;
        # the second answer ends later. Decode while the other prefilled is prefill time.
        (
            [result("a", 0.0, 2.0, 3.0, 200, 2000.0), result("b", 0.0, 2.0, 4.0, 200, 2000.0)],
            {"a": 200, "b": 20},
            {
                "prefilled_tokens": 400,
                "prefill_s": 2.0,
                "prefill_tokens_per_s": 200.0,
                "decode_s": 2.0,
                "busy_s": 4.0,
                "oracle_s": 2.0 + 220 / 200,
                "other_s": 0.0,
            },
        ),
        # A request without the server's timings: counted, but no times and no ratios.
        (
            [result("a", 0.0, 2.0, 3.0, 200, 2000.0), result("b", 4.0, 1.5, 3.5, None, None)],
            {"a": 200, "b": 50},
            {"prefilled_tokens": 200, "complete": False, "prefilled_vs_min": None, "oracle_s": None},
        ),
        # A failed request: the sum misses it.
        (
            [result("a", 0.0, 2.0, 3.0, 200, 2000.0), result("b", 4.0, 1.5, 3.5, 10, 10.0, status=500)],
            {"a": 200, "b": 50},
            {"prefilled_tokens": 200, "complete": False, "busy_vs_oracle": None},
        ),
        # Usage but no prefill time (Anthropic's stream): tokens compared, no oracle.
        (
            [result("a", 0.0, 2.0, 3.0, 200, None)],
            {"a": 150},
            {"prefilled_tokens": 200, "complete": True, "prefilled_vs_min": 200 / 150, "oracle_s": None},
        ),
    ],
)
def test_arm_limit(results: list[RequestResult], mins: dict[str, int], expect: dict[str, Any]) -> None:
    got = lim.arm_limit(results, mins)
    assert got["min_prefill_tokens"] == sum(mins.values())
    for key, value in expect.items():
        assert got[key] == (value if value is None or isinstance(value, bool) else pytest.approx(value)), key
    if got["oracle_s"] is not None:  # busy = oracle + extra prefill + other
        assert got["busy_s"] == pytest.approx(got["oracle_s"] + got["extra_prefill_s"] + got["other_s"])


def test_chat_body_converts_anthropic_messages() -> None:
    body = {"system": "rules", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    chat = lim.chat_body("/v1/messages", body)
    assert chat["messages"][0] == {"role": "system", "content": "rules"}
    assert lim.chat_body("/v1/chat/completions", {"messages": []}) == {"messages": []}


# ---- the report ----------------------------------------------------------------------------------


def test_report_carries_the_limit_beside_the_arms(tmp_path: Path) -> None:
    wl_limit = lim.workload_limit(["a", "b"], ["round 1", "round 2"], [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6]])
    arms = {
        "legacy": {"results": [result("a", 0, 1, 2, 4, 400.0), result("b", 3, 1, 2, 6, 600.0)]},
        # The proxy computed the minimum, nothing else outstanding: its time is the oracle's.
        "proxy": {"results": [result("a", 0, 1, 2, 4, 1000.0), result("b", 3, 1, 2, 2, 1000.0)]},
    }
    for arm in arms.values():
        for r, group in zip(arm["results"], ("round 1", "round 2"), strict=True):
            r.group = group
    report = build_report({"name": "t", "params": {}}, arms, {}, wl_limit)
    assert report["limit"]["min_prefill_tokens"] == 6
    assert report["arms"]["legacy"]["limit"]["prefilled_vs_min"] == pytest.approx(10 / 6)
    assert report["arms"]["proxy"]["limit"]["prefilled_vs_min"] == pytest.approx(1.0)
    assert report["arms"]["proxy"]["limit"]["busy_vs_oracle"] == pytest.approx(1.0)
    assert "prompt_n" in report["arms"]["proxy"] and "wall_s" in report["arms"]["proxy"]  # kept
    write_report(report, tmp_path, charts=False)
    md = (tmp_path / "report.md").read_text()
    assert "| arm | prefilled | min | prefilled / min |" in md
    assert "| legacy | 10 | 6 | 1.67x |" in md
    assert "| round 2 | 2 |" in md  # the group table's min prefill column
    assert (
        json.loads((tmp_path / "report.json").read_text())["arms"]["legacy"]["limit"]["prefilled_tokens"]
        == 10
    )
    assert lim.render_limit({"arms": {}}) == []


# ---- the multi-round workload ---------------------------------------------------------------------


def test_multi_round_users_share_the_system_prompt_and_grow_their_history() -> None:
    wl = make_workload("multi-round", users=3, rounds=3, system_tokens=100, interval_ms=500, max_tokens=24)
    assert DEFAULT_ARMS["multi-round"] == ("legacy", "proxy")
    assert len(wl.requests) == 9 and wl.concurrency == 9  # open loop: nothing caps the requests in flight
    assert [r.id for r in wl.requests[:4]] == ["u0-r1", "u1-r1", "u2-r1", "u0-r2"]
    assert [r.delay_s for r in wl.requests] == [k * 0.5 for k in range(9)]
    assert all(r.after == () for r in wl.requests)
    systems = {r.body["messages"][0]["content"] for r in wl.requests}
    assert len(systems) == 1
    by_id = {r.id: r.body["messages"] for r in wl.requests}
    for user in range(3):
        for rnd in (2, 3):
            before, now = by_id[f"u{user}-r{rnd - 1}"], by_id[f"u{user}-r{rnd}"]
            assert now[: len(before)] == before  # the history extends the previous prompt
            assert [m["role"] for m in now[len(before) :]] == ["assistant", "user"]
    assert all(r.body["max_tokens"] == 24 for r in wl.requests)
    assert {r.group for r in wl.requests} == {"round 1", "round 2", "round 3"}
    with pytest.raises(ValueError):
        make_workload("multi-round", users=0)
