"""The store image's entrypoint and health check (deploy/docker/valkey-*.sh) on the real
valkey-server (or redis-server), as the image runs them but without docker: the password
works and is needed, it is in no process's command line, and the store is a cache (no
persistence, maxmemory with allkeys-lru). The compose and Kubernetes wiring around it:
tests/unit/test_compose_fleet.py and tests/unit/test_deploy.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from proxy.native.launch import free_port
from proxy.server.tiers.remote_store import make_client, parse_store_url, read_password

DOCKER = Path(__file__).resolve().parents[2] / "deploy" / "docker"
STORE_BIN = shutil.which("valkey-server") or shutil.which("redis-server")
CLI_BIN = shutil.which("valkey-cli") or shutil.which("redis-cli")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        STORE_BIN is None or CLI_BIN is None,
        reason="neither valkey-server nor redis-server (with its cli) is installed (make valkey)",
    ),
]
PASSWORD = "Zm9vYmFy+c2VjcmV0/cGFzcw=="


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], int]]:
    tmp = tmp_path_factory.mktemp("valkey-image")
    run_dir = tmp / "run"
    run_dir.mkdir(mode=0o700)
    password = tmp / "valkey_password"
    password.write_text(PASSWORD + "\n")
    password.chmod(0o400)
    env = {
        **os.environ,
        "RADIX_VALKEY_PASSWORD_FILE": str(password),
        "RADIX_VALKEY_RUN_DIR": str(run_dir),
        "RADIX_VALKEY_PORT": str(free_port()),
        "RADIX_VALKEY_BIND": "127.0.0.1",
        "RADIX_VALKEY_MAXMEMORY": "64mb",
    }
    log = open(tmp / "store.log", "wb")  # noqa: SIM115 (kept open for the process)
    proc = subprocess.Popen(["sh", str(DOCKER / "valkey-entrypoint.sh")], env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while ping(env).returncode != 0:
        assert proc.poll() is None, (tmp / "store.log").read_text(errors="replace")[-2000:]
        assert time.monotonic() < deadline, "the store did not answer"
        time.sleep(0.1)
    yield env, proc.pid
    proc.terminate()
    proc.wait(30)
    log.close()


def ping(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(DOCKER / "valkey-ping.sh")], env=env, capture_output=True, text=True)


def client(env: dict[str, str], password: str | None) -> redis.Redis:
    # No retries: a refused password is the answer, not a failure to retry with backoff.
    return redis.Redis(
        host="127.0.0.1",
        port=int(env["RADIX_VALKEY_PORT"]),
        password=password,
        socket_timeout=5,
        retry=Retry(NoBackoff(), 0),
    )


def test_the_password_is_needed_and_works(store: tuple[dict[str, str], int]) -> None:
    env, _ = store
    with pytest.raises(redis.AuthenticationError):
        client(env, None).ping()
    with pytest.raises(redis.AuthenticationError):
        client(env, "wrong").ping()
    assert client(env, PASSWORD).ping() is True
    # The health check fails on the wrong password, though the cli itself exits 0 on NOAUTH.
    wrong = Path(env["RADIX_VALKEY_RUN_DIR"]).parent / "wrong"
    wrong.write_text("wrong\n")
    assert ping({**env, "RADIX_VALKEY_PASSWORD_FILE": str(wrong)}).returncode == 1


async def test_the_proxys_client_with_the_same_password_file(store: tuple[dict[str, str], int]) -> None:
    """What the compose stack does: the proxy reads the secret file the store was given."""
    env, _ = store
    address = parse_store_url(f"valkey://127.0.0.1:{env['RADIX_VALKEY_PORT']}/0")
    c = make_client(address, read_password(Path(env["RADIX_VALKEY_PASSWORD_FILE"])), 2.0)
    try:
        assert await c.set(b"radix:deploy-test", b"kv", nx=True)
        assert await c.get(b"radix:deploy-test") == b"kv"
    finally:
        await c.aclose()


def test_a_cache_without_persistence(store: tuple[dict[str, str], int]) -> None:
    env, _ = store
    c = client(env, PASSWORD)
    config = c.config_get("*")
    assert config["save"] == "" and config["appendonly"] == "no"
    assert config["maxmemory-policy"] == "allkeys-lru" and config["maxmemory"] == str(64 << 20)
    assert config["dir"] == env["RADIX_VALKEY_RUN_DIR"]


def test_the_password_is_in_no_command_line(store: tuple[dict[str, str], int]) -> None:
    env, pid = store
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            assert PASSWORD.encode() not in cmdline, proc.name
    # The server replaced the entrypoint's shell (exec): the process is the store itself.
    assert Path(os.readlink(f"/proc/{pid}/exe")).name.startswith(("valkey-server", "redis-"))
    conf = Path(env["RADIX_VALKEY_RUN_DIR"]) / "valkey.conf"
    assert conf.stat().st_mode & 0o777 == 0o600
