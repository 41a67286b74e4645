"""`radixctl bench vision` for real, at a tiny size: stock llama-server (legacy) and the proxy in
front of the patched one, every server with the tiny projector; the limit keys each image as the
server does (tokenized on the patched server), and both arms are read against it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from proxy.traffic.runner import read_results
from tests.tinymmproj import N_IMAGE_TOKENS

pytestmark = pytest.mark.integration


def test_tiny_vision_reports_each_arm_against_the_limit_of_its_images(
    tmp_path: Path, patched_bin: Path, stock_bin: Path
) -> None:
    from proxy.cli.main import main

    out = tmp_path / "vision"
    args = ["bench", "vision", "--arms", "legacy,proxy", "--out", str(out), "-t", "1", "-np", "2"]
    args += ["-c", "4096", "--users", "3", "--rounds", "2", "--system-tokens", "120", "--mmproj", "tiny"]
    args += ["--question-tokens", "16", "--max-tokens", "4", "--image-px", "32", "--think-ms", "300"]
    args += ["--own-images", "2"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    limit = report["limit"]
    assert limit["requests"] == 6
    # The shared photo after the same instructions is computed once: a later session's first
    # round computes its own two photos (16 cells each: not keyed like anyone else's) and its
    # question; the first session's also the instructions and the shared photo.
    assert 0 < limit["min_prefill_tokens"] < limit["prompt_tokens"]
    firsts = [limit["min_prefill_by_request"][f"s{u}-r1"] for u in range(3)]
    for u in (1, 2):
        assert 2 * N_IMAGE_TOKENS < firsts[u] < firsts[0] - N_IMAGE_TOKENS, firsts
    for name in ("legacy", "proxy"):
        arm = report["arms"][name]
        assert arm["errors"] == 0, name
        assert "--mmproj" in arm["details"]["server_args"], name
        got = arm["limit"]
        assert got["complete"] and got["min_prefill_tokens"] == limit["min_prefill_tokens"], name
        assert limit["min_prefill_tokens"] <= got["prefilled_tokens"] == arm["prompt_n"], name
        # The limit's cells are the server's: each prompt is what the server reused plus computed
        # (an image's cells included), on stock as behind the proxy.
        for r in read_results(out / f"results-{name}.jsonl"):
            assert r.cache_n is not None and r.prompt_n is not None
            assert r.cache_n + r.prompt_n == limit["prompt_tokens_by_request"][r.id], (name, r.id)
            if name == "proxy" and r.id.endswith("-r2"):
                # behind the proxy a second round reuses everything before its new question,
                # the photos included, wherever its first round ran
                assert r.prompt_n <= limit["min_prefill_by_request"][r.id] + 1, (r.id, r.prompt_n, r.cache_n)
    md = (out / "report.md").read_text()
    assert "Against the limit" in md and "| proxy |" in md
