"""`radixctl bench cluster` for real, at a tiny size: two proxies with a patched server each
behind the round-robin balancer, without (``fleet``) and with (``fleet-shared``) a shared tier
on a local valkey-server (or redis-server) that the bench starts itself.

One session of three rounds alternates between the two proxies (round robin, one client):
round 2 reaches the proxy that did not compute round 1. With the shared tier it restores the
document from the store (the think time lets the other proxy's write land first); without it
that proxy prefills the whole prompt again. So the shared fleet prefills fewer tokens, and the
report shows where they came from."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from proxy.native.store import store_binary
from tests.helpers import ServerFactory

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(store_binary() is None, reason="no valkey-server or redis-server (make valkey)"),
]


def test_a_session_moving_between_proxies_restores_from_the_shared_tier(
    tmp_path: Path, patched_bin: Path
) -> None:
    from proxy.cli.main import main

    out = tmp_path / "cluster"
    cpus = os.sched_getaffinity(0)
    args = ["bench", "cluster", "--arms", "fleet,fleet-shared", "--out", str(out), "-t", "1", "-np", "2"]
    # The servers on one CPU, the proxies, balancer and store on the others (2 cores or more).
    args += ["--server-cpus", str(min(cpus))] if len(cpus) > 1 else []
    args += ["-c", "4096", "--sessions", "1", "--rounds", "3", "--prompt-tokens", "1200"]
    args += ["--system-tokens", "60", "--question-tokens", "12", "--max-tokens", "4", "--think-ms", "1500"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert os.sched_getaffinity(0) == cpus  # given back after the arms
    report = json.loads((out / "report.json").read_text())
    arms = report["arms"]
    assert report["settings"]["servers"] == 2
    assert report["settings"].get("server_cpus") == (str(min(cpus)) if len(cpus) > 1 else None)
    for name in ("fleet", "fleet-shared"):
        assert arms[name]["errors"] == 0 and arms[name]["requests"] == 3, name
        per = arms[name]["details"]["per_proxy"]
        assert sorted(p["requests"] for p in per) == [1, 2], name  # round robin: rounds 1 and 3, round 2
        assert arms[name]["limit"]["complete"], name
    assert all(p["remote"] is None for p in arms["fleet"]["details"]["per_proxy"])
    remote = [p["remote"] for p in arms["fleet-shared"]["details"]["per_proxy"]]
    assert sum(r["writes"] for r in remote) > 0
    assert sum(r["promotions"] for r in remote) >= 1 and sum(r["promoted_tokens"] for r in remote) >= 512
    assert arms["fleet-shared"]["details"]["store"]["keys"] > 0
    # The document came from the store instead of being computed again.
    assert arms["fleet-shared"]["prompt_n"] < arms["fleet"]["prompt_n"]
    assert "H" in arms["fleet-shared"]["routes"]
    md = (out / "report.md").read_text()
    assert "Fleet arms, per proxy" in md and "| fleet-shared #1 |" in md and "Store of `fleet-shared`" in md


def test_a_server_given_cpus_runs_on_those_only(start_server: ServerFactory, patched_bin: Path) -> None:
    """--server-cpus: the server and every thread it starts run on the CPUs given (ServerSpec.cpus)."""
    cpu = min(os.sched_getaffinity(0))
    server = start_server(patched_bin, kvctl=False, cpus=(cpu,))
    try:
        assert server.proc is not None
        threads = os.listdir(f"/proc/{server.proc.pid}/task")
        assert len(threads) > 1
        assert all(os.sched_getaffinity(int(t)) == {cpu} for t in threads)
    finally:
        server.stop()
