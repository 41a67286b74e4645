"""Start the pieces of the workbench: the incident service (its own process) and the app."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

EXTRA_HINT = "install the workbench extra: pip install 'llama-radix-proxy[workbench]' (in a checkout: pip install -e '.[workbench]')"


def missing_extra() -> str | None:
    """Why the workbench cannot run here (LangGraph missing), or None."""
    try:
        import langgraph.graph  # noqa: F401
    except ImportError as exc:
        return f"the workbench needs LangGraph ({exc}); {EXTRA_HINT}"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


class IncidentProcess:
    """``python -m proxy.workbench.incident`` on a free port, stopped on exit."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, log: Path | None = None) -> None:
        self.host, self.port = host, port or free_port(host)
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30) -> IncidentProcess:
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 (closed with the process)
        cmd = [
            sys.executable,
            "-m",
            "proxy.workbench.incident",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--parent-pid",  # it exits when this process does, however this one ends
            str(os.getpid()),
        ]
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url + "/health", timeout_s, self.proc)
        except RuntimeError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> IncidentProcess:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
