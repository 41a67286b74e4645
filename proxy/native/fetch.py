"""Cache directory, progress lines, and verified downloads from the package registry.

Every artifact is produced in a temporary directory next to its final place and renamed
into place only when complete and verified, so an interrupted or failed step never leaves
a half-written cache entry behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from proxy.errors import BuildError


def cache_root() -> Path:
    """``$RADIX_CACHE_DIR``, else ``~/.cache/llama-radix-proxy``."""
    env = os.environ.get("RADIX_CACHE_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "llama-radix-proxy"
    root.mkdir(parents=True, exist_ok=True)
    return root


def say(message: str) -> None:
    print(f"[radixctl] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """Print a step's start and its elapsed time when it ends."""
    say(f"{name} ...")
    started = time.monotonic()
    yield
    say(f"{name}: done in {time.monotonic() - started:.1f} s")


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock so two processes never build or extract the same entry at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """A temporary directory beside ``final``; removed unless the caller renamed it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pip_download(requirement: str, filename: str, sha256: str, *, sdist: bool) -> Path:
    """Fetch one distribution file with pip into the cache and verify its sha256."""
    downloads = cache_root() / "downloads"
    final = downloads / filename
    with file_lock(downloads / f".{filename}.lock"):
        if final.exists() and sha256_file(final) == sha256:
            return final
        with staging_dir(final) as tmp, step(f"download {requirement}"):
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "-d", str(tmp), requirement]
            cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = tmp / filename
            if proc.returncode != 0 or not got.exists():
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
                raise BuildError(
                    f"could not download {requirement} from the package registry: " + " | ".join(tail),
                    fix="check that pip can reach PyPI (proxy settings, PIP_INDEX_URL) and retry",
                )
            actual = sha256_file(got)
            if actual != sha256:
                raise BuildError(
                    f"{filename} has sha256 {actual}, expected {sha256}",
                    fix="the registry served a different file; do not use it. Check PIP_INDEX_URL "
                    "or update the pin in proxy/native/pins.py after reviewing the new file",
                )
            os.replace(got, final)
        return final
