"""The compose stack's model volume (deploy/docker-compose.yml, issue 30): every service that
opens the model waits for models-init to complete, and models-init's script
(deploy/docker/fill-models.sh) puts the file there whole or not at all. The race itself,
both servers on a fresh volume with a large model, runs in `make deploy-test`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCRIPT = DEPLOY / "docker" / "fill-models.sh"
MODEL_MOUNT = "${RADIX_MODEL_DIR:-models}:/models:ro"


def services(name: str = "docker-compose.yml") -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / name).read_text())
    return dict(loaded["services"])


def test_every_service_that_opens_the_model_waits_for_models_init() -> None:
    found = services()
    readers = [n for n, s in found.items() if MODEL_MOUNT in s.get("volumes", [])]
    assert {"llama-server", "llama-server-2", "llama-server-3", "proxy", "proxy-2"} <= set(readers)
    for name in readers:
        assert found[name]["depends_on"]["models-init"] == {"condition": "service_completed_successfully"}, (
            name
        )
    init = found["models-init"]
    assert "profiles" not in init  # started with every profile, `multi` included
    assert init["restart"] == "no"
    assert init["image"] == found["llama-server"]["image"]
    assert init["entrypoint"] == ["/bin/sh", "/usr/local/bin/radix-fill-models"]
    # The volume at a path the image has nothing at: docker copies nothing into it itself.
    assert init["volumes"] == ["${RADIX_MODEL_DIR:-models}:/target"]
    assert init["command"] == ["/models", "/target"]
    assert init["environment"]["RADIX_MODEL_FILE"] in " ".join(found["llama-server"]["command"])


@pytest.mark.parametrize("variant", ["compose.cuda.yml", "compose.cann.yml"])
def test_accelerator_variants_fill_the_volume_from_the_servers_image(variant: str) -> None:
    found = services(variant)
    servers = ("llama-server", "llama-server-2", "llama-server-3")
    assert {found[n]["image"] for n in servers} == {found["models-init"]["image"]}
    assert found["models-init"]["build"] == found["llama-server"]["build"]
    assert "devices" not in found["models-init"] and "deploy" not in found["models-init"]


def test_the_server_image_ships_the_script() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "COPY deploy/docker/fill-models.sh /usr/local/bin/radix-fill-models" in dockerfile


def fill(src: Path, dst: Path, model: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RADIX_MODEL_FILE": model}
    return subprocess.run(["sh", str(SCRIPT), str(src), str(dst)], env=env, capture_output=True, text=True)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    if not shutil.which("sh") or not shutil.which("cmp"):
        pytest.skip("needs sh and cmp")
    src, dst = tmp_path / "image-models", tmp_path / "volume"
    src.mkdir()
    dst.mkdir()
    (src / "m.gguf").write_bytes(os.urandom(1 << 20))
    return src, dst


def test_copies_the_model_whole_and_marks_it_complete(dirs: tuple[Path, Path]) -> None:
    src, dst = dirs
    done = fill(src, dst, "m.gguf")
    assert done.returncode == 0, done.stderr
    assert (dst / "m.gguf").read_bytes() == (src / "m.gguf").read_bytes()
    marker = (dst / ".radix-models-complete").read_text().split()
    assert marker[:2] == ["m.gguf", str(1 << 20)]
    assert sorted(p.name for p in dst.iterdir()) == [".radix-models-complete", "m.gguf"]
    again = fill(src, dst, "m.gguf")
    assert again.returncode == 0 and "already complete" in again.stderr


def test_a_partial_copy_is_replaced(dirs: tuple[Path, Path]) -> None:
    src, dst = dirs
    # What docker's own copy left when the container creating the volume was interrupted,
    # and a temporary file of an interrupted earlier run.
    (dst / "m.gguf").write_bytes((src / "m.gguf").read_bytes()[:1000])
    (dst / ".m.gguf.partial.123").write_bytes(b"x")
    done = fill(src, dst, "m.gguf")
    assert done.returncode == 0, done.stderr
    assert (dst / "m.gguf").read_bytes() == (src / "m.gguf").read_bytes()
    assert not (dst / ".m.gguf.partial.123").exists()


def test_an_identical_copy_is_kept(dirs: tuple[Path, Path]) -> None:
    src, dst = dirs
    shutil.copy(src / "m.gguf", dst / "m.gguf")
    inode = (dst / "m.gguf").stat().st_ino
    done = fill(src, dst, "m.gguf")
    assert done.returncode == 0 and "identical" in done.stderr
    assert (dst / "m.gguf").stat().st_ino == inode
    assert (dst / ".radix-models-complete").exists()


def test_the_operators_own_model_is_only_checked(dirs: tuple[Path, Path]) -> None:
    src, dst = dirs
    (dst / "own.gguf").write_bytes(b"GGUF")
    done = fill(src, dst, "own.gguf")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in dst.iterdir()) == ["own.gguf"]  # nothing written
    missing = fill(src, dst, "other.gguf")
    assert missing.returncode == 1 and "RADIX_MODEL_FILE" in missing.stderr
    bad = fill(src, dst, "../m.gguf")
    assert bad.returncode == 2


def test_the_arm64_variant_puts_every_server_and_the_proxy_on_arm64() -> None:
    """compose.arm64.yml: every service of the server's image and the proxy run linux/arm64,
    under tags of their own (an arm64 image never replaces the host's under the same name)."""
    base, found = services(), services("compose.arm64.yml")
    server_users = {
        n for n, s in base.items() if s.get("image", "").startswith("llama-radix-proxy/llama-server:")
    }
    assert server_users == {"models-init", "llama-server", "llama-server-2", "llama-server-3"}
    assert set(found) == server_users | {"proxy", "proxy-2"}
    assert all(s["platform"] == "linux/arm64" for s in found.values())
    images = {found[n]["image"] for n in server_users}
    assert len(images) == 1 and images.pop() == base["llama-server"]["image"] + "-arm64"
    assert found["proxy"]["image"] == found["proxy-2"]["image"] != base["proxy"]["image"]
