"""The compose stack's `fleet` profile (deploy/docker-compose.yml; docs/scale-out.md, "Deploy"):
a Valkey, a second proxy in front of its own server, both proxies on the remote KV tier; and
the store image's entrypoint and health check (deploy/docker/valkey-*.sh), run here with
stand-ins for the server and the cli that record what they are given. The real server under
the entrypoint: tests/integration/test_valkey_image.py."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from proxy.errors import ConfigError
from proxy.server.tiers.disk_files import UnsafeKeyFile, load_secret
from proxy.server.tiers.remote_store import read_password

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ENTRYPOINT = DEPLOY / "docker" / "valkey-entrypoint.sh"
PING = DEPLOY / "docker" / "valkey-ping.sh"
VARIANTS = ["compose.cuda.yml", "compose.cann.yml", "compose.hostnet.yml", "compose.arm64.yml"]
PAYLOADS = "/run/radix-kv"


def load(name: str = "docker-compose.yml") -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / name).read_text())
    return loaded


def services(name: str = "docker-compose.yml") -> dict[str, Any]:
    return dict(load(name)["services"])


def default(value: str) -> str:
    """The default of a ``${VAR:-default}`` setting."""
    match = re.fullmatch(r"\$\{[A-Z0-9_]+:-(.*)\}", value)
    assert match, value
    return match.group(1)


# ---- the services ---------------------------------------------------------------------------------


def test_the_fleet_profile_is_the_store_a_second_proxy_and_its_server() -> None:
    found = services()
    fleet = {n for n, s in found.items() if "fleet" in s.get("profiles", [])}
    assert fleet == {"valkey", "proxy-2", "llama-server-3"}
    # The default stack's proxy is the fleet's first: no profile, on the tier once it is set.
    assert "profiles" not in found["proxy"]
    assert found["llama-server-2"]["profiles"] == ["multi"]


def test_the_store_is_built_from_the_base_and_runs_locked_down() -> None:
    valkey = services()["valkey"]
    assert valkey["build"]["dockerfile"] == "deploy/docker/valkey.Dockerfile"
    assert default(valkey["build"]["args"]["BASE"]) == "debian:bookworm-slim"
    assert valkey["image"] == "llama-radix-proxy/valkey:latest"
    assert valkey["read_only"] is True and valkey["cap_drop"] == ["ALL"]
    # Not published: neither here nor in the ports file; only the proxies reach it.
    assert "ports" not in valkey and "valkey" not in services("compose.ports.yml")
    env = valkey["environment"]
    assert default(env["RADIX_VALKEY_MAXMEMORY"]) == "4gb"
    run_dir = env["RADIX_VALKEY_RUN_DIR"]
    (tmpfs,) = [t for t in valkey["tmpfs"] if t.startswith(f"{run_dir}:")]
    assert {"uid=10001", "mode=0700"} <= set(tmpfs.split(":", 1)[1].split(","))
    assert valkey["secrets"] == ["valkey_password"]
    assert env["RADIX_VALKEY_PASSWORD_FILE"] == "/run/secrets/valkey_password"
    assert valkey["healthcheck"]["test"] == ["CMD", "/usr/local/bin/radix-valkey-ping"]
    assert "command" not in valkey and "entrypoint" not in valkey  # the image's radix-valkey
    dockerfile = (DEPLOY / "docker" / "valkey.Dockerfile").read_text()
    assert "COPY deploy/docker/valkey-entrypoint.sh /usr/local/bin/radix-valkey\n" in dockerfile
    assert "COPY deploy/docker/valkey-ping.sh /usr/local/bin/radix-valkey-ping\n" in dockerfile
    assert 'ENTRYPOINT ["/usr/local/bin/radix-valkey"]' in dockerfile
    assert "USER 10001:10001" in dockerfile
    # valkey-server where the base has it (Debian 13), else Redis (Debian 12).
    assert re.search(
        r"apt-cache show valkey-server .*pkgs=\"valkey-server valkey-tools\".*pkgs=\"redis-server redis-tools\"",
        dockerfile,
        re.S,
    )


def test_both_proxies_use_the_store_with_the_key_and_password_files() -> None:
    found = services()
    urls = set()
    for name in ("proxy", "proxy-2"):
        proxy = found[name]
        env = proxy["environment"]
        urls.add(env["RADIX_CACHE_REMOTE"])
        assert env["RADIX_CACHE_REMOTE_KEY_FILE"] == "/run/secrets/remote_key", name
        assert env["RADIX_CACHE_REMOTE_PASSWORD_FILE"] == "/run/secrets/valkey_password", name
        assert {"remote_key", "valkey_password"} <= set(proxy["secrets"]), name
        assert proxy["command"] == ["serve"] and proxy["image"] == found["proxy"]["image"]
    # One setting for both; empty by default, so the stack without the profile is unchanged.
    assert urls == {"${RADIX_CACHE_REMOTE:-}"}
    example = (DEPLOY / ".env.example").read_text().splitlines()
    assert "RADIX_CACHE_REMOTE=" in example
    port = default(found["valkey"]["environment"]["RADIX_VALKEY_PORT"])
    assert f"#RADIX_CACHE_REMOTE=valkey://valkey:{port}/0" in example
    # Each proxy on ports of its own (host networking runs them side by side).
    ports = {
        (
            default(found[n]["environment"]["RADIX_PORT"]),
            default(found[n]["environment"]["RADIX_METRICS_PORT"]),
        )
        for n in ("proxy", "proxy-2")
    }
    assert len(ports) == 2 and len({p for pair in ports for p in pair}) == 4
    published = services("compose.ports.yml")["proxy-2"]["ports"]
    assert published == ["${RADIX_BIND_ADDR:-127.0.0.1}:${PROXY_PORT_2:-8180}:${PROXY_PORT_2:-8180}"]


def test_the_fleet_secrets_need_no_file_without_the_profile() -> None:
    """The default stack's proxy lists the fleet's secrets too, and compose mounts a secret
    file for every service that lists it: unset, the files are /dev/null, which both the
    proxy and the store refuse as soon as they would read them."""
    secrets = load()["secrets"]
    assert secrets["remote_key"]["file"] == "${RADIX_CACHE_REMOTE_KEY_FILE:-/dev/null}"
    assert secrets["valkey_password"]["file"] == "${RADIX_CACHE_REMOTE_PASSWORD_FILE:-/dev/null}"
    with pytest.raises(UnsafeKeyFile):
        load_secret(Path("/dev/null"))
    with pytest.raises(ConfigError):
        read_password(Path("/dev/null"))
    example = (DEPLOY / ".env.example").read_text()
    assert "#RADIX_CACHE_REMOTE_KEY_FILE=./secrets/remote_key\n" in example
    assert "#RADIX_CACHE_REMOTE_PASSWORD_FILE=./secrets/valkey_password\n" in example
    header = (DEPLOY / "docker-compose.yml").read_text().split("\nx-restart", 1)[0]
    assert "for k in remote_key valkey_password" in header


def effective(base: dict[str, Any], variant: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Each service's volumes after a variant file: compose merges them by mount point."""
    out: dict[str, dict[str, Any]] = {}
    for name, service in base.items():
        mounts = {v.split(":")[1]: v for v in service.get("volumes", [])}
        override = (variant or {}).get(name, {})
        mounts |= {v.split(":")[1]: v for v in override.get("volumes", [])}
        out[name] = {**service, "volumes": list(mounts.values())}
    return out


@pytest.mark.parametrize("variant", [None, *VARIANTS])
def test_each_proxy_shares_its_payload_volume_with_its_own_servers_only(variant: str | None) -> None:
    found = effective(services(), services(variant) if variant else None)
    volumes = load()["volumes"]
    groups: dict[str, set[str]] = {}
    for name, service in found.items():
        for volume in service["volumes"]:
            source, target = volume.split(":")[:2]
            if target == PAYLOADS:
                groups.setdefault(source, set()).add(name)
    assert groups == {
        "kv-payloads": {"proxy", "llama-server", "llama-server-2"},
        "kv-payloads-2": {"proxy-2", "llama-server-3"},
    }
    for source, members in groups.items():
        assert volumes[source]["driver_opts"]["type"] == "tmpfs"
        (proxy,) = [n for n in members if "RADIX_SHM_DIR" in found[n].get("environment", {})]
        assert found[proxy]["environment"]["RADIX_SHM_DIR"] == PAYLOADS
        # Its default backends are servers of its own volume, declared #shared (checked at
        # startup: a server holding another directory is refused).
        backends = default(found[proxy]["environment"]["RADIX_BACKENDS"]).split()
        assert backends and all(b.endswith("#shared") for b in backends)
        assert {urlsplit(b).hostname for b in backends} <= members - {proxy}
        for server in members - {proxy}:
            command = found[server]["command"]
            assert command[command.index("--kvctl-dir") + 1] == PAYLOADS


def test_the_second_proxys_server_is_in_every_variant() -> None:
    for variant in VARIANTS:
        assert "llama-server-3" in services(variant), variant
    hostnet = services("compose.hostnet.yml")
    assert all(hostnet[n] == {"network_mode": "host"} for n in ("llama-server-3", "proxy-2", "valkey"))
    cuda = services("compose.cuda.yml")["llama-server-3"]["deploy"]["resources"]["reservations"]
    assert cuda["devices"][0]["device_ids"] == ["${NVIDIA_DEVICE_ID_3:-1}"]
    command = services()["llama-server-3"]["command"]
    cann = services("compose.cann.yml")["llama-server-3"]
    assert cann["environment"]["LLAMA_PORT"] == command[command.index("--port") + 1]


SECRET_FLAGS = {"-a", "--pass", "--requirepass", "--user", "--api-key", "--kvctl-key", "--admin-key"}


@pytest.mark.parametrize("name", ["docker-compose.yml", *VARIANTS])
def test_no_secret_on_a_command_line_or_in_the_environment(name: str) -> None:
    for service_name, service in services(name).items():
        argv: list[str] = []
        for key in ("command", "entrypoint"):
            value = service.get(key) or []
            argv += value if isinstance(value, list) else value.split()
        check = service.get("healthcheck", {}).get("test", [])
        argv += check if isinstance(check, list) else [check]
        assert not SECRET_FLAGS & set(argv), service_name
        assert not any("requirepass" in a or "$(cat" in a or "`cat" in a for a in argv), service_name
        # A password or key is named by a file (RADIX_*_FILE, GF_*__FILE), never the value.
        for key in service.get("environment") or {}:
            if ("PASSWORD" in key or key.endswith(("_KEY", "_AUTH"))) and not key.endswith("_FILE"):
                pytest.fail(f"{name}: {service_name} has a secret in its environment: {key}")


def test_every_compose_variable_is_documented_in_env_example() -> None:
    """What `make deploy-test` checks, here too: a setting the files read is in .env.example."""
    documented = set(re.findall(r"^#?([A-Z][A-Z0-9_]*)=", (DEPLOY / ".env.example").read_text(), re.M))
    used: set[str] = set()
    for name in ["docker-compose.yml", "compose.ports.yml", *VARIANTS]:
        used |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)(?::?-[^}]*)?\}", (DEPLOY / name).read_text()))
    assert not used - documented, sorted(used - documented)


# ---- the store's entrypoint and health check --------------------------------------------------------

PASSWORD = "s3cr3t+pass/word="


def recording(bin_dir: Path, log: Path, name: str) -> None:
    """A command on PATH that logs its argv to ``log`` and runs the real one."""
    real = shutil.which(name, path="/usr/bin:/bin")
    assert real, name
    script = bin_dir / name
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "{name} $*" >>"{log}"\nexec {real} "$@"\n')
    script.chmod(0o755)


@pytest.fixture
def store_env(tmp_path: Path) -> dict[str, str]:
    """A stand-in valkey-server that records its argv and a copy of its config file, every
    external command the scripts may run logging its argv, a password file and a run dir."""
    if not shutil.which("sh"):
        pytest.skip("needs sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "argv.log"
    for name in ("cat", "chmod", "mv", "basename", "id"):
        recording(bin_dir, log, name)
    server = bin_dir / "valkey-server"
    server.write_text(
        '#!/bin/sh\nprintf "%s\\n" "valkey-server $*" >>"$FAKE_LOG"\n'
        'cp "$1" "$FAKE_CONF"\nstat -c %a "$1" >"$FAKE_CONF.mode"\n'
    )
    server.chmod(0o755)
    cli = bin_dir / "valkey-cli"
    cli.write_text(
        '#!/bin/sh\nprintf "%s\\n" "valkey-cli $*" >>"$FAKE_LOG"\n'
        'if [ "$VALKEYCLI_AUTH" = "$FAKE_EXPECT" ]; then echo PONG; else echo "NOAUTH Authentication required."; fi\n'
    )
    cli.chmod(0o755)
    password = tmp_path / "valkey_password"
    password.write_text(PASSWORD + "\n")
    password.chmod(0o400)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "FAKE_LOG": str(log),
        "FAKE_CONF": str(tmp_path / "seen.conf"),
        "FAKE_EXPECT": PASSWORD,
        "RADIX_VALKEY_PASSWORD_FILE": str(password),
        "RADIX_VALKEY_RUN_DIR": str(run_dir),
    }


def run(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(script), *args], env=env, capture_output=True, text=True, timeout=30)


def test_the_entrypoint_gives_the_server_a_private_config_with_the_password(
    store_env: dict[str, str],
) -> None:
    done = run(ENTRYPOINT, {**store_env, "RADIX_VALKEY_MAXMEMORY": "512mb"}, "--loglevel", "notice")
    assert done.returncode == 0, done.stderr
    conf = Path(store_env["RADIX_VALKEY_RUN_DIR"]) / "valkey.conf"
    # exec'd with the config file first and the extra options after it; no password in argv
    log = Path(store_env["FAKE_LOG"]).read_text()
    assert f"valkey-server {conf} --loglevel notice\n" in log
    assert f"cat {store_env['RADIX_VALKEY_PASSWORD_FILE']}\n" in log  # the log sees every command
    assert PASSWORD not in log
    assert Path(store_env["FAKE_CONF"] + ".mode").read_text().strip() == "600"
    lines = Path(store_env["FAKE_CONF"]).read_text().splitlines()
    assert f"requirepass {PASSWORD}" in lines
    for want in ('save ""', "appendonly no", "maxmemory 512mb", "maxmemory-policy allkeys-lru", "port 6379"):
        assert want in lines
    assert f"dir {store_env['RADIX_VALKEY_RUN_DIR']}" in lines and "bind * -::*" in lines
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert [p.name for p in conf.parent.iterdir()] == ["valkey.conf"]  # no temporary left


REFUSED = [
    ("no password (the compose default)", {"RADIX_VALKEY_PASSWORD_FILE": "/dev/null"}, 1, "required"),
    ("a missing password file", {"RADIX_VALKEY_PASSWORD_FILE": "/nonexistent/pw"}, 1, "required"),
    ("a config line smuggled in", {"RADIX_VALKEY_MAXMEMORY": "4gb\nsave 60 1"}, 2, "RADIX_VALKEY_MAXMEMORY"),
    ("a port that is no number", {"RADIX_VALKEY_PORT": "6379 x"}, 2, "RADIX_VALKEY_PORT"),
    ("a bind with a newline", {"RADIX_VALKEY_BIND": "0.0.0.0\nprotected-mode no"}, 2, "RADIX_VALKEY_BIND"),
    ("no run dir", {"RADIX_VALKEY_RUN_DIR": "/nonexistent/run"}, 1, "writable directory"),
]


@pytest.mark.parametrize(("what", "change", "rc", "says"), REFUSED, ids=[r[0] for r in REFUSED])
def test_the_entrypoint_refuses(
    store_env: dict[str, str], what: str, change: dict[str, str], rc: int, says: str
) -> None:
    done = run(ENTRYPOINT, {**store_env, **change})
    assert done.returncode == rc, (what, done.stderr)
    assert says in done.stderr
    assert not Path(store_env["FAKE_CONF"]).exists()  # the server was not started


@pytest.mark.parametrize("password", ["", "two words", "quo'te", 'dou"ble', "back\\slash", "new\nline"])
def test_the_entrypoint_refuses_a_password_it_cannot_write_as_one_word(
    store_env: dict[str, str], password: str
) -> None:
    path = Path(store_env["RADIX_VALKEY_PASSWORD_FILE"])
    path.chmod(0o600)
    path.write_text(password + "\n")
    done = run(ENTRYPOINT, store_env)
    assert done.returncode in (1, 2) and "password" in done.stderr
    assert not Path(store_env["FAKE_CONF"]).exists()


def test_the_health_check_sends_the_password_in_the_environment_only(store_env: dict[str, str]) -> None:
    done = run(PING, {**store_env, "RADIX_VALKEY_PORT": "6390"})
    assert done.returncode == 0, done.stderr
    log = Path(store_env["FAKE_LOG"]).read_text()
    assert "valkey-cli -h 127.0.0.1 -p 6390 ping\n" in log and PASSWORD not in log
    # The cli exits 0 on NOAUTH too: the answer decides.
    wrong = run(PING, {**store_env, "FAKE_EXPECT": "another"})
    assert wrong.returncode == 1 and "NOAUTH" in wrong.stderr
    # A specific address is asked there; a wildcard on loopback.
    run(PING, {**store_env, "RADIX_VALKEY_BIND": "10.1.2.3"})
    assert "valkey-cli -h 10.1.2.3 -p 6379 ping\n" in Path(store_env["FAKE_LOG"]).read_text()


def test_the_scripts_are_posix_sh() -> None:
    for script in (ENTRYPOINT, PING):
        assert script.read_text().startswith("#!/bin/sh\n")
        assert os.access(script, os.X_OK), script
        if shutil.which("dash"):
            assert subprocess.run(["dash", "-n", str(script)]).returncode == 0
