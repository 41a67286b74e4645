"""A local Valkey (or Redis) server for the shared KV tier: what ``radixctl bench cluster`` and
the remote-tier tests run the proxies' ``--cache-remote`` against.

The binary is Debian's (``make valkey``: ``valkey-server`` where the distribution has it,
else ``redis-server``). The store runs as a cache: no snapshots, no append-only file, bound
to loopback, in a directory of its own; it is the caller's to stop.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from proxy.errors import ConfigError
from proxy.native.launch import free_port, stop_process_group

STORE_BINARIES = ("valkey-server", "redis-server")


def store_binary() -> str | None:
    """The first of ``STORE_BINARIES`` on PATH, or None."""
    for name in STORE_BINARIES:
        found = shutil.which(name)
        if found:
            return found
    return None


def ping(port: int, timeout: float = 1.0) -> bool:
    """Whether a store answers PING on loopback ``port`` (an inline RESP command)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class StoreProcess:
    """One store on a free loopback port; ``start`` again after ``kill`` reuses the port."""

    def __init__(self, directory: Path, port: int | None = None, maxmemory_mib: int = 0) -> None:
        binary = store_binary()
        if binary is None:
            raise ConfigError(
                "neither valkey-server nor redis-server is installed",
                fix="make valkey (Debian: apt-get install redis-server)",
            )
        self.binary = binary
        self.dir = directory
        self.port = port or free_port()
        self.maxmemory_mib = maxmemory_mib
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.dir / "store.log"

    def argv(self) -> list[str]:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.dir)]
        if self.maxmemory_mib:  # a cache: the least recently used entries go first
            args += ["--maxmemory", f"{self.maxmemory_mib}mb", "--maxmemory-policy", "allkeys-lru"]
        return args

    def start(self, timeout: float = 30.0) -> StoreProcess:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError(
                    f"the store exited with code {self.proc.returncode}:\n{self._tail()}",
                    fix=f"see {self.log_path}",
                )
            if ping(self.port):
                return self
            time.sleep(0.05)
        self.kill()
        raise ConfigError(f"the store did not answer within {timeout:.0f} s", fix=f"see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing is written."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)

    def _tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""
