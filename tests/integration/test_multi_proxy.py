"""Two proxies behind nginx hashing a session key (deploy/nginx/llama-radix.conf, shipped as is).

Each proxy owns its own patched server (two slots, a small context). The test runs the
shipped config with only the listen address and the upstream list replaced: the same
session key always lands on the same proxy (and so the same server), different keys
spread over both, the API-key fallback is sticky too, and the admin API is not exposed.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.native.launch import ServerProcess, free_port
from tests.helpers import ProxyThread, Reply, ServerFactory, chat_body, get, post, proxy_config

NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
)
pytestmark = pytest.mark.skipif(
    NGINX is None, reason="nginx is not installed (Debian: apt-get install nginx-light)"
)

SHIPPED = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "llama-radix.conf"

MAIN = """worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    include {d}/llama-radix.conf;
}}
"""


def render(shipped: str, listen: int, proxies: list[ProxyThread]) -> str:
    """The shipped file with our listen port and our proxies as the upstream servers."""
    lines = "".join(
        f"    server {p.config.host}:{p.config.port} max_fails=3 fail_timeout=10s;\n" for p in proxies
    )
    text, n_up = re.subn(r"(?:    server 127\.0\.0\.1:\d+ [^\n]*\n)+", lines, shipped)
    text, n_listen = re.subn(r"listen 127\.0\.0\.1:\d+;", f"listen 127.0.0.1:{listen};", text)
    assert (n_up, n_listen) == (1, 1), "the shipped config no longer has the shape this test rewrites"
    return text


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"nginx exited with {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    pytest.fail("nginx did not open its port")


@pytest.fixture(scope="module")
def servers(start_server: ServerFactory, patched_bin: Path) -> list[ServerProcess]:
    return [start_server(patched_bin, n_parallel=2, ctx_size=2048) for _ in range(2)]


@pytest.fixture(scope="module")
def proxies(servers: list[ServerProcess]) -> Iterator[list[ProxyThread]]:
    threads = [ProxyThread(proxy_config(s, cache_ram_mib=64)).start() for s in servers]
    yield threads
    for t in threads:
        t.stop()


@pytest.fixture(scope="module")
def balancer(proxies: list[ProxyThread], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    assert NGINX is not None
    d = tmp_path_factory.mktemp("nginx")
    d.chmod(0o755)
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (d / sub).mkdir(mode=0o777)
    port = free_port()
    (d / "llama-radix.conf").write_text(render(SHIPPED.read_text(), port, proxies))
    (d / "nginx.conf").write_text(MAIN.format(d=d))
    check = subprocess.run(
        [NGINX, "-t", "-p", str(d), "-c", str(d / "nginx.conf")], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    log = d / "stderr.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [NGINX, "-p", str(d), "-c", str(d / "nginx.conf"), "-g", "daemon off;"], stdout=out, stderr=out
        )
    try:
        wait_port(port, proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ask(url: str, text: str, headers: dict[str, str]) -> Reply:
    body = chat_body([{"role": "user", "content": text}], 1, logprobs=False)
    del body["top_logprobs"]
    reply = post(f"{url}/v1/chat/completions", body, headers=headers)
    assert reply.status == 200, reply.body
    return reply


def landed(reply: Reply, proxies: list[ProxyThread], servers: list[ServerProcess]) -> int:
    """Which proxy answered, by nginx's X-Radix-Proxy; and its own server did the work."""
    upstream = reply.headers["X-Radix-Proxy"]
    i = [f"{p.config.host}:{p.config.port}" for p in proxies].index(upstream)
    names = proxies[i].call(lambda rt: [s.name for s in rt.coordinator.servers])
    assert reply.headers["X-Radix-Server"] in names
    assert proxies[i].config.backends == (servers[i].url,)
    return i


def test_one_session_key_always_lands_on_one_proxy(
    balancer: str, proxies: list[ProxyThread], servers: list[ServerProcess]
) -> None:
    for key in ("session-a", "session-b"):
        seen = {
            landed(ask(balancer, f"Say hi, turn {k}.", {"X-Session-Id": key}), proxies, servers)
            for k in range(4)
        }
        assert len(seen) == 1, f"{key} landed on proxies {seen}"


def test_different_keys_spread_over_both_proxies(
    balancer: str, proxies: list[ProxyThread], servers: list[ServerProcess]
) -> None:
    where = [
        landed(ask(balancer, "Say hi.", {"X-Session-Id": f"user-{k}"}), proxies, servers) for k in range(16)
    ]
    assert set(where) == {0, 1}, where
    again = [
        landed(ask(balancer, "Say hi.", {"X-Session-Id": f"user-{k}"}), proxies, servers) for k in range(4)
    ]
    assert again == where[:4]


def test_api_key_is_the_fallback_key(
    balancer: str, proxies: list[ProxyThread], servers: list[ServerProcess]
) -> None:
    auth = {"Authorization": "Bearer tenant-one"}
    seen = {landed(ask(balancer, f"Hello {k}.", auth), proxies, servers) for k in range(3)}
    assert len(seen) == 1


def test_admin_and_metrics_are_not_exposed(balancer: str, proxies: list[ProxyThread]) -> None:
    assert get(f"{balancer}/radix/stats").status == 404
    assert get(f"{balancer}/metrics").status == 404
    assert get(f"{balancer}/healthz").status == 200
    assert get(f"{proxies[0].url}/metrics").status == 200  # scraped on each proxy directly
