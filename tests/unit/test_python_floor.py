"""The Python floor: `requires-python` is what the code, ruff and mypy assume, and vermin agrees.

vermin knows minor versions only: an API backported in a patch release (tarfile's
``filter=`` from 3.11.4) passes it, which is why the portability check
(`make portability`) also runs the unit tests on Debian 12's 3.11.2.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _floor() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    match = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    assert match, f"requires-python {spec!r} is not of the form '>=3.N'"
    return 3, int(match.group(1))


def test_ruff_and_mypy_target_the_floor() -> None:
    tools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    major, minor = _floor()
    assert tools["ruff"]["target-version"] == f"py{major}{minor}"
    assert tools["mypy"]["python_version"] == f"{major}.{minor}"


def test_no_api_newer_than_the_floor() -> None:
    vermin = shutil.which("vermin", path=str(Path(sys.executable).parent)) or shutil.which("vermin")
    if vermin is None:
        pytest.skip("vermin is not installed (it is in the test extra: pip install -e '.[test]')")
    major, minor = _floor()
    proc = subprocess.run(
        [vermin, "-q", "--no-tips", "--violations", f"--target={major}.{minor}-", "proxy", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, (
        f"code needs a Python newer than {major}.{minor}:\n{proc.stdout}{proc.stderr}"
    )
