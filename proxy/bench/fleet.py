"""Fleet arms (``fleet``, ``fleet-shared``; ``radixctl bench cluster``): N proxies, each in front
of a patched server of its own, behind the round-robin balancer (``proxy/bench/balancer.py``),
as N hosts behind nginx or a Kubernetes Service are.

Each proxy has its own host tree, arena and payload directory. ``fleet-shared`` also starts a
local valkey-server (``proxy/native/store.py``) and gives every proxy ``--cache-remote`` with
one MAC key file, so what any proxy saved the others restore (docs/scale-out.md). The same
hardware budget as the ``legacy`` arm with ``--servers N`` (N stock servers behind the same
balancer) and the ``proxy`` arm (one proxy in front of N servers, one tree: the optimum).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.bench.arms import (
    ARMS,
    ArmSettings,
    RunningArm,
    _get_json,
    _settled_stats,
    _start_proxy,
    _stop,
    arm_binary,
    arm_server_spec,
    binary_info,
    kvctl_auth,
    shm_base,
)
from proxy.bench.cluster import _start_balancer
from proxy.errors import ConfigError
from proxy.native.launch import ServerProcess, free_port
from proxy.native.store import StoreProcess
from proxy.server.tiers.disk_files import load_secret

#: The store's memory cap: far above what a bench writes, so nothing is evicted mid-run.
STORE_MAXMEMORY_MIB = 8192


@dataclass
class FleetArm(RunningArm):
    servers: list[ServerProcess] = field(default_factory=list)
    proxy_urls: list[str] = field(default_factory=list)
    proxy_logs: list[Path] = field(default_factory=list)
    store: StoreProcess | None = None

    def stats(self) -> dict[str, Any]:
        """The fleet's sums (host caches, routes, KV cells), each proxy's own figures and its
        remote tier's, and the store's memory."""
        per = [_settled_stats(url) or {} for url in self.proxy_urls]
        by_route: dict[str, int] = {}
        for s in per:
            for route, n in (s.get("by_route") or {}).items():
                by_route[route] = by_route.get(route, 0) + int(n)
        cells = [_get_json(f"{s.url}/kvctl/cells", headers=kvctl_auth(s)) or {} for s in self.servers]
        out: dict[str, Any] = {
            "binary": binary_info(self.binary),
            "server_args": self.server.spec.argv()[1:],
            "servers": len(self.servers),
            "server_logs": [str(s.log_path) for s in self.servers],
            "proxy_logs": [str(p) for p in self.proxy_logs],
            "host_cache_bytes": sum(int(s.get("tree", {}).get("bytes", 0)) for s in per),
            "kv_cells_used": sum(int(c.get("used", 0)) for c in cells),
            "proxy": {"requests": sum(int(s.get("requests", 0)) for s in per), "by_route": by_route},
            "per_proxy": [
                {k: s.get(k) for k in ("requests", "by_route", "hit_ratio", "fallbacks")}
                | {"remote": (s.get("tiers") or {}).get("remote")}
                for s in per
            ],
        }
        if self.store is not None:
            out["store"] = store_figures(self.store)
        return out


def store_figures(store: StoreProcess) -> dict[str, Any]:
    """Keys and memory of the store after the run (INFO memory): what the shared tier cost."""
    import redis

    try:
        client = redis.Redis(host="127.0.0.1", port=store.port, socket_timeout=10)
        info = client.info("memory")
        return {"keys": int(client.dbsize()), "used_memory_bytes": int(info.get("used_memory", 0))}
    except redis.RedisError as exc:
        return {"error": str(exc)}


@contextlib.contextmanager
def start_fleet_arm(name: str, settings: ArmSettings, binary: Path | None = None) -> Iterator[FleetArm]:
    """N servers with a proxy each, the balancer in front (and the store); everything stopped on the way out."""
    arm = ARMS[name]
    if settings.n_servers < 2:
        raise ConfigError(f"the {name} arm is a fleet of proxies", fix="pass --servers 2 or more")
    binary = binary or arm_binary(arm, settings.build_backend)
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    base = shm_base() / f"radix-bench-{os.getpid()}-{free_port()}"
    base.mkdir(mode=0o700)
    servers: list[ServerProcess] = []
    fronts: list[subprocess.Popen[bytes]] = []
    store: StoreProcess | None = None
    try:
        shared: tuple[str, ...] = ()
        if arm.shared_tier:
            store = StoreProcess(base / "store", maxmemory_mib=STORE_MAXMEMORY_MIB).start()
            load_secret(base / "remote.key")  # made there: 32 random bytes, 0600, read by every proxy
            shared = ("--cache-remote", store.url, "--cache-remote-key-file", str(base / "remote.key"))
        proxy_urls: list[str] = []
        proxy_logs: list[Path] = []
        for i in range(settings.n_servers):
            shm = base / f"host-{i}"  # each proxy's own arena and payload files, shared with its server only
            spec = arm_server_spec(settings, arm, binary, free_port(), shm, secrets.token_urlsafe(32))
            servers.append(ServerProcess(spec, settings.log_dir / f"server-{name}-{i}.log"))
            servers[-1].start(timeout=300)
            port = free_port()
            proxy_logs.append(settings.log_dir / f"proxy-{name}-{i}.log")
            fronts.append(
                _start_proxy(spec.url, port, shm, settings, arm, proxy_logs[-1], spec.kvctl_key, shared)
            )
            proxy_urls.append(f"http://127.0.0.1:{port}")
        port = free_port()
        fronts.append(_start_balancer(tuple(proxy_urls), port, settings.log_dir / f"balancer-{name}.log"))
        url = f"http://127.0.0.1:{port}"
        running = FleetArm(
            name,
            arm,
            url,
            servers[0].url,
            servers[0],
            binary,
            servers=servers,
            proxy_urls=proxy_urls,
            proxy_logs=proxy_logs,
            store=store,
        )
        yield running
    finally:
        for front in reversed(fronts):
            _stop(front)
        for server in servers:
            server.stop()
        if store is not None:
            store.stop()
        shutil.rmtree(base, ignore_errors=True)
