"""The servers' own API key: handed to llama-server in a 0600 file, sent by the proxy instead of
whatever credentials a client's request carried; and no CORS grant on the server's port."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.native.launch import NO_CORS_ARGS, ServerProcess, ServerSpec
from proxy.server.dataplane.backend import ServerClient

pytestmark = pytest.mark.unit


def spec(**kw: Any) -> ServerSpec:
    return ServerSpec(binary=Path("/bin/llama-server"), model=Path("/m.gguf"), port=1, **kw)


def test_the_api_key_goes_in_a_file_never_argv() -> None:
    argv = spec(kvctl_key="kv-secret", api_key="api-secret").argv(Path("/k/key"), Path("/k/api-key"))
    assert argv[argv.index("--api-key-file") + 1] == "/k/api-key"
    assert argv[argv.index("--kvctl-key-file") + 1] == "/k/key"
    assert "api-secret" not in " ".join(argv) and "kv-secret" not in " ".join(argv)
    i = argv.index("--cors-origins")
    assert argv[i : i + len(NO_CORS_ARGS)] == NO_CORS_ARGS
    assert "--api-key-file" not in spec().argv()


def test_both_keys_are_written_owner_only(tmp_path: Path) -> None:
    process = ServerProcess(spec(kvctl_key="kv", api_key="api"), tmp_path / "log")
    kv, api = process._write_key("key", "kv"), process._write_key("api-key", "api")
    assert kv is not None and api is not None and kv.parent == api.parent
    for path, key in ((kv, "kv"), (api, "api")):
        assert path.read_text() == key + "\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(kv.parent.stat().st_mode) == 0o700
    process._remove_key()
    assert not kv.parent.exists()
    assert process._write_key("api-key", None) is None


async def test_the_proxy_sends_its_key_instead_of_the_clients() -> None:
    async with aiohttp.ClientSession() as session:
        backend = ServerClient("http://x", session, "kv", api_key="server-key")
        sent = backend.with_api_key({"authorization": "Bearer tenant", "X-Api-Key": "t", "Accept": "*/*"})
    assert sent == {"Accept": "*/*", "Authorization": "Bearer server-key"}
