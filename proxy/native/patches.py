"""Developer workflow for the patch series: an editable git tree, and export back.

``checkout`` gives a git repository of the pinned source with one commit per patch on
top of a ``radix-base`` tag; edit, commit, then ``export`` rewrites ``patches/`` from
``radix-base..HEAD`` with ``git format-patch``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from proxy.errors import BuildError
from proxy.native.build import _ignore_git, patch_dir, patch_files, pristine_source
from proxy.native.fetch import say
from proxy.native.pins import LLAMA_CPP

BASE_TAG = "radix-base"
_GIT_ID = ["-c", "user.name=radixctl", "-c", "user.email=radixctl@localhost", "-c", "commit.gpgsign=false"]


def _git(tree: Path, *args: str) -> str:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    proc = subprocess.run(["git", *_GIT_ID, *args], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(
            f"git {' '.join(args[:2])} failed in {tree}: {proc.stderr.strip()[-400:]}",
            fix="inspect the tree with git status; `git am --abort` if a patch stopped",
        )
    return proc.stdout


def checkout(tree: Path) -> None:
    if tree.exists() and any(tree.iterdir()):
        raise BuildError(f"{tree} exists and is not empty", fix="pass a new directory")
    shutil.copytree(pristine_source(), tree, symlinks=True, dirs_exist_ok=True, ignore=_ignore_git)
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(
        tree, "commit", "-qm", f"llama.cpp {LLAMA_CPP.commit} ({LLAMA_CPP.package} {LLAMA_CPP.version} sdist)"
    )
    _git(tree, "tag", BASE_TAG)
    for patch in patch_files():
        _git(tree, "am", "-q", "--keep-cr", str(patch.resolve()))
        say(f"applied {patch.name}")
    say(f"editable tree ready at {tree}: commit your changes, then `radixctl patch export {tree}`")


def export(tree: Path) -> list[Path]:
    out = patch_dir()
    count = _git(tree, "rev-list", "--count", f"{BASE_TAG}..HEAD").strip()
    if count == "0":
        raise BuildError(f"{tree} has no commits after {BASE_TAG}", fix="commit your changes first")
    for old in patch_files():
        old.unlink()
    _git(tree, "format-patch", "-q", "--no-signature", "--zero-commit", "-o", str(out), f"{BASE_TAG}..HEAD")
    written = patch_files()
    say(f"exported {len(written)} patch(es) to {out}")
    return written
