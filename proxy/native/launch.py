"""Start and stop llama-server processes: used by ``radixctl up``, the tests and the benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from proxy.errors import ConfigError

# What the proxy needs from every server: unified KV (one pool shared by all slots), and
# none of the stock behaviours that replace slot KV behind the proxy's back (the host
# prompt cache and its idle-slot clearing, similarity-based slot swaps).
PROXY_SERVER_ARGS = ["-kvu", "--cache-ram", "0", "-sps", "0"]


@dataclass(frozen=True)
class ServerSpec:
    binary: Path
    model: Path
    port: int
    host: str = "127.0.0.1"
    n_parallel: int = 4
    ctx_size: int = 8192
    threads: int | None = None
    kvctl: bool = True
    kvctl_dir: Path | None = None
    kvctl_key: str | None = None
    proxy_flags: bool = True
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        argv = [str(self.binary), "-m", str(self.model), "--host", self.host, "--port", str(self.port),
                "-np", str(self.n_parallel), "-c", str(self.ctx_size), "--no-webui"]
        if self.threads:
            argv += ["-t", str(self.threads)]
        if self.proxy_flags:
            argv += PROXY_SERVER_ARGS
        if self.kvctl:
            argv.append("--kvctl")
            if self.kvctl_dir:
                argv += ["--kvctl-dir", str(self.kvctl_dir)]
            if self.kvctl_key:
                argv += ["--kvctl-key", self.kvctl_key]
        return argv + list(self.extra_args)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port_free(host: str, port: int, what: str) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"{what} port {host}:{port} is in use ({exc.strerror})",
                              fix="stop whatever listens there, or choose another port") from exc


class ServerProcess:
    """One llama-server child: started in its own process group, always stopped."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    def start(self, timeout: float = 120.0) -> ServerProcess:
        check_port_free(self.spec.host, self.spec.port, "llama-server")
        if self.spec.kvctl_dir:
            self.spec.kvctl_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.spec.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ConfigError(f"llama-server exited with code {self.proc.returncode} during startup:\n"
                                  f"{self.log_tail()}", fix="see the server log above")
            with contextlib.suppress(urllib.error.URLError, OSError), \
                    urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.2)
        raise ConfigError(f"llama-server did not become healthy within {timeout:.0f} s:\n{self.log_tail()}",
                          fix="see the server log above")

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process_group(proc, grace)


def stop_process_group(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM a child started with ``start_new_session``, SIGKILL it after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def running_server(spec: ServerSpec, log_path: Path, timeout: float = 120.0) -> Iterator[ServerProcess]:
    server = ServerProcess(spec, log_path).start(timeout)
    try:
        yield server
    finally:
        server.stop()
