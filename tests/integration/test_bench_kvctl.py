"""`radixctl bench kvctl` for real, at a tiny size: the bench starts its own patched server and
moves KV through the proxy's mover, inline (msgpack in the HTTP bodies)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.integration


def test_inline_moves_skip_a_payload_over_the_inline_limit(tmp_path: Path, patched_bin: Path) -> None:
    """3,000 tokens of SmolLM2 are 69 MB, over the server's 64 MiB limit on a payload in a body:
    the bench reports the size it can move and says why it skips the other (on an H200 the
    whole bench stopped there with the server's 400)."""
    from proxy.cli.main import main

    out = tmp_path / "kv"
    args = ["bench", "kvctl", "--out", str(out), "-t", "2", "-np", "2", "-c", "8192"]
    args += ["--sizes", "64,3000", "--reps", "1", "--no-probe", "--transport", "inline"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "skipping 3000 tokens inline" in res.output, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["transport"] == "inline msgpack"
    assert [s["tokens"] for s in report["sizes"]] == [64]
    assert all(report["sizes"][0][op]["mb_s"] > 0 for op in ("export", "import"))
    # The same payload imported into two other slots at once: both answered, timed together.
    parallel = report["sizes"][0]["parallel_import"]
    assert parallel["slots"] == 2 and parallel["wall_ms_p50"] > 0 and parallel["speedup"] > 0
    assert "Imports into different slots at once" in (out / "report.md").read_text()
