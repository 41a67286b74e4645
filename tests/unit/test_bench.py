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

from proxy.bench import report as report_mod
from proxy.bench.arms import legacy_cache_bytes, parse_arms
from proxy.bench.runner import (
    ManifestEntry,
    RequestResult,
    base_url,
    read_manifest,
    read_results,
    replay_manifest,
    run_workload,
    write_manifest,
    write_results,
)
from proxy.bench.text import approx_tokens, prose, seeded, word_prefix, words_for
from proxy.bench.workloads import BenchRequest, Workload, make_workload, prompt_words
from proxy.errors import ConfigError

pytestmark = pytest.mark.unit

SMALL: dict[str, dict[str, Any]] = {
    "prefix-tiers": {"prompt_tokens": 200, "rounds": 2, "prompts": 3},
    "host-dedup": {"prompt_tokens": 200, "prompts": 8, "rounds": 2},
    "restore": {"prompt_tokens": 200, "rounds": 2, "fillers": 4},
    "overhead": {"pairs": 6},
    "agents": {"system_tokens": 400, "sessions": 2},
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
            assert cm[: len(pm)] == pm and [m["role"] for m in cm[len(pm):]] == ["assistant", "tool"]
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


def test_workload_validates_dependencies() -> None:
    body = {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValueError):
        Workload("w", "", (BenchRequest("a", "s", "g", body, ("b",)), BenchRequest("b", "s", "g", body)), 1, {})
    with pytest.raises(ValueError):
        Workload("w", "", (BenchRequest("a", "s", "g", body), BenchRequest("a", "s", "g", body)), 1, {})
    with pytest.raises(ValueError):
        make_workload("nope")


def test_cli_dry_run_writes_the_request_list(tmp_path: Path) -> None:
    from proxy.cli import main

    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["bench", "prefix-tiers", "--dry-run", "--out", str(out), "--prompt-tokens", "100",
                                    "--rounds", "1", "--prompts", "2"])
    assert res.exit_code == 0, res.output
    entries = read_manifest(out / "workload.jsonl")
    assert len(entries) == 10 and entries[0].body["max_tokens"] == 16
    assert parse_arms("legacy, proxy") == ["legacy", "proxy"]
    with pytest.raises(ConfigError):
        parse_arms("legacy,bogus")


# ---- manifest and runner ------------------------------------------------------------------


def test_manifest_round_trip(tmp_path: Path) -> None:
    entries = [ManifestEntry(0.5, "b", "s1", "g", "server", {"messages": [{"role": "user", "content": "é ✓"}],
                                                                "stream": True}),
               ManifestEntry(0.0, "a", "s0", "g", "front", {"messages": [], "cache_prompt": False})]
    path = tmp_path / "m.jsonl"
    write_manifest(path, entries)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["body"] for line in lines)
    assert read_manifest(path) == sorted(entries, key=lambda e: e.t)
    results = [RequestResult("a", "s", "g", "front", 0.1, 200, 0.2, 0.3, None, 5, 10, 3, 150.0, "H", {"pair": 1})]
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
        await resp.write(_sse({"choices": [{"delta": {}, "finish_reason": "stop"}],
                               "timings": {"cache_n": 7, "prompt_n": 3, "predicted_n": 2}}))
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
            return BenchRequest(rid, "s", "g", {"messages": [{"role": "user", "content": content}]}, after, via=via,
                                meta={"pair": 0})

        wl = Workload("t", "", (req("a", "x"), req("b", "y", ("a",), "server"), req("c", "fail", ("a",))), 2, {})
        manifest = tmp_path / "manifest.jsonl"
        results = await run_workload(wl, url + "/v1", url, overrides={"cache_prompt": False}, manifest=manifest)
        assert [r.id for r in results] == ["a", "b", "c"]
        a, b, c = results
        assert a.ok and a.cache_n == 7 and a.prompt_n == 3 and a.predicted_n == 2 and a.route == "A"
        assert a.ttft_s is not None and a.e2e_s is not None and a.ttft_s <= a.e2e_s
        assert b.via == "server" and b.sent_s >= a.sent_s
        assert not c.ok and c.status == 400 and "nope" in (c.error or "")
        assert len(seen) == 3 and all(body["stream"] is True and body["cache_prompt"] is False for body in seen)
        entries = read_manifest(manifest)
        assert [e.id for e in entries][0] == "a" and len(entries) == 3
        assert entries[0].body["cache_prompt"] is False
        replayed = await replay_manifest(entries, url, speed=100.0)
        assert [r.id for r in replayed] == [e.id for e in entries] and replayed[0].ok
    finally:
        await runner.cleanup()


# ---- report -------------------------------------------------------------------------------


def _results(ttfts: list[float], group: str = "g", via: str = "front", cache: int = 10,
             prompt_ms: list[float] | None = None) -> list[RequestResult]:
    return [RequestResult(f"{group}{i}", "s", group, via, float(i), 200, t, t + 1.0, None, cache, 100, 4,
                          prompt_ms[i] if prompt_ms else None, None, {"pair": i}) for i, t in enumerate(ttfts)]


def test_percentile() -> None:
    assert report_mod.percentile([], 50) is None
    assert report_mod.percentile([3.0], 90) == 3.0
    assert report_mod.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert report_mod.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)


def test_report_on_synthetic_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    legacy = _results([1.0, 2.0, 3.0], "a") + _results([4.0], "b")
    proxy = _results([0.5, 1.0, 1.5], "a", cache=90) + _results([2.0], "b")
    proxy.append(RequestResult("err", "s", "a", "front", 5.0, 500, None, 0.1, "HTTP 500"))
    rep = report_mod.build_report({"name": "w", "description": "d", "params": {"x": 1}},
                                  {"legacy": {"results": legacy, "stats": {"host_cache_bytes": 3 * 2**20}},
                                   "proxy": {"results": proxy, "stats": {"host_cache_bytes": 2**20,
                                                                         "kv_cells_used": 900}}},
                                  {"threads": 2})
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
    op = {"total_ms_p50": 5.0, "server_ms_p50": 4.0, "mb_s": 2000.0, "probe_ms": 12.0}
    rep = {"workload": {"name": "kvctl"}, "probe_idle_ms": 8.0,
           "sizes": [{"tokens": 512, "bytes": 11 * 2**20, "export": op, "import": op, "memcpy_mb_s": 9000.0}]}
    report_mod.write_report(rep, tmp_path, charts=False)
    md = (tmp_path / "report.md").read_text()
    assert "| 512 | export | 11.0 MiB | 5.0 | 4.0 | 2000 | 9000 | 12.0 | 8.0 |" in md


def test_legacy_cache_bytes_from_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("srv  update:  - cache state: 1 prompts, 10.500 MiB (limits: 8192.000 MiB, 16384 tokens)\n"
                   "srv  update:  - cache state: 3 prompts, 140.625 MiB (limits: 8192.000 MiB, 16384 tokens)\n")
    assert legacy_cache_bytes(log) == round(140.625 * 2**20)
    log.write_text("nothing here\n")
    assert legacy_cache_bytes(log) is None
    assert legacy_cache_bytes(tmp_path / "missing.log") is None
