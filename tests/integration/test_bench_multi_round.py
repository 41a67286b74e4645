"""`radixctl bench multi-round` for real, at a tiny size: stock llama-server (legacy) and the
proxy in front of the patched one, started by the bench itself; the report reads both arms
against the workload's limit, computed on the server's own tokenization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from proxy.traffic.runner import read_results

pytestmark = pytest.mark.integration


def test_tiny_multi_round_reports_each_arm_against_the_limit(
    tmp_path: Path, patched_bin: Path, stock_bin: Path
) -> None:
    from proxy.cli.main import main

    out = tmp_path / "mr"
    args = ["bench", "multi-round", "--arms", "legacy,proxy", "--out", str(out), "-t", "1", "-np", "2"]
    args += ["-c", "4096", "--users", "3", "--rounds", "2", "--system-tokens", "120"]
    args += ["--question-tokens", "16", "--max-tokens", "4", "--interval-ms", "300"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    limit = report["limit"]
    assert limit["requests"] == 6
    # Every user shares the system prompt and round 2 extends round 1: a cache saves tokens.
    assert 0 < limit["min_prefill_tokens"] < limit["prompt_tokens"]
    assert set(limit["min_prefill_by_group"]) == {"round 1", "round 2"}
    for name in ("legacy", "proxy"):
        arm = report["arms"][name]
        assert arm["errors"] == 0, name
        got = arm["limit"]
        assert got["complete"], name
        assert got["min_prefill_tokens"] == limit["min_prefill_tokens"]
        assert limit["min_prefill_tokens"] <= got["prefilled_tokens"] == arm["prompt_n"], name
        assert got["prefilled_vs_min"] >= 1.0
        for key in ("prefill_s", "prefill_tokens_per_s", "decode_s", "busy_s", "oracle_s", "busy_vs_oracle"):
            assert got[key] is not None and got[key] > 0, (name, key)
        assert got["oracle_s"] <= got["busy_s"], name
        # The tokenization is the server's: each prompt is what the server reused plus computed.
        for r in read_results(out / f"results-{name}.jsonl"):
            assert r.cache_n is not None and r.prompt_n is not None
            assert r.cache_n + r.prompt_n == limit["prompt_tokens_by_request"][r.id], (name, r.id)
    md = (out / "report.md").read_text()
    assert "Against the limit" in md and "| proxy |" in md


def test_a_draft_model_through_server_args_reports_each_arm_s_acceptance(
    tmp_path: Path, patched_bin: Path, stock_bin: Path, model_path: Path
) -> None:
    """--server-arg reaches every arm's servers: with the model as its own draft, both arms
    speculate, and the report gives each one's drafted and accepted tokens. The proxy's
    restored slots keep the draft's KV in step (patch 0021), so its acceptance is stock's."""
    from proxy.cli.main import main

    out = tmp_path / "mr-draft"
    args = ["bench", "multi-round", "--arms", "legacy,proxy", "--out", str(out), "-t", "1", "-np", "2"]
    args += ["-c", "4096", "--users", "2", "--rounds", "2", "--system-tokens", "120"]
    args += ["--question-tokens", "16", "--max-tokens", "16", "--interval-ms", "300"]
    for arg in ("--model-draft", str(model_path), "--spec-type", "draft-simple", "--spec-draft-n-max", "4"):
        args.append(f"--server-arg={arg}")
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    rates = {}
    for name in ("legacy", "proxy"):
        arm = report["arms"][name]
        assert arm["errors"] == 0, name
        assert arm["draft_n"] > 0 and arm["draft_n_accepted"] is not None, (name, arm)
        rates[name] = arm["draft_n_accepted"] / arm["draft_n"]
    # The draft is the model itself: nearly every draft is accepted, through the proxy as on stock.
    assert rates["legacy"] > 0.5 and rates["proxy"] >= 0.8 * rates["legacy"], rates
    md = (out / "report.md").read_text()
    assert "Speculative decoding" in md and "acceptance" in md
