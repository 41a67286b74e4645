"""Fixtures of the integration tests that several modules use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ProxyThread, ServerFactory, proxy_config


@pytest.fixture(scope="module")
def plain_proxy(start_server: ServerFactory, patched_bin: Path) -> Iterator[ProxyThread]:
    """A proxy in front of its own plain patched server (the default model, one slot, no
    --embeddings): what a request for a capability the server lacks meets."""
    backend = start_server(patched_bin, threads=1, n_parallel=1, ctx_size=1024)
    thread = ProxyThread(proxy_config(backend)).start()
    yield thread
    thread.stop()
