"""radixctl bench: workload generators, manifests, the runner on a fake server, the report writer."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from click.testing import CliRunner

from proxy.bench import capacity as cap
from proxy.bench import report as report_mod
from proxy.bench import report_capacity
from proxy.bench.arms import legacy_cache_bytes, parse_arms
from proxy.bench.stats import percentile
from proxy.bench.workloads import make_workload, prompt_words
from proxy.errors import ConfigError
from proxy.traffic.runner import (
    ManifestEntry,
    RequestResult,
    base_url,
    read_anthropic_event,
    read_manifest,
    read_results,
    replay_manifest,
    run_workload,
    write_manifest,
    write_results,
)
from proxy.traffic.spec import BenchRequest, Workload
from proxy.traffic.text import approx_tokens, prose, seeded, word_prefix, words_for

pytestmark = pytest.mark.unit

SMALL: dict[str, dict[str, Any]] = {
    "prefix-tiers": {"prompt_tokens": 200, "rounds": 2, "prompts": 3},
    "host-dedup": {"prompt_tokens": 200, "prompts": 8, "rounds": 2},
    "restore": {"prompt_tokens": 200, "rounds": 2, "fillers": 4},
    "overhead": {"pairs": 6},
    "agents": {"system_tokens": 400, "sessions": 2},
    "capacity": {"prompt_tokens": 200},
    "fanout": {"trunk_tokens": 200, "rounds": 2},
    "coding-agent": {"system_tokens": 300, "sessions": 2},
}


def text_of(req: BenchRequest) -> str:
    return " ".join(prompt_words(req.body))


# ---- generators ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SMALL))
def test_generators_are_deterministic(name: str) -> None:
    a, b = make_workload(name, **SMALL[name]), make_workload(name, **SMALL[name])
    assert a == b
    assert a.requests and len({r.id for r in a.requests}) == len(a.requests)
    other = make_workload(name, **SMALL[name], seed=7)
    assert [r.body for r in other.requests] != [r.body for r in a.requests]


def test_prose_is_seeded_and_exact() -> None:
    assert prose(seeded(1, "x"), 50) == prose(seeded(1, "x"), 50)
    assert prose(seeded(1, "x"), 50) != prose(seeded(2, "x"), 50)
    for n in (1, 7, 100):
        assert len(prose(seeded(n), n).split()) == n


def test_prefix_tiers_fractions_and_sizes() -> None:
    wl = make_workload("prefix-tiers", prompt_tokens=1000, rounds=2, prompts=3)
    tiers = wl.params["tiers"]
    assert len(wl.requests) == 2 * len(tiers) * 3 and wl.concurrency == 3
    total = words_for(1000)
    by_wave: dict[tuple[int, int], list[BenchRequest]] = {}
    for r in wl.requests:
        assert len(prompt_words(r.body)) == total
        by_wave.setdefault((r.meta["round"], r.meta["tier"]), []).append(r)
    for (rnd, tier), wave in by_wave.items():
        shared = wave[0].meta["shared_words"]
        assert abs(shared / total - tier / 100) < 0.01
        for x, y in itertools.combinations(wave, 2):
            assert word_prefix(text_of(x), text_of(y)) == shared
        # The same tier shares the same prefix across rounds, and no more.
        if rnd == 2:
            first = by_wave[(1, tier)][0]
            assert word_prefix(text_of(first), text_of(wave[0])) == shared
    # Waves are sequential: every request of a wave waits for the whole previous wave.
    waves = list(by_wave.values())
    for prev, cur in itertools.pairwise(waves):
        assert all(set(r.after) == {p.id for p in prev} for r in cur)
    assert all(not r.after for r in waves[0])


def test_prefix_tiers_token_estimate_is_close() -> None:
    wl = make_workload("prefix-tiers", prompt_tokens=1000, rounds=1, prompts=1)
    for r in wl.requests:
        assert 850 <= approx_tokens(text_of(r)) <= 1150


def test_host_dedup_shares_the_first_half() -> None:
    wl = make_workload("host-dedup", prompt_tokens=2000, prompts=8, rounds=2)
    assert len(wl.requests) == 16 and wl.concurrency == 1
    total = words_for(2000)
    rounds: dict[int, list[BenchRequest]] = {}
    for r in wl.requests:
        rounds.setdefault(r.meta["round"], []).append(r)
    for reqs in rounds.values():
        assert len(reqs) == 8
        for x, y in itertools.combinations(reqs, 2):
            assert word_prefix(text_of(x), text_of(y)) == total // 2
    # Round 2 asks about the same documents: everything but the question is reusable.
    for a, b in zip(rounds[1], rounds[2], strict=True):
        assert a.body["messages"][0] == b.body["messages"][0]
        assert a.body["messages"][1] != b.body["messages"][1]
    assert all(r.after == (p.id,) for p, r in itertools.pairwise(wl.requests))


def test_restore_evicts_from_every_slot() -> None:
    wl = make_workload("restore", prompt_tokens=1500, rounds=2, fillers=4)
    assert len(wl.requests) == 2 * 6 and wl.concurrency == 4
    ids = {r.id: r for r in wl.requests}
    for rnd in (1, 2):
        first, again = ids[f"r{rnd}-first"], ids[f"r{rnd}-again"]
        fillers = [r for r in wl.requests if r.group == "fill" and r.meta["round"] == rnd]
        assert len(fillers) == 4 and all(f.after == (first.id,) for f in fillers)
        assert set(again.after) == {f.id for f in fillers}
        assert first.body["messages"][0] == again.body["messages"][0]
        assert first.body["messages"][1] != again.body["messages"][1]
        for f in fillers:
            assert word_prefix(text_of(f), text_of(first)) == 0
        assert 1300 <= approx_tokens(text_of(first)) <= 1700


def test_overhead_pairs_alternate_and_are_distinct() -> None:
    wl = make_workload("overhead", pairs=6)
    assert len(wl.requests) == 12 and wl.concurrency == 1
    assert [r.via for r in wl.requests[:4]] == ["front", "server", "server", "front"]
    assert len({text_of(r) for r in wl.requests}) == 12
    assert all(r.body["max_tokens"] == 1 for r in wl.requests)
    assert all(approx_tokens(text_of(r)) < 80 for r in wl.requests)
    for k in range(6):
        assert {r.via for r in wl.requests if r.meta["pair"] == k} == {"front", "server"}


def test_coding_agent_shares_system_and_tools_and_branches_sub_agents() -> None:
    wl = make_workload("coding-agent", system_tokens=1500, sessions=3)
    assert len(wl.requests) == 3 * 5 and {r.path for r in wl.requests} == {"/v1/messages"}
    assert len({orjson.dumps([r.body["system"], r.body["tools"]]) for r in wl.requests}) == 1
    assert 1000 <= approx_tokens(wl.requests[0].body["system"]) <= 2200
    by_id = {r.id: r for r in wl.requests}
    for s in range(3):
        turns = [by_id[f"s{s}-t{t}"] for t in range(1, 5)]
        for prev, cur in itertools.pairwise(turns):
            pm, cm = prev.body["messages"], cur.body["messages"]
            assert cm[: len(pm)] == pm and [m["role"] for m in cm[len(pm) :]] == ["assistant", "user"]
            use, result = cm[len(pm)]["content"][0], cm[len(pm) + 1]["content"][0]
            assert use["type"] == "tool_use" and result == {
                **result,
                "type": "tool_result",
                "tool_use_id": use["id"],
            }
            assert 150 <= approx_tokens(result["content"]) <= 900 and cur.after == (prev.id,)
        sub = by_id[f"s{s}-sub"]
        base = turns[2].body["messages"]
        assert sub.body["messages"][: len(base)] == base and sub.after == turns[2].after
    chat = make_workload("coding-agent", system_tokens=1500, sessions=3, api="chat")
    last = next(r for r in chat.requests if r.id == "s0-t4")
    assert last.path == "/v1/chat/completions"
    assert [m["role"] for m in last.body["messages"]] == ["system", "user", *["assistant", "tool"] * 3]
    assert last.body["messages"][0]["content"] == wl.requests[0].body["system"]
    with pytest.raises(ValueError, match="api"):
        make_workload("coding-agent", api="grpc")


def test_anthropic_stream_events_fill_the_result() -> None:
    result = RequestResult("r", "s", "g", "front", 0.0)
    start = {
        "type": "message_start",
        "message": {"usage": {"input_tokens": 12, "cache_read_input_tokens": 300}},
    }
    assert not read_anthropic_event(start, result, 0.0)
    assert (result.cache_n, result.prompt_n, result.ttft_s) == (300, 12, None)
    read_anthropic_event({"type": "content_block_start", "index": 0}, result, 0.0)
    assert result.ttft_s is None  # no content yet
    read_anthropic_event(
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}}, result, 0.0
    )
    assert result.ttft_s is not None and result.ttft_s > 0
    delta = {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 24}}
    read_anthropic_event(delta, result, 0.0)
    assert (result.finish_reason, result.predicted_n) == ("max_tokens", 24)
    assert read_anthropic_event({"type": "message_stop"}, result, 0.0)
    read_anthropic_event(
        {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}, result, 0.0
    )
    assert result.error == "busy"


def test_agents_sessions_share_system_prompts_and_extend_history() -> None:
    wl = make_workload("agents", system_tokens=1500, sessions=2)
    scenarios = wl.params["scenarios"]
    assert len(scenarios) == 3 and len(wl.requests) == 3 * 2 * 6
    systems: dict[str, set[str]] = {}
    for r in wl.requests:
        systems.setdefault(r.meta["scenario"], set()).add(r.body["messages"][0]["content"])
    assert all(len(s) == 1 for s in systems.values())  # one system prompt per scenario
    assert len({next(iter(s)) for s in systems.values()}) == 3
    for s in systems.values():
        assert 1000 <= approx_tokens(next(iter(s))) <= 2200
        assert "## Tools" in next(iter(s)) and "## Documents" in next(iter(s))
    by_session: dict[str, list[BenchRequest]] = {}
    for r in wl.requests:
        by_session.setdefault(r.session, []).append(r)
    turns = [rs for name, rs in by_session.items() if "-b" not in name]
    assert len(turns) == 6
    for rs in turns:
        for prev, cur in itertools.pairwise(rs):
            pm, cm = prev.body["messages"], cur.body["messages"]
            assert cm[: len(pm)] == pm and [m["role"] for m in cm[len(pm) :]] == ["assistant", "tool"]
            assert cur.after == (prev.id,)
        branches = [r for r in wl.requests if r.session.startswith(rs[0].session + "-b")]
        assert len(branches) == 2 and all(b.after == (rs[-1].id,) for b in branches)
        base = rs[-1].body["messages"]
        assert all(b.body["messages"][: len(base)] == base for b in branches)
        assert branches[0].body["messages"][-1] != branches[1].body["messages"][-1]
    for r in wl.requests:
        if r.meta["scenario"] == "incident":
            for m in r.body["messages"]:
                if m["role"] == "tool" and "proposal_id" in m["content"]:
                    result = json.loads(m["content"])
                    assert result["executed"] is False and result["status"] == "pending_review"


def test_capacity_wave_shares_half_and_asks_for_full_answers() -> None:
    wl = make_workload("capacity", prompt_tokens=400, prompts=4, shared_pct=50, max_tokens=16)
    assert len(wl.requests) == 4 and wl.concurrency == 4
    assert all(not r.after and r.delay_s == 0 for r in wl.requests)  # one concurrent wave
    assert all(r.body["ignore_eos"] is True and r.body["max_tokens"] == 16 for r in wl.requests)
    total = words_for(400)
    shared = wl.requests[0].meta["shared_words"]
    assert shared == round(total / 2)
    for r in wl.requests:
        assert len(prompt_words(r.body)) == total
        assert 340 <= approx_tokens(text_of(r)) <= 460
    for x, y in itertools.combinations(wl.requests, 2):
        assert word_prefix(text_of(x), text_of(y)) == shared
    none = make_workload("capacity", prompt_tokens=400, shared_pct=0)
    for x, y in itertools.combinations(none.requests, 2):
        assert word_prefix(text_of(x), text_of(y)) == 0
    with pytest.raises(ValueError):
        make_workload("capacity", shared_pct=120)


def test_fanout_branches_share_one_trunk_per_round() -> None:
    wl = make_workload("fanout", trunk_tokens=1000, branches=4, rounds=2)
    assert len(wl.requests) == 8 and wl.concurrency == 4
    rounds: dict[int, list[BenchRequest]] = {}
    for r in wl.requests:
        rounds.setdefault(r.meta["round"], []).append(r)
    for rnd, reqs in rounds.items():
        assert [r.meta["branch"] for r in reqs] == [0, 1, 2, 3]
        assert len({r.body["messages"][0]["content"] for r in reqs}) == 1  # one trunk
        assert len({r.body["messages"][1]["content"] for r in reqs}) == 4  # a question per branch
        assert 850 <= approx_tokens(reqs[0].body["messages"][0]["content"]) <= 1150
        expected_after = () if rnd == 1 else tuple(r.id for r in rounds[rnd - 1])
        assert all(r.after == expected_after for r in reqs)
    # Every round starts cold for its trunk: nothing in common with the previous round's.
    assert word_prefix(text_of(rounds[1][0]), text_of(rounds[2][0])) == 0


def test_fanout_in_flight_queues_every_round_at_once() -> None:
    """The held-out shape of issue 28 item 6: groups sharing a prompt, all queued, N in flight."""
    plain = make_workload("fanout", trunk_tokens=300, branches=4, rounds=3)
    queued = make_workload("fanout", trunk_tokens=300, branches=4, rounds=3, in_flight=2)
    assert [r.body for r in queued.requests] == [r.body for r in plain.requests]
    assert all(r.after == () for r in queued.requests) and queued.concurrency == 2
    assert queued.params["in_flight"] == 2 and plain.params["in_flight"] == 0
    with pytest.raises(ValueError, match="in_flight"):
        make_workload("fanout", in_flight=-1)


def test_workload_validates_dependencies() -> None:
    body = {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValueError):
        Workload(
            "w", "", (BenchRequest("a", "s", "g", body, ("b",)), BenchRequest("b", "s", "g", body)), 1, {}
        )
    with pytest.raises(ValueError):
        Workload("w", "", (BenchRequest("a", "s", "g", body), BenchRequest("a", "s", "g", body)), 1, {})
    with pytest.raises(ValueError):
        make_workload("nope")


def test_cli_dry_run_writes_the_request_list(tmp_path: Path) -> None:
    from proxy.cli.main import main

    out = tmp_path / "out"
    res = CliRunner().invoke(
        main,
        [
            "bench",
            "prefix-tiers",
            "--dry-run",
            "--out",
            str(out),
            "--prompt-tokens",
            "100",
            "--rounds",
            "1",
            "--prompts",
            "2",
        ],
    )
    assert res.exit_code == 0, res.output
    entries = read_manifest(out / "workload.jsonl")
    assert len(entries) == 10 and entries[0].body["max_tokens"] == 16
    assert parse_arms("legacy, proxy") == ["legacy", "proxy"]
    with pytest.raises(ConfigError):
        parse_arms("legacy,bogus")


# ---- manifest and runner ------------------------------------------------------------------


def test_manifest_round_trip(tmp_path: Path) -> None:
    entries = [
        ManifestEntry(
            0.5, "b", "s1", "g", "server", {"messages": [{"role": "user", "content": "é ✓"}], "stream": True}
        ),
        ManifestEntry(0.0, "a", "s0", "g", "front", {"messages": [], "cache_prompt": False}),
    ]
    path = tmp_path / "m.jsonl"
    write_manifest(path, entries)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["body"] for line in lines)
    assert read_manifest(path) == sorted(entries, key=lambda e: e.t)
    results = [
        RequestResult("a", "s", "g", "front", 0.1, 200, 0.2, 0.3, None, 5, 10, 3, 150.0, "H", {"pair": 1})
    ]
    write_results(tmp_path / "r.jsonl", results)
    assert read_results(tmp_path / "r.jsonl") == results
    assert base_url("http://h:1/v1/") == "http://h:1" and base_url("http://h:1") == "http://h:1"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _fake_server(seen: list[dict[str, Any]]) -> tuple[web.AppRunner, str]:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if body["messages"][-1]["content"] == "fail":
            return web.json_response({"error": {"message": "nope"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Radix-Route": "A"})
        await resp.prepare(request)
        await resp.write(_sse({"choices": [{"delta": {"role": "assistant", "content": None}}]}))
        await resp.write(_sse({"choices": [{"delta": {"content": "hi"}}]}))
        if body["messages"][-1]["content"] == "midfail":  # a failure after the stream started
            await resp.write(b'error: {"error": {"message": "Context size has been exceeded."}}\n\n')
            return resp
        await resp.write(
            _sse(
                {
                    "choices": [{"delta": {}, "finish_reason": "stop"}],
                    "timings": {"cache_n": 7, "prompt_n": 3, "predicted_n": 2},
                }
            )
        )
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_runner_streams_records_and_replays(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    runner, url = await _fake_server(seen)
    try:

        def req(rid: str, content: str, after: tuple[str, ...] = (), via: str = "front") -> BenchRequest:
            return BenchRequest(
                rid,
                "s",
                "g",
                {"messages": [{"role": "user", "content": content}]},
                after,
                via=via,
                meta={"pair": 0},
            )

        wl = Workload(
            "t",
            "",
            (
                req("a", "x"),
                req("b", "y", ("a",), "server"),
                req("c", "fail", ("a",)),
                req("d", "midfail", ("a",)),
            ),
            2,
            {},
        )
        manifest = tmp_path / "manifest.jsonl"
        results = await run_workload(
            wl, url + "/v1", url, overrides={"cache_prompt": False}, manifest=manifest
        )
        assert [r.id for r in results] == ["a", "b", "c", "d"]
        a, b, c, d = results
        assert a.ok and a.cache_n == 7 and a.prompt_n == 3 and a.predicted_n == 2 and a.route == "A"
        assert a.finish_reason == "stop"
        assert d.status == 200 and not d.ok and d.error == "Context size has been exceeded."
        assert a.ttft_s is not None and a.e2e_s is not None and a.ttft_s <= a.e2e_s
        assert b.via == "server" and b.sent_s >= a.sent_s
        assert not c.ok and c.status == 400 and "nope" in (c.error or "")
        assert len(seen) == 4 and all(
            body["stream"] is True and body["cache_prompt"] is False for body in seen
        )
        entries = read_manifest(manifest)
        assert [e.id for e in entries][0] == "a" and len(entries) == 4
        assert entries[0].body["cache_prompt"] is False
        replayed = await replay_manifest(entries, url, speed=100.0)
        assert [r.id for r in replayed] == [e.id for e in entries] and replayed[0].ok
    finally:
        await runner.cleanup()


# ---- report -------------------------------------------------------------------------------


def _results(
    ttfts: list[float],
    group: str = "g",
    via: str = "front",
    cache: int = 10,
    prompt_ms: list[float] | None = None,
) -> list[RequestResult]:
    return [
        RequestResult(
            f"{group}{i}",
            "s",
            group,
            via,
            float(i),
            200,
            t,
            t + 1.0,
            None,
            cache,
            100,
            4,
            prompt_ms[i] if prompt_ms else None,
            None,
            {"pair": i},
        )
        for i, t in enumerate(ttfts)
    ]


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 90) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)


def test_report_on_synthetic_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    legacy = _results([1.0, 2.0, 3.0], "a") + _results([4.0], "b")
    proxy = _results([0.5, 1.0, 1.5], "a", cache=90) + _results([2.0], "b")
    proxy.append(RequestResult("err", "s", "a", "front", 5.0, 500, None, 0.1, "HTTP 500"))
    rep = report_mod.build_report(
        {"name": "w", "description": "d", "params": {"x": 1}},
        {
            "legacy": {"results": legacy, "stats": {"host_cache_bytes": 3 * 2**20}},
            "proxy": {"results": proxy, "stats": {"host_cache_bytes": 2**20, "kv_cells_used": 900}},
        },
        {"threads": 2},
    )
    lp, pp = rep["arms"]["legacy"], rep["arms"]["proxy"]
    assert lp["requests"] == 4 and lp["errors"] == 0 and pp["errors"] == 1
    assert lp["ttft_p50_s"] == 2.5 and pp["ttft_p50_s"] == 1.25
    assert pp["ttft_p50_vs_legacy"] == pytest.approx(0.5) and lp["ttft_p50_vs_legacy"] == pytest.approx(1.0)
    assert pp["e2e_p50_s"] == pytest.approx(2.25)
    assert pp["cache_n"] == 3 * 90 + 10 and pp["prompt_n"] == 400 and pp["generated_tokens"] == 16
    assert lp["wall_s"] == pytest.approx(6.0) and lp["requests_per_s"] == pytest.approx(4 / 6)
    assert pp["host_cache_bytes"] == 2**20 and pp["kv_cells_used"] == 900 and lp["kv_cells_used"] is None
    assert set(pp["groups"]) == {"a", "b"} and pp["groups"]["b"]["ttft_p50_s"] == 2.0
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kw: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    paths = report_mod.write_report(rep, tmp_path)
    assert [p.name for p in paths] == ["report.json", "report.md"]
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["arms"]["proxy"]["ttft_p50_s"] == 1.25 and data["charts"] == []
    md = (tmp_path / "report.md").read_text()
    assert "| proxy | 5 | 1 | 1.250 |" in md and "0.50x" in md and "3.0 MiB" in md
    assert "matplotlib is not installed" in md and "by group" in md


def test_report_means_tails_and_rebuild(tmp_path: Path) -> None:
    """Means and p99s against Legacy (issue 45's targets read them), and `radixctl bench report`
    writes the same report again from the run's files."""
    from proxy.traffic.runner import write_results

    legacy = _results([1.0, 2.0, 3.0, 10.0], "a")
    proxy = _results([0.5, 1.0, 1.5, 2.0], "a", cache=90)
    arms: dict[str, dict[str, Any]] = {
        "legacy": {"results": legacy, "stats": {"host_cache_bytes": 7}},
        "proxy": {"results": proxy, "stats": {}},
    }
    rep = report_mod.build_report({"name": "w", "params": {}}, arms, {"threads": 2})
    lp, pp = rep["arms"]["legacy"], rep["arms"]["proxy"]
    assert lp["ttft_mean_s"] == pytest.approx(4.0) and pp["ttft_mean_s"] == pytest.approx(1.25)
    assert pp["ttft_mean_vs_legacy"] == pytest.approx(1.25 / 4.0)
    p99_proxy, p99_legacy = percentile([0.5, 1.0, 1.5, 2.0], 99), percentile([1.0, 2.0, 3.0, 10.0], 99)
    assert p99_proxy is not None and p99_legacy is not None
    assert pp["ttft_p99_vs_legacy"] == pytest.approx(p99_proxy / p99_legacy)
    assert "| proxy | 1.250 |" in report_mod.render_markdown(rep)
    report_mod.write_report(rep, tmp_path, charts=False)
    for name, arm in arms.items():
        write_results(tmp_path / f"results-{name}.jsonl", arm["results"])
    again = report_mod.rebuild_report(tmp_path)
    assert json.loads(json.dumps(again, default=str)) == json.loads((tmp_path / "report.json").read_text())
    (tmp_path / "results-proxy.jsonl").unlink()
    with pytest.raises(ConfigError, match="results-proxy.jsonl is missing"):
        report_mod.rebuild_report(tmp_path)


def test_report_pairs_overhead() -> None:
    front = _results([0.102, 0.205, 0.301], "front", "front", prompt_ms=[90.0, 200.0, 290.0])
    server = _results([0.100, 0.200, 0.300], "server", "server", prompt_ms=[89.0, 199.0, 290.0])
    rep = report_mod.build_report({"name": "overhead"}, {"proxy": {"results": front + server, "stats": {}}})
    over = rep["arms"]["proxy"]["overhead"]
    assert over["pairs"] == 3 and over["ttft_ms_p50"] == pytest.approx(2.0)
    # Residuals: front 12, 5, 11 ms; server 11, 1, 10 ms -> differences 1, 4, 1.
    assert over["residual_ms_p50"] == pytest.approx(1.0) and over["residual_ms_p90"] == pytest.approx(3.4)
    assert "Paired difference" in report_mod.render_markdown(rep)


def test_kvctl_report_renders(tmp_path: Path) -> None:
    op = {
        "total_ms_p50": 5.0,
        "server_ms_p50": 4.0,
        "loop_ms_p50": 1.5,
        "mb_s": 2000.0,
        "device_mb_s": 7689.0,
        "probe_ms": 12.0,
    }
    rep = {
        "workload": {"name": "kvctl"},
        "probe_idle_ms": 8.0,
        "kv": {"devices": ["CUDA0"], "backends": ["CUDA"], "on_host": False, "unknown": None},
        "learned": {"export_mb_s": 1500.0, "import_mb_s": 2500.0, "moves": 6},
        "sizes": [{"tokens": 512, "bytes": 11 * 2**20, "export": op, "import": op, "memcpy_mb_s": 9000.0}],
    }
    report_mod.write_report(rep, tmp_path, charts=False)
    md = (tmp_path / "report.md").read_text()
    assert "| 512 | export | 11.0 MiB | 5.0 | 4.0 | 1.5 | 2000 | 7689 | 9000 | 12.0 | 8.0 |" in md
    assert "KV on CUDA0, backend CUDA (device memory)" in md
    assert "export (device-to-host) 1500 MB/s, import (host-to-device) 2500 MB/s" in md


def test_kvctl_sizes_clamped_to_what_a_slot_holds() -> None:
    from proxy.bench.kvbench import clamp_sizes

    said: list[str] = []
    # A prompt must be shorter than the slot's context: 8192 in a slot of 8192 moves 8191.
    assert clamp_sizes((512, 2048, 8192), 8192, said.append) == (512, 2048, 8191)
    assert len(said) == 1 and "8192 tokens exceed" in said[0] and "8191" in said[0]
    assert clamp_sizes((512, 9000, 8192), 8192, said.append) == (512, 8191)
    assert clamp_sizes((512,), 8192, said.append) == (512,)


def test_legacy_cache_bytes_from_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(
        "srv  update:  - cache state: 1 prompts, 10.500 MiB (limits: 8192.000 MiB, 16384 tokens)\n"
        "srv  update:  - cache state: 3 prompts, 140.625 MiB (limits: 8192.000 MiB, 16384 tokens)\n"
    )
    assert legacy_cache_bytes(log) == round(140.625 * 2**20)
    log.write_text("nothing here\n")
    assert legacy_cache_bytes(log) is None
    assert legacy_cache_bytes(tmp_path / "missing.log") is None


# ---- capacity search ----------------------------------------------------------------------


def test_pool_grid() -> None:
    assert cap.pool_grid(435, 4, 64) == list(range(448, 1792 + 1, 64))
    assert cap.pool_grid(512, 4, 64)[0] == 512 and cap.pool_grid(512, 4, 64)[-1] == 2048
    assert cap.pool_grid(100, 1, 64) == [128]
    with pytest.raises(ValueError):
        cap.pool_grid(0)


@pytest.mark.parametrize("threshold", [448, 450, 1000, 1728, 1792])
def test_search_smallest_finds_the_threshold_in_log_steps(threshold: int) -> None:
    grid = cap.pool_grid(435, 4, 64)
    calls: list[int] = []

    def passes(c: int) -> bool:
        calls.append(c)
        return c >= threshold

    expected = min(g for g in grid if g >= threshold)
    assert cap.search_smallest(grid, passes) == expected
    assert calls[0] == grid[-1] and len(calls) <= 2 + len(grid).bit_length()
    assert len(set(calls)) == len(calls)


def test_search_smallest_none_when_the_top_fails() -> None:
    calls: list[int] = []

    def fails(c: int) -> bool:
        calls.append(c)
        return False

    assert cap.search_smallest([64, 128, 192], fails) is None
    assert calls == [192]
    assert cap.search_smallest([], lambda c: True) is None


def test_known_cells_needs_a_bracket_with_one_pool() -> None:
    seen = [(1088, 1280), (1408, 1536), (1792, 1792)]
    assert cap.known_cells(1408, seen) == 1536
    assert cap.known_cells(1472, seen) is None  # 1536 or 1792: not pinned down
    assert cap.known_cells(1472, [*seen, (1536, 1536)]) == 1536
    assert cap.known_cells(2000, seen) is None and cap.known_cells(64, seen) is None


def _padded_run(need_cells: int, serial_below: int = 0) -> tuple[list[int], Any]:
    """A fake arm: the pool is -c rounded up to 256; it serves the wave when the pool has
    ``need_cells``, one request at a time below ``serial_below`` cells."""
    started: list[int] = []

    def run(ctx: int) -> cap.Probe:
        cells = -(-ctx // 256) * 256
        started.append(cells)
        ok = cells >= need_cells
        return cap.Probe(
            ctx, cells, ok, "ok" if ok else "p0: context", together=1 if cells < serial_below else 4
        )

    return started, run


def test_pool_search_reuses_probes_of_the_same_pool() -> None:
    started, run = _padded_run(1700)
    search = cap.PoolSearch(run, min_together=3)
    out = search.search(cap.pool_grid(435, 4, 64))
    assert out["min_cells"] == 1792 and out["any_order"]["min_cells"] == 1792
    assert out["max_failed_cells"] == 1536 and out["failed_above_cells"] == []
    # The second search (any order) revisits the same -c values without starting anything.
    assert len(started) == out["started"] == len(out["probes"]) == len({p["ctx"] for p in out["probes"]})
    # A -c between two probes that got the same pool is not started again.
    started, run = _padded_run(1000)
    search = cap.PoolSearch(run)
    search.probe(1088)
    search.probe(1280)
    again = search.probe(1152)
    assert again.reused and again.cells == 1280 and again.ctx == 1152 and started == [1280, 1280]
    assert search.probe(1024).cells == 1024 and not search.probes[-1].reused


def test_pool_search_separates_served_together_from_any_order() -> None:
    # Serves at any pool of one request, but all at once only from 1280 cells on.
    _, run = _padded_run(435, serial_below=1280)
    out = cap.PoolSearch(run, min_together=3).search(cap.pool_grid(435, 4, 64))
    assert out["min_cells"] == 1280 and out["any_order"]["min_cells"] == 512
    assert out["any_order"]["failed_above_cells"] == []
    assert cap.PoolSearch(run, min_together=0).search(cap.pool_grid(435, 4, 64))["min_cells"] == 512


def _res(
    rid: str,
    status: int = 200,
    error: str | None = None,
    predicted: int | None = 16,
    sent: float = 0.0,
    ttft: float | None = 1.0,
    e2e: float | None = 2.0,
    prompt_ms: float | None = 900.0,
) -> RequestResult:
    return RequestResult(
        rid, "s", "wave", "front", sent, status, ttft, e2e, error, 0, 400, predicted, prompt_ms
    )


def test_pool_search_flags_a_failure_above_the_result() -> None:
    # Like the proxy with sharing on a small pool: fails at 1024 cells (tries all at once and runs
    # out), serves at 512 and 768 (one after the other) and from 1280 on (together).
    def run(ctx: int) -> cap.Probe:
        cells = -(-ctx // 256) * 256
        ok = cells != 1024
        return cap.Probe(ctx, cells, ok, "ok" if ok else "context", together=3 if cells >= 1024 else 1)

    out = cap.PoolSearch(run, min_together=3).search([512, 768, 1024, 1280, 1792])
    assert out["min_cells"] == 1280 and out["failed_above_cells"] == []
    assert out["any_order"]["min_cells"] == 512 and out["any_order"]["failed_above_cells"] == [1024]
    rep = cap.capacity_report({"name": "capacity"}, {}, {"grid": [512, 1792], "ideal": {}}, {"proxy-hs": out})
    assert "proxy-hs, any order: not monotone" in report_capacity.render_capacity_markdown(rep)


def test_probe_verdict() -> None:
    assert cap.probe_verdict([_res("a"), _res("b")], 16) == (True, "ok")
    ok, why = cap.probe_verdict([_res("a"), _res("b", error="Context size has been exceeded.")], 16)
    assert not ok and why.startswith("b: context")
    ok, why = cap.probe_verdict(
        [_res("a", 500, "HTTP 500: the request exceeds the available context size")], 16
    )
    assert not ok and "context" in why
    assert cap.probe_verdict([_res("a", 503, "HTTP 503: busy")], 16)[1].startswith("a: HTTP 503")
    assert cap.probe_verdict([_res("a", 0, "ClientError: reset")], 16)[1].startswith("a: HTTP 0")
    assert cap.probe_verdict([_res("a", predicted=9)], 16)[1].startswith("a: truncated: 9 of 16")
    assert cap.probe_verdict([_res("a", predicted=None)], 16)[0] is False
    assert cap.probe_verdict([], 16)[0] is False


def test_server_windows_and_peak_overlap() -> None:
    # Together: all four in the server from about 0.1 s to their ends.
    together = [
        _res(f"p{i}", sent=0.0, ttft=1.0 + i * 0.1, e2e=3.0 + i * 0.1, prompt_ms=900.0 + i * 100)
        for i in range(4)
    ]
    assert cap.peak_overlap(cap.server_windows(together)) == 4
    # One after the other: each starts (first token minus its prefill) after the previous ended.
    serial = [
        _res(f"p{i}", sent=0.0, ttft=2.0 * i + 1.5, e2e=2.0 * i + 2.0, prompt_ms=1500.0) for i in range(4)
    ]
    assert cap.peak_overlap(cap.server_windows(serial)) == 1
    assert cap.peak_overlap([(0.0, 1.0), (1.0, 2.0)]) == 1  # touching is not overlapping
    assert cap.peak_overlap([]) == 0
    assert cap.server_windows([_res("x", prompt_ms=None)]) == []


def test_ideal_cells_and_common_prefix() -> None:
    ideal = cap.ideal_cells([400] * 4, 200, 0)
    assert ideal["unshared_cells"] == 1600 and ideal["shared_cells"] == 1000
    assert ideal["saving_pct"] == pytest.approx(37.5)
    assert cap.ideal_cells([419, 416], 203, 16)["shared_cells"] == 203 + 216 + 213 + 32
    assert cap.common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert cap.common_prefix([[5, 6]]) == 2 and cap.common_prefix([]) == 0


def test_capacity_report_renders(tmp_path: Path) -> None:
    def arm(cells: int, any_cells: int) -> dict[str, Any]:
        probe = cap.Probe(cells - 64, cells, True, "ok", together=3, routes={"S": 2, "prefill": 1}).to_json()
        return {
            "min_ctx": cells - 64,
            "min_cells": cells,
            "max_failed_cells": cells - 256,
            "any_order": {"min_ctx": any_cells, "min_cells": any_cells, "max_failed_cells": None},
            "probes": [probe],
            "started": 1,
        }

    rep = cap.capacity_report(
        {"name": "capacity", "params": {"prompts": 4}, "requests": 4},
        {"threads": 1},
        {
            "step": 64,
            "lower": 435,
            "grid": [448, 1792],
            "prompt_tokens": [419, 416],
            "shared_tokens": 203,
            "ideal": cap.ideal_cells([419, 416], 203, 16),
            "min_together": 3,
            "host_cache": "off",
        },
        {"legacy": arm(2048, 2048), "proxy-hs": arm(1280, 512)},
    )
    arms = rep["capacity"]
    assert arms["legacy"]["saving_vs_legacy_pct"] == pytest.approx(0.0)
    assert arms["proxy-hs"]["saving_vs_legacy_pct"] == pytest.approx(37.5)
    assert arms["proxy-hs"]["any_order"]["saving_vs_legacy_pct"] == pytest.approx(75.0)
    paths = report_mod.write_report(rep, tmp_path)
    assert [p.name for p in paths] == ["report.json", "report.md"]  # no charts for a capacity report
    assert json.loads((tmp_path / "report.json").read_text())["capacity"]["proxy-hs"]["min_cells"] == 1280
    md = (tmp_path / "report.md").read_text()
    assert "| proxy-hs | 1280 | 1216 | 1024 | 37.5 % | 512 | 75.0 % | 1 | 1 |" in md
    assert "S 2, prefill 1" in md


# ---- fan-out report -----------------------------------------------------------------------


def _branches(ttfts: list[float], rnd: int = 1, total: float = 10.0) -> list[RequestResult]:
    return [
        RequestResult(
            f"r{rnd}-b{b}",
            f"b{b}",
            f"branch {b}",
            "front",
            0.0,
            200,
            t,
            total - b * 0.1,
            None,
            0,
            1000,
            16,
            None,
            None,
            {"round": rnd, "branch": b},
        )
        for b, t in enumerate(ttfts)
    ]


def test_fanout_figures_and_ratio_to_legacy() -> None:
    legacy = _branches([9.5, 46.5, 21.3, 32.2], total=48.0)
    hs = _branches([10.0, 11.0, 10.5, 11.5], total=13.0)
    hs.append(
        RequestResult(
            "r1-b4",
            "b4",
            "branch 4",
            "front",
            0.0,
            500,
            None,
            0.1,
            "HTTP 500",
            meta={"round": 1, "branch": 4},
        )
    )
    rep = report_mod.build_report(
        {"name": "fanout"},
        {"legacy": {"results": legacy, "stats": {}}, "proxy-hs": {"results": hs, "stats": {}}},
    )
    lf, hf = rep["arms"]["legacy"]["fanout"], rep["arms"]["proxy-hs"]["fanout"]
    assert lf["ttft_sorted_s"] == [9.5, 21.3, 32.2, 46.5] and lf["last_ttft_s"] == 46.5
    assert lf["total_s"] == pytest.approx(48.0) and lf["last_ttft_vs_legacy"] == pytest.approx(1.0)
    assert hf["errors"] == 1 and hf["ttft_sorted_s"] == [10.0, 10.5, 11.0, 11.5]
    assert hf["last_ttft_vs_legacy"] == pytest.approx(11.5 / 46.5)
    assert hf["total_vs_legacy"] == pytest.approx(13.0 / 48.0)
    assert hf["ttft_sorted_vs_legacy"][0] == pytest.approx(10.0 / 9.5)
    assert hf["rounds"][0]["ttft_by_branch_s"]["1"] == 11.0
    md = report_mod.render_markdown(rep)
    assert "Fan-out" in md and "| proxy-hs | 10.00 / 10.50 / 11.00 / 11.50 | 11.500 | 13.000 | 1 |" in md
    # Several rounds: medians per rank.
    two = _branches([1.0, 2.0], 1, 3.0) + _branches([3.0, 6.0], 2, 7.0)
    fan = report_mod.fanout_figures(two)
    assert fan is not None and fan["ttft_sorted_s"] == [2.0, 4.0] and fan["total_s"] == pytest.approx(5.0)
    assert report_mod.fanout_figures(_results([1.0])) is None


def test_report_prints_the_host_cache_optimum() -> None:
    arms = {
        "legacy": {"results": _results([1.0]), "stats": {"host_cache_bytes": 3 << 20}},
        "proxy": {
            "results": _results([0.5]),
            "stats": {"host_cache_bytes": 2 << 20, "host_optimum_bytes": 2 << 20},
        },
    }
    text = report_mod.render_markdown(report_mod.build_report({"name": "host-dedup"}, arms))
    assert "Host cache optimum seen by `proxy`" in text and "2.0 MiB" in text


def test_soak_summary_windows_warm_up_and_rss() -> None:
    from proxy.bench.soak import summarize
    from proxy.traffic.runner import RequestResult

    def result(t: float, ttft: float, cache_n: int = 0, status: int = 200) -> RequestResult:
        return RequestResult(
            id=f"r{t}",
            session="s",
            group="g",
            via="front",
            sent_s=t,
            status=status,
            ttft_s=ttft,
            cache_n=cache_n,
        )

    results = [
        result(1, 0.5, 0),
        result(2, 0.1, 90),
        result(11, 2.0, 0),
        result(12, 0.0, 0, status=502),
        result(14, 0.2, 80),
        result(25, 0.3, 70),
    ]
    report = summarize(results, kills=[10.0, 20.0], rss=[(0, 102400), (30, 104448)], duration_s=30)
    assert (report["requests"], report["answered"], report["failed"]) == (6, 5, 1)
    assert [w["answered"] for w in report["windows"]] == [2, 2, 1]
    assert report["windows"][1]["ttft_p50_s"] in (0.2, 2.0) and report["windows"][1]["ttft_p99_s"] == 2.0
    assert report["seconds_to_first_cache_hit_after_kill"] == [4.0, 5.0]
    assert report["rss_mib"] == {"first": 100.0, "last": 102.0, "max": 102.0}
    assert report["failures"] == ["502"]
    assert report["rss_anon_mib"]["first"] is None
    # With the arena: the tree in shared memory mapped whole (RssShmem), the heap (RssAnon) apart.
    parts = [(0.0, 40960, 61440), (30.0, 43008, 61440)]
    report = summarize(results, [10.0, 20.0], [(0, 102400), (30, 104448)], 30, None, parts)
    assert report["rss_anon_mib"] == {"first": 40.0, "last": 42.0, "max": 42.0}
    assert report["rss_shmem_mib"] == {"first": 60.0, "last": 60.0, "max": 60.0}
