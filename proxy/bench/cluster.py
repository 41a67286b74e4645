"""Arms of N servers (``radixctl bench --servers N``).

- proxy arms: N patched servers sharing one payload directory, behind one proxy (cost-model
  routing, one host tree for all of them);
- stock arms: N stock servers of the same commit and flags behind the round-robin balancer
  (``proxy/bench/balancer.py``), what a plain load balancer in front of llama-server gives.

Every server gets the arm's settings (slots, context, threads): the two sides run the same
hardware budget.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.bench.arms import (
    ARMS,
    ArmSettings,
    RunningArm,
    _get_json,
    _start_proxy,
    _stop,
    _tail,
    arm_binary,
    arm_server_spec,
    legacy_cache_bytes,
    shm_base,
)
from proxy.errors import ConfigError
from proxy.native.launch import ServerProcess, check_port_free, free_port


@dataclass
class ClusterArm(RunningArm):
    servers: list[ServerProcess] = field(default_factory=list)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["servers"] = len(self.servers)
        out["server_logs"] = [str(s.log_path) for s in self.servers]
        if not self.arm.proxy:
            sizes = [legacy_cache_bytes(s.log_path) for s in self.servers]
            out["host_cache_bytes"] = sum(x for x in sizes if x is not None) if any(sizes) else None
        return out


@contextlib.contextmanager
def start_cluster_arm(name: str, settings: ArmSettings, binary: Path | None = None) -> Iterator[ClusterArm]:
    """N servers, and the proxy or the balancer in front; everything stopped on the way out."""
    arm = ARMS[name]
    binary = binary or arm_binary(arm, settings.build_backend)
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    shm = shm_base() / f"radix-bench-{os.getpid()}-{free_port()}" if arm.proxy else None
    key = secrets.token_urlsafe(32) if arm.proxy else None
    servers: list[ServerProcess] = []
    front: subprocess.Popen[bytes] | None = None
    try:
        for i in range(settings.n_servers):
            spec = arm_server_spec(settings, arm, binary, free_port(), shm, key)
            servers.append(ServerProcess(spec, settings.log_dir / f"server-{name}-{i}.log"))
            servers[-1].start(timeout=300)
        urls = tuple(s.url for s in servers)
        port = free_port()
        log_path = settings.log_dir / f"{'proxy' if arm.proxy else 'balancer'}-{name}.log"
        if arm.proxy:
            assert shm is not None
            front = _start_proxy(urls, port, shm, settings, arm, log_path, key)
        else:
            front = _start_balancer(urls, port, log_path)
        url = f"http://127.0.0.1:{port}"
        running = ClusterArm(name, arm, url, urls[0], servers[0], binary, servers=servers)
        if arm.proxy:
            running.proxy_url, running.proxy_log = url, log_path
        yield running
    finally:
        if front is not None:
            _stop(front)
        for server in servers:
            server.stop()
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)


def _start_balancer(urls: tuple[str, ...], port: int, log_path: Path) -> subprocess.Popen[bytes]:
    check_port_free("127.0.0.1", port, "balancer")
    argv = [sys.executable, "-m", "proxy.bench.balancer", "--port", str(port), *urls]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ConfigError(
                    f"the balancer exited with code {proc.returncode}:\n{_tail(log_path)}",
                    fix=f"see {log_path}",
                )
            if _get_json(f"http://127.0.0.1:{port}/health", timeout=2) is not None:
                return proc
            time.sleep(0.2)
        raise ConfigError(
            f"the balancer did not answer within 60 s:\n{_tail(log_path)}", fix=f"see {log_path}"
        )
    except BaseException:
        _stop(proc)
        raise
