"""The arms of a benchmark: what serves the requests, started on this machine.

Every arm runs the same llama.cpp commit, model, threads, context, slot count and batch
sizes; only the caching differs:

- ``nocache``: stock llama-server, requests carry ``cache_prompt: false`` and the host
  prompt cache is off (``--cache-ram 0``), so every prompt token is computed: the compute
  baseline.
- ``legacy``: stock llama-server with its defaults (``--cache-ram 8192``, idle slots saved
  to it, LCP slot selection), with ``-kvu`` like the proxy arm: what we are measured against.
- ``proxy``: the patched server (``-kvu --cache-ram 0 -sps 0 --kvctl --kvctl-dir``) with the
  proxy in front (a ``radixctl serve`` child process, host radix tree; route H).

Stock servers run with ``-lv 4`` (trace logging, per task only) so the size of their host
prompt cache can be read from the log.
- ``proxy-hs``: the same with resident sharing on (``--cache-kv-share on``; routes A/S/H).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.errors import ConfigError
from proxy.native.launch import ServerProcess, ServerSpec, check_port_free, free_port, stop_process_group


@dataclass(frozen=True)
class ArmSettings:
    """What every arm shares."""

    model: Path
    log_dir: Path
    n_parallel: int  # --parallel, --ctx-size: proxy/cli/options.py has their defaults
    ctx_size: int
    threads: int = field(default_factory=lambda: os.cpu_count() or 2)
    batch_size: int = 2048
    ubatch_size: int = 512
    build_backend: str = "cpu"
    proxy_cache_mib: int = 4096
    stock_cache_mib: int | None = None  # replaces the stock arms' --cache-ram (None: as the arm says)
    n_servers: int = 1  # servers per arm: behind the proxy, or behind a round-robin balancer (cluster.py)
    gpu_layers: int = 0  # -ngl of every server (99: every layer and the KV cache on the GPU)
    extra_args: tuple[str, ...] = ()  # --server-arg: for every arm's servers (a draft model, adapters)
    server_cpus: tuple[int, ...] = ()  # --server-cpus: every server on these CPUs, the rest elsewhere

    def cpus_setting(self) -> dict[str, str]:
        """``server_cpus`` for a report's settings, when the servers were given CPUs."""
        return {"server_cpus": ",".join(map(str, self.server_cpus))} if self.server_cpus else {}

    def common_args(self) -> tuple[str, ...]:
        offload = ("-ngl", str(self.gpu_layers)) if self.gpu_layers else ()
        return ("-b", str(self.batch_size), "-ub", str(self.ubatch_size), *offload, *self.extra_args)

    def server_args(self, arm: ArmDef) -> tuple[str, ...]:
        """The arm's llama-server arguments, with ``--cache-ram`` replaced if ``stock_cache_mib`` says so."""
        args = list(arm.server_args)
        if self.stock_cache_mib is not None and "--cache-ram" in args:
            args[args.index("--cache-ram") + 1] = str(self.stock_cache_mib)
        return self.common_args() + tuple(args)


@dataclass(frozen=True)
class ArmDef:
    name: str
    variant: str  # which llama-server build: "stock" or "patched"
    server_args: tuple[str, ...]
    description: str
    proxy: bool = False  # run the proxy in front
    overrides: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    proxy_args: tuple[str, ...] = ()  # extra `radixctl serve` arguments
    fleet: bool = False  # one proxy per server, the proxies behind the round-robin balancer (fleet.py)
    shared_tier: bool = False  # the fleet's proxies share a Valkey tier (--cache-remote)


ARMS: dict[str, ArmDef] = {
    "nocache": ArmDef(
        "nocache",
        "stock",
        ("-kvu", "--cache-ram", "0", "-lv", "4"),
        "stock llama-server, cache_prompt:false, no host cache",
        overrides={"cache_prompt": False},
    ),
    "legacy": ArmDef(
        "legacy",
        "stock",
        ("-kvu", "--cache-ram", "8192", "-lv", "4"),
        "stock llama-server defaults: --cache-ram 8192, idle-slot saving, LCP slot selection",
    ),
    "proxy": ArmDef(
        "proxy",
        "patched",
        (),
        "patched llama-server + proxy at its defaults (host radix tree, idle slots released, routes A/H)",
        proxy=True,
    ),
    "proxy-keep": ArmDef(
        "proxy-keep",
        "patched",
        (),
        "patched llama-server + proxy, idle slots keep their KV for their next turn (A/H)",
        proxy=True,
        proxy_args=("--cache-idle-release", "off"),
    ),
    "proxy-files": ArmDef(
        "proxy-files",
        "patched",
        (),
        "patched llama-server + proxy without the KV arena: moves through payload files (A/H)",
        proxy=True,
        proxy_args=("--kv-arena", "off"),
    ),
    "proxy-asyncio": ArmDef(
        "proxy-asyncio",
        "patched",
        (),
        "patched llama-server + proxy on asyncio's own event loop instead of uvloop (routes A/H)",
        proxy=True,
        proxy_args=("--event-loop", "asyncio"),
    ),
    "proxy-hs": ArmDef(
        "proxy-hs",
        "patched",
        (),
        "patched llama-server + proxy with resident sharing (A/S/H)",
        proxy=True,
        proxy_args=("--cache-kv-share", "on"),
    ),
    "proxy-rel": ArmDef(
        "proxy-rel",
        "patched",
        (),
        "patched llama-server + proxy, idle slots' KV released once the host tree holds it (A/H)",
        proxy=True,
        proxy_args=("--cache-idle-release", "on"),
    ),
    "proxy-hs-keep": ArmDef(
        "proxy-hs-keep",
        "patched",
        (),
        "patched llama-server + proxy with resident sharing, idle slots keep their KV (A/S/H)",
        proxy=True,
        proxy_args=("--cache-kv-share", "on", "--cache-idle-release", "off"),
    ),
    "fleet": ArmDef(
        "fleet",
        "patched",
        (),
        "one proxy per patched server (--servers N), the proxies behind a round-robin balancer, "
        "each with its own host cache",
        proxy=True,
        fleet=True,
    ),
    "fleet-shared": ArmDef(
        "fleet-shared",
        "patched",
        (),
        "the same fleet, its proxies sharing one Valkey tier (--cache-remote, a local valkey-server)",
        proxy=True,
        fleet=True,
        shared_tier=True,
    ),
    "proxy-hs-rel": ArmDef(
        "proxy-hs-rel",
        "patched",
        (),
        "patched llama-server + proxy with resident sharing, idle slots' KV released (A/S/H)",
        proxy=True,
        proxy_args=("--cache-kv-share", "on", "--cache-idle-release", "on"),
    ),
}


def parse_arms(text: str) -> list[str]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in ARMS]
    if unknown or not names:
        raise ConfigError(
            f"unknown arm(s) {', '.join(unknown) or '(none given)'}", fix=f"choose from {', '.join(ARMS)}"
        )
    return names


def arm_binary(arm: ArmDef, backend: str) -> Path:
    from proxy.native.build import build_server, spec_for

    return build_server(spec_for(arm.variant, backend))


def binary_info(binary: Path) -> dict[str, Any]:
    info: dict[str, Any] = {"path": str(binary)}
    with contextlib.suppress(OSError, ValueError):
        build = json.loads((binary.parent / "build.json").read_text())
        info.update({k: build.get(k) for k in ("variant", "commit", "backend", "patches")})
    return info


def shm_base() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


@dataclass
class RunningArm:
    name: str
    arm: ArmDef
    front_url: str  # where the workload goes (the proxy, or the server itself)
    server_url: str
    server: ServerProcess
    binary: Path
    proxy_url: str | None = None
    proxy_log: Path | None = None

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.arm.overrides)

    def stats(self) -> dict[str, Any]:
        """Host cache bytes, KV cells in use and (proxy) routes, after the run."""
        out: dict[str, Any] = {
            "host_cache_bytes": None,
            "kv_cells_used": None,
            "binary": binary_info(self.binary),
            "server_args": self.server.spec.argv()[1:],
            "server_log": str(self.server.log_path),
        }
        if self.proxy_url:
            stats = _settled_stats(self.proxy_url)
            if stats:
                out["host_cache_bytes"] = stats.get("tree", {}).get("bytes")
                out["proxy"] = {
                    k: stats.get(k) for k in ("requests", "by_route", "hit_ratio", "tree", "tokenizer")
                }
            auth = kvctl_auth(self.server)
            caps = _get_json(f"{self.server_url}/kvctl/caps", headers=auth)
            if stats and caps:
                # The optimum host store: every distinct token position's KV once.
                per_token = int(caps["payload"]["cell_bytes"]) - int(caps["compat"].get("cell_meta_bytes", 0))
                out["host_optimum_bytes"] = int(stats.get("tree", {}).get("unique_tokens", 0)) * per_token
            cells = _get_json(f"{self.server_url}/kvctl/cells", headers=auth)
            if cells:
                out["kv_cells_used"] = cells.get("used")
                out["kv_cells"] = cells
        else:
            out["host_cache_bytes"] = legacy_cache_bytes(self.server.log_path)
        return out


def pool_cells(running: RunningArm) -> int | None:
    """Cells of the server's KV pool as allocated (llama.cpp rounds ``-c`` up to a multiple of 256).

    Patched servers say it in ``GET /kvctl/cells``; stock ones in ``/props`` (with ``-kvu`` a
    slot's context is the whole pool).
    """
    cells = (
        _get_json(f"{running.server_url}/kvctl/cells", headers=kvctl_auth(running.server))
        if running.arm.proxy
        else None
    )
    if isinstance(cells, dict) and isinstance(cells.get("n_cells"), int):
        return int(cells["n_cells"])
    props = _get_json(f"{running.server_url}/props")
    n_ctx = (
        (props or {}).get("default_generation_settings", {}).get("n_ctx") if isinstance(props, dict) else None
    )
    return int(n_ctx) if isinstance(n_ctx, int) else None


def kvctl_auth(server: ServerProcess) -> dict[str, str]:
    key = server.spec.kvctl_key
    return {"Authorization": f"Bearer {key}"} if key else {}


def _get_json(url: str, timeout: float = 10, headers: dict[str, str] | None = None) -> Any:
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers or {}), timeout=timeout
        ) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _settled_stats(proxy_url: str, timeout: float = 20.0) -> dict[str, Any] | None:
    """/radix/stats once the proxy's background saves stopped changing the tree."""
    last: dict[str, Any] | None = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = _get_json(f"{proxy_url}/radix/stats")
        if stats is not None and last is not None and stats.get("tree") == last.get("tree"):
            return dict(stats)
        last = stats
        time.sleep(1.0)
    return last


_CACHE_STATE = re.compile(r"cache state: (\d+) prompts, ([0-9.]+) MiB")


def legacy_cache_bytes(log_path: Path) -> int | None:
    """The stock server's host prompt cache size from its last "cache state" log line (needs -lv 4)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    found = _CACHE_STATE.findall(text)
    return round(float(found[-1][1]) * 1024 * 1024) if found else None


def arm_server_spec(
    settings: ArmSettings, arm: ArmDef, binary: Path, port: int, shm: Path | None, kvctl_key: str | None
) -> ServerSpec:
    """One llama-server of the arm: its settings, and with a proxy the /kvctl flags, payload dir and key."""
    return ServerSpec(
        binary=binary,
        model=settings.model,
        port=port,
        n_parallel=settings.n_parallel,
        ctx_size=settings.ctx_size,
        threads=settings.threads,
        kvctl=arm.proxy,
        kvctl_dir=shm,
        kvctl_key=kvctl_key,
        proxy_flags=arm.proxy,
        extra_args=settings.server_args(arm),
        cpus=settings.server_cpus,
    )


@contextlib.contextmanager
def start_arm(name: str, settings: ArmSettings, binary: Path | None = None) -> Iterator[RunningArm]:
    """Start the arm's server (and proxy); stop everything on the way out, whatever happens."""
    arm = ARMS[name]
    binary = binary or arm_binary(arm, settings.build_backend)
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    shm = shm_base() / f"radix-bench-{os.getpid()}-{port}" if arm.proxy else None
    # A fresh /kvctl key per patched server: in a key file for the server, in the environment for the proxy.
    spec = arm_server_spec(settings, arm, binary, port, shm, secrets.token_urlsafe(32) if arm.proxy else None)
    server = ServerProcess(spec, settings.log_dir / f"server-{name}.log")
    proxy_proc: subprocess.Popen[bytes] | None = None
    try:
        server.start(timeout=300)
        running = RunningArm(name, arm, spec.url, spec.url, server, binary)
        if arm.proxy:
            assert shm is not None
            proxy_port = free_port()
            running.proxy_log = settings.log_dir / f"proxy-{name}.log"
            proxy_proc = _start_proxy(
                spec.url, proxy_port, shm, settings, arm, running.proxy_log, spec.kvctl_key
            )
            running.proxy_url = running.front_url = f"http://127.0.0.1:{proxy_port}"
        yield running
    finally:
        if proxy_proc is not None:
            _stop(proxy_proc)
        server.stop()
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)


def _start_proxy(
    server_url: str | tuple[str, ...],
    port: int,
    shm: Path,
    settings: ArmSettings,
    arm: ArmDef,
    log_path: Path,
    kvctl_key: str | None = None,
    extra_args: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    check_port_free("127.0.0.1", port, "proxy")
    # The child reads no RADIX_* settings of ours except where the cache lives, and the server's
    # /kvctl key (in the environment, not on the command line).
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIX_") or k == "RADIX_CACHE_DIR"}
    if kvctl_key:
        env["RADIX_KVCTL_KEY"] = kvctl_key
    argv = [
        sys.executable,
        "-m",
        "proxy.cli",
        "serve",
        *(
            a
            for url in ((server_url,) if isinstance(server_url, str) else server_url)
            for a in ("--backend-url", url)
        ),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--shm-dir",
        str(shm),
        "--cache-ram",
        str(settings.proxy_cache_mib),
        *arm.proxy_args,
        *extra_args,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ConfigError(
                    f"the proxy exited with code {proc.returncode} during startup:\n{_tail(log_path)}",
                    fix=f"see {log_path}",
                )
            status = _get_json(f"http://127.0.0.1:{port}/health", timeout=2)
            if status and status.get("status") == "ok":
                return proc
            time.sleep(0.3)
        raise ConfigError(
            f"the proxy did not become healthy within 180 s:\n{_tail(log_path)}", fix=f"see {log_path}"
        )
    except BaseException:
        _stop(proc)
        raise


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    stop_process_group(proc, grace)


@contextlib.contextmanager
def patched_server(
    settings: ArmSettings, ctx_size: int, name: str = "kvctl"
) -> Iterator[tuple[ServerProcess, Path]]:
    """A patched server with /kvctl and a payload directory, no proxy (the kvctl microbenchmark)."""
    from proxy.native.build import build_server, spec_for

    binary = build_server(spec_for("patched", settings.build_backend))
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    shm = shm_base() / f"radix-bench-{os.getpid()}-{port}"
    spec = ServerSpec(
        binary=binary,
        model=settings.model,
        port=port,
        n_parallel=settings.n_parallel,
        ctx_size=ctx_size,
        threads=settings.threads,
        kvctl_dir=shm,
        kvctl_key=secrets.token_urlsafe(32),
        extra_args=settings.common_args(),
        cpus=settings.server_cpus,
    )
    server = ServerProcess(spec, settings.log_dir / f"server-{name}.log")
    try:
        server.start(timeout=300)
        yield server, shm
    finally:
        server.stop()
        shutil.rmtree(shm, ignore_errors=True)
