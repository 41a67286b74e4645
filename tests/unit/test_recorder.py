"""The --record manifest: the operator's alone, and without the tenants' isolation keys."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from proxy.server.http.recorder import Recorder

pytestmark = pytest.mark.unit


def test_the_manifest_is_created_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "manifest.jsonl"
    Recorder(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_manifest_left_readable_is_made_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    path.write_text("")
    path.chmod(0o644)
    Recorder(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_cache_salt_is_not_recorded(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    recorder = Recorder(path)
    recorder.append("/v1/chat/completions", {"messages": [], "cache_salt": "tenant-a"}, "s1")
    recorder.close()
    line = json.loads(path.read_text())
    assert line["body"] == {"messages": []} and line["session"] == "s1"
    assert "tenant-a" not in path.read_text()
