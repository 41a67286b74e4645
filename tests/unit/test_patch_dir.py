"""Where `radixctl build` finds the patch series, and that a patched build never runs without one."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.errors import BuildError
from proxy.native import build
from proxy.native.build import PATCH_SUBDIR, BuildSpec, build_server

pytestmark = pytest.mark.unit


def test_a_patched_build_refuses_an_empty_series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIX_PATCH_DIR", str(tmp_path))
    with pytest.raises(BuildError, match="no llama-server patch series"):
        build_server(BuildSpec(variant="patched"))


def test_after_a_plain_pip_install_the_series_comes_from_the_checkout_in_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RADIX_PATCH_DIR", raising=False)
    monkeypatch.setattr(build, "repo_root", lambda: tmp_path / "site-packages")
    (tmp_path / "checkout" / PATCH_SUBDIR).mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "checkout")
    assert build.patch_dir() == tmp_path / "checkout" / PATCH_SUBDIR


def test_an_editable_install_uses_its_own_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RADIX_PATCH_DIR", raising=False)
    assert build.patch_dir() == build.repo_root() / PATCH_SUBDIR
    assert build.patch_files()
