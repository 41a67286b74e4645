"""Start and stop llama-server processes: used by ``radixctl up``, the tests and the benchmarks."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.errors import ConfigError

# What the proxy needs from every server: unified KV (one pool shared by all slots), and
# none of the stock behaviours that replace slot KV behind the proxy's back (the host
# prompt cache and its idle-slot clearing, similarity-based slot swaps).
PROXY_SERVER_ARGS = ["-kvu", "--cache-ram", "0", "-sps", "0"]

# Stock llama-server has no flag that turns its CORS grant off (its default echoes any Origin,
# with credentials). An empty allowed origin is the nearest: it sends
# `Access-Control-Allow-Origin:` with no value, which matches no origin, and no credentials.
NO_CORS_ARGS = ["--cors-origins", "", "--no-cors-credentials"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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
    # The /kvctl key: handed over in a 0600 file in a private temporary directory (never argv),
    # removed once the server is up. Without a key the server refuses --kvctl unless ``insecure``
    # (--kvctl-insecure: only for a server nothing but the proxy can reach).
    kvctl_key: str | None = None
    insecure: bool = False
    # The key of the server's own HTTP API (--api-key-file, same 0600 file treatment): without
    # it /completion, /slots and /tokenize answer anyone who reaches the port (docs/security.md).
    api_key: str | None = None
    proxy_flags: bool = True
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    cpus: tuple[int, ...] = ()  # the CPUs the server may run on (sched_setaffinity); () = any

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self, key_file: Path | None = None, api_key_file: Path | None = None) -> list[str]:
        """The command line; ``key_file`` holds ``kvctl_key`` and ``api_key_file`` ``api_key``
        (written by ServerProcess.start)."""
        argv = [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "-np",
            str(self.n_parallel),
            "-c",
            str(self.ctx_size),
            "--no-webui",
        ]
        if self.threads:
            argv += ["-t", str(self.threads)]
        if self.proxy_flags:
            argv += PROXY_SERVER_ARGS
        if self.kvctl:
            argv.append("--kvctl")
            if self.kvctl_dir:
                argv += ["--kvctl-dir", str(self.kvctl_dir)]
            if self.kvctl_key:
                argv += ["--kvctl-key-file", str(key_file) if key_file else "(key file)"]
            if self.insecure:
                argv.append("--kvctl-insecure")
        if self.api_key:
            argv += ["--api-key-file", str(api_key_file) if api_key_file else "(key file)"]
            argv += NO_CORS_ARGS
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
            raise ConfigError(
                f"{what} port {host}:{port} is in use ({exc.strerror})",
                fix="stop whatever listens there, or choose another port",
            ) from exc


_KVCTL_REFUSAL = "--kvctl cannot be enabled:"
# A llama.cpp log line of level E: "0.00.142.458 E llama_model_load: error loading model: ...".
_ERROR_LINE = re.compile(r"^\s*[\d.]+ E (?:\S+\s+)?(.+)$")


class ServerProcess:
    """One llama-server child: started in its own process group, always stopped."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._key_dir: Path | None = None
        self._log_start = 0  # where this run's lines begin in the (appended) log
        self.startup_exit: int | None = None  # the exit code when it died during startup

    @property
    def url(self) -> str:
        return self.spec.url

    def start(self, timeout: float = 120.0) -> ServerProcess:
        self.spawn()
        self.wait_healthy(timeout)
        return self

    def spawn(self) -> None:
        """Start the process and return at once (``wait_healthy`` waits for it). It dies with
        the process that called this (Linux: PR_SET_PDEATHSIG), so call it from the main
        thread: the signal follows the thread that forked, not the process."""
        check_port_free(self.spec.host, self.spec.port, "llama-server")
        if self.spec.kvctl_dir:
            # The server refuses a group- or world-writable one.
            self.spec.kvctl_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        key_file = self._write_key("key", self.spec.kvctl_key) if self.spec.kvctl else None
        api_key_file = self._write_key("api-key", self.spec.api_key)
        try:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self.spec.argv(key_file, api_key_file),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=functools.partial(_die_with_parent, os.getpid(), self.spec.cpus),
                )
        except BaseException:
            self.stop()
            raise

    def health_ok(self) -> bool:
        """One quick probe of GET /health (2 s at most)."""
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp,
        ):
            return bool(resp.status == 200)
        return False

    def ready(self) -> None:
        """The server is up: the key file it read at startup is not needed any more."""
        self._remove_key()

    def wait_healthy(self, timeout: float = 120.0) -> None:
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        self._remove_key()  # read at startup: the file is not needed any more

    def _write_key(self, name: str, key: str | None) -> Path | None:
        """``key`` in a 0600 file of a private 0700 directory (shared by the server's keys)."""
        if not key:
            return None
        if self._key_dir is None:
            self._key_dir = Path(tempfile.mkdtemp(prefix="radix-kvctl-key-"))  # mode 0700
        path = self._key_dir / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(key + "\n")
        return path

    def _remove_key(self) -> None:
        key_dir, self._key_dir = self._key_dir, None
        if key_dir is not None:
            shutil.rmtree(key_dir, ignore_errors=True)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                self.startup_exit = self.proc.returncode
                raise ConfigError(
                    f"llama-server exited with code {self.proc.returncode} during startup:\n"
                    f"{self.log_tail()}",
                    fix="see the server log above",
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp,
            ):
                if resp.status == 200:
                    return
            time.sleep(0.2)
        raise ConfigError(
            f"llama-server did not become healthy within {timeout:.0f} s:\n{self.log_tail()}",
            fix="see the server log above",
        )

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def run_log(self) -> str:
        """This run's lines of the (appended) log; empty when it cannot be read."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def startup_refusal(self) -> tuple[str, str]:
        """(why, what to do): the one line of this run's log that says why the server did not
        start, for a user who should not have to read the whole log."""
        lines = self.run_log().splitlines()
        see = f"the whole log: {self.log_path}"
        for line in lines:
            if _KVCTL_REFUSAL in line:
                reason = line.split(_KVCTL_REFUSAL, 1)[1].strip()
                return (
                    f"the patched llama-server refuses --kvctl with these settings: {reason}",
                    f"change or drop the settings it names ({see})",
                )
        errors = [m.group(1) for m in map(_ERROR_LINE.match, lines) if m]
        if errors:
            return (
                f"llama-server did not start: {errors[0]}",
                f"check the model and the server options ({see})",
            )
        return f"llama-server exited with code {self.startup_exit} during startup", see

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process_group(proc, grace)
        self._remove_key()


def _load_prctl() -> Any:
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved here, in the parent: the child between fork and exec only calls it.
_PRCTL = _load_prctl()


def _die_with_parent(parent: int, cpus: tuple[int, ...] = ()) -> None:
    """In the child before exec: SIGKILL when the parent dies, so no server is orphaned even
    when the proxy is killed with SIGKILL (Linux; elsewhere nothing); then ``cpus``, if any, are
    the only ones it (and every thread it starts) runs on."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)


def llama_server_pids(port: int) -> list[int]:
    """Processes of llama-server whose command line names ``port`` (from /proc; Linux)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"llama-server") and str(port).encode() in argv:
            pids.append(int(entry.name))
    return pids


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
