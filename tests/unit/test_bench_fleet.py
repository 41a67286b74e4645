"""The fleet bench (``radixctl bench cluster``): its workload, its arms and its report section.
The arms themselves run for real in tests/integration/test_bench_cluster.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from proxy.bench.arms import ARMS, ArmSettings
from proxy.bench.fleet import start_fleet_arm
from proxy.bench.fleetload import cluster
from proxy.bench.report_fleet import render_fleet
from proxy.bench.workloads import DEFAULT_ARMS, make_workload
from proxy.errors import ConfigError
from proxy.traffic.spec import BenchRequest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("sessions,rounds", [(1, 1), (1, 4), (3, 4), (5, 2)])
def test_each_session_is_a_chain_of_rounds_growing_by_one_turn(sessions: int, rounds: int) -> None:
    wl = cluster(sessions=sessions, rounds=rounds, prompt_tokens=200, system_tokens=50, think_ms=700)
    assert len(wl.requests) == sessions * rounds and wl.concurrency == sessions
    systems = {r.body["messages"][0]["content"] for r in wl.requests}
    assert len(systems) == 1  # one system prompt for everyone
    by_session: dict[str, list[BenchRequest]] = {}
    for r in wl.requests:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == sessions
    for reqs in by_session.values():
        prev: BenchRequest | None = None
        for rnd, r in enumerate(reqs, 1):
            msgs = r.body["messages"]
            assert len(msgs) == 1 + 2 * (rnd - 1) + 1
            assert "[document " in msgs[1]["content"]  # the document opens the session's history
            if prev is None:
                assert r.after == () and r.delay_s == 0
            else:
                assert r.after == (prev.id,) and r.delay_s == pytest.approx(0.7)
                assert msgs[:-2] == prev.body["messages"]  # the round before, then its answer
            prev = r
    docs = {r.body["messages"][1]["content"] for r in wl.requests}
    assert len(docs) == sessions  # a document of its own per session


def test_the_workload_is_a_pure_function_of_its_arguments() -> None:
    assert make_workload("cluster", sessions=2, rounds=2) == make_workload("cluster", sessions=2, rounds=2)
    assert make_workload("cluster", seed=1) != make_workload("cluster", seed=2)
    for bad in ({"sessions": 0}, {"rounds": 0}, {"think_ms": -1}):
        with pytest.raises(ValueError):
            cluster(**bad)


def test_fleet_arms_are_fleets_and_only_fleet_shared_has_the_store() -> None:
    assert DEFAULT_ARMS["cluster"] == ("legacy", "fleet", "fleet-shared")
    assert [n for n, a in ARMS.items() if a.fleet] == ["fleet", "fleet-shared"]
    assert [n for n, a in ARMS.items() if a.shared_tier] == ["fleet-shared"]
    assert all(ARMS[n].proxy and ARMS[n].variant == "patched" for n in ("fleet", "fleet-shared"))


def test_a_fleet_of_one_is_refused_before_anything_starts(tmp_path: Path) -> None:
    settings = ArmSettings(model=tmp_path / "m.gguf", log_dir=tmp_path / "logs", n_parallel=2, ctx_size=4096)
    with pytest.raises(ConfigError, match="fleet"), start_fleet_arm("fleet", settings, tmp_path / "bin"):
        pass
    assert not (tmp_path / "logs").exists()


def test_dry_run_writes_the_request_list_with_two_servers_by_default(tmp_path: Path) -> None:
    from proxy.cli.main import main

    res = CliRunner().invoke(
        main, ["bench", "cluster", "--dry-run", "--out", str(tmp_path), "--sessions", "2"]
    )
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in (tmp_path / "workload.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 4
    helped = CliRunner().invoke(main, ["bench", "cluster", "--help"]).output
    assert "--servers" in helped and "--think-ms" in helped and "fleet-shared" in helped


def _report(remote: dict[str, object] | None, store: dict[str, object] | None) -> dict[str, object]:
    per = [{"requests": 3, "by_route": {"H": 2, "prefill": 1}, "remote": remote}]
    return {
        "arms": {"fleet-shared": {"details": {"per_proxy": per, "store": store}}, "legacy": {"details": {}}}
    }


def test_the_report_shows_each_proxys_shared_tier_and_the_stores_size() -> None:
    remote = {
        "promotions": 2,
        "promoted_tokens": 1024,
        "writes": 5,
        "fallbacks": {"timeout": 1},
        "dropped": {},
    }
    md = "\n".join(render_fleet(_report(remote, {"keys": 7, "used_memory_bytes": 3 << 20})))
    assert "| fleet-shared #0 | 3 | H 2, prefill 1 | 2 | 1024 | 5 | timeout 1 | 0 |" in md
    assert "7 entries" in md and "3.0 MiB" in md
    md = "\n".join(render_fleet(_report(None, None)))
    assert "| fleet-shared #0 | 3 | H 2, prefill 1 | - | - | - | - | - |" in md and "Store" not in md
    assert render_fleet({"arms": {"legacy": {"details": {}}}}) == []
