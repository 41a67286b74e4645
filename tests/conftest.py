"""Test harness: real llama-server processes (patched and stock) with the default model.

Servers are started on free ports, waited for on /health, shared per session where tests
allow, and always stopped. A server that dies during startup fails the test with the tail
of its log.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.native.build import BuildSpec, build_server
from proxy.native.launch import ServerProcess, ServerSpec, free_port
from proxy.native.model import default_model_path
from tests.helpers import ServerFactory

# Few threads per server: this suite runs on 2 cores and several servers may be up at once.
THREADS = int(os.environ.get("RADIX_TEST_THREADS", "2"))
CTX = 8192


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def patched_bin() -> Path:
    return build_server(BuildSpec(variant="patched"))


@pytest.fixture(scope="session")
def stock_bin() -> Path:
    return build_server(BuildSpec(variant="stock"))


@pytest.fixture(scope="session")
def fault_bin() -> Path:
    return build_server(BuildSpec(variant="patched", fault_injection=True))


@pytest.fixture(scope="session")
def work_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="radix-test-") as tmp:
        yield Path(tmp)


@pytest.fixture(scope="session")
def shm_root() -> Iterator[Path]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="radix-test-", dir=base) as tmp:
        yield Path(tmp)


@pytest.fixture(scope="session")
def start_server(model_path: Path, work_dir: Path, shm_root: Path) -> Iterator[ServerFactory]:
    """``start_server(binary, kvctl=True, **ServerSpec fields)``: a started server, stopped at session end.

    Every kvctl server gets a random /kvctl key unless the test gives one (or ``insecure``):
    ``server.spec.kvctl_key``."""
    started: list[ServerProcess] = []

    def start(binary: Path, **kw: Any) -> ServerProcess:
        kw.setdefault("threads", THREADS)
        kw.setdefault("ctx_size", CTX)
        port = free_port()
        if kw.get("kvctl", True) and "kvctl_dir" not in kw:
            kw["kvctl_dir"] = shm_root / f"kv-{port}"
        if kw.get("kvctl", True) and not kw.get("insecure"):
            kw.setdefault("kvctl_key", secrets.token_hex(16))
        model = kw.pop("model", model_path)  # another architecture: tests/tinymodels.py
        spec = ServerSpec(binary=binary, model=model, port=port, **kw)
        server = ServerProcess(spec, work_dir / f"server-{port}.log")
        started.append(server)
        return server.start(timeout=180)

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def patched_server(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    """The shared patched server: -np 4 -kvu --cache-ram 0 -sps 0 --kvctl."""
    return start_server(patched_bin)


@pytest.fixture(scope="session")
def stock_server(start_server: ServerFactory, stock_bin: Path) -> ServerProcess:
    """Stock llama-server of the same commit with the same slot/pool flags (no kvctl)."""
    return start_server(stock_bin, kvctl=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = str(item.fspath)
        if "/integration/" in path:
            item.add_marker(pytest.mark.integration)
        elif "/unit/" in path:
            item.add_marker(pytest.mark.unit)
