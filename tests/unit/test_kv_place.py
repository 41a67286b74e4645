"""Where a server's KV lives (caps ``memory.buffers``, patch 0019) and what the proxy does with
it: a server whose caps cannot say is served without moves (prefill and route A only, a log line,
the reason in /health, the info metric says "unknown"); each server's measured move rates price a
host restore against computing the same tokens; the mover learns those rates from its moves."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import types
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from proxy.config import Config
from proxy.core.payload import KvSegment
from proxy.core.planner import Route
from proxy.core.segment import KvLayout
from proxy.server.api.routes import health
from proxy.server.coordinator import KvPlace
from proxy.server.dataplane.kvctl import Caps
from proxy.server.dataplane.kvctl_moves import ExportReply, ImportReply
from proxy.server.dataplane.layoutcheck import LayoutChecks
from proxy.server.dataplane.mover import KvMover
from proxy.server.metrics import Metrics
from proxy.server.ops import connect
from proxy.server.ops.health import HealthMonitor
from proxy.server.ops.runtime import RUNTIME
from tests.unit.test_coordinator import LAYOUT, FakeServer, check, coordinator, rows, server, toks
from tests.unit.test_kvctl_replies import GOOD

pytestmark = pytest.mark.unit

COMPAT = {
    "n_layer": 1,
    "v_trans": False,
    "k_types": [1],
    "v_types": [1],
    "k_row_bytes": [4],
    "v_row_bytes": [4],
}


def caps(buffers: object = "absent") -> Caps:
    obj = copy.deepcopy(GOOD["caps"])
    obj["compat"] = COMPAT
    if buffers == "absent":
        del obj["memory"]["buffers"]
    else:
        obj["memory"]["buffers"] = buffers
    return Caps.parse(obj)


def health_body(coord: Any) -> dict[str, Any]:
    request = types.SimpleNamespace(app={RUNTIME: types.SimpleNamespace(coordinator=coord)})
    response = asyncio.run(health(request))  # type: ignore[arg-type]
    body: dict[str, Any] = json.loads(response.text or "{}")
    return body


def test_a_server_that_cannot_say_where_its_kv_lives_is_served_prefill_only() -> None:
    known = caps(GOOD["caps"]["memory"]["buffers"])
    layout, off = connect._layout_or_why_not(known)
    assert layout is not None and off == ()
    for unknown in (caps([]), caps([{**GOOD["caps"]["memory"]["buffers"][0], "device": ""}]), caps()):
        layout, off = connect._layout_or_why_not(unknown)
        assert layout is None and len(off) == 1 and "/kvctl/caps" in off[0], off
        assert KvPlace.from_caps(unknown).unknown == off[0]
    # As startup sets it up: the moves-off path, the same as a sliding window's.
    s0 = server("s0", n_slots=2)
    s0.moves_off = off
    s0.kv = KvPlace.from_caps(caps())
    coord = coordinator(s0)
    prompt = toks(0, 100)
    coord.tree.insert(prompt, KvSegment.from_rows(0, LAYOUT, rows(prompt.tolist())))

    async def run() -> None:
        lease = await coord.acquire("r", np.concatenate([prompt, toks(7000, 10)]))
        assert lease.route == Route.PREFILL and lease.host is None  # the tree's prefix is not imported
        coord.release(lease)

    asyncio.run(run())
    fake: FakeServer = s0.backend  # type: ignore[assignment]
    assert fake.imports == []
    check(coord)
    entry = health_body(coord)["servers"][0]
    assert entry["kv_moves"] == "off" and entry["kv_moves_off"] == list(off), entry
    assert "no memory.buffers" in entry["kv_moves_off"][0] and "kv_devices" not in entry


def test_health_names_the_device_and_backend() -> None:
    gpu = {**GOOD["caps"]["memory"]["buffers"][0], "name": "CUDA0", "device": "CUDA0", "backend": "CUDA"}
    s0 = server("s0")
    s0.kv = KvPlace.from_caps(caps([{**gpu, "host": False}]))
    entry = health_body(coordinator(s0))["servers"][0]
    assert entry["kv_moves"] == "on"
    assert (
        entry["kv_devices"] == ["CUDA0"] and entry["kv_backends"] == ["CUDA"] and entry["kv_on_host"] is False
    )


def test_the_info_metric_follows_the_server() -> None:
    m = Metrics(CollectorRegistry(), ("s0",))
    m.set_kv_place("s0", (("CUDA0", "CUDA"), ("CPU", "CPU")))
    assert m.value("radix_server_kv_device", server="s0", device="CUDA0", backend="CUDA") == 1
    assert m.value("radix_server_kv_device", server="s0", device="CPU", backend="CPU") == 1
    m.set_kv_place("s0", ())  # reconnected, and its caps cannot say: the old series go
    assert (
        m.registry.get_sample_value(
            "radix_server_kv_device", {"server": "s0", "device": "CUDA0", "backend": "CUDA"}
        )
        is None
    )
    assert m.value("radix_server_kv_device", server="s0", device="unknown", backend="unknown") == 1


class _Client:
    """What startup asks a server for, answered from caps without ``memory.buffers``."""

    def __init__(self, url: str, *args: Any, **kwargs: Any) -> None:
        self.url = url

    async def caps(self) -> Caps:
        return caps()

    async def release(self, owner: int) -> None:
        pass

    async def slots(self, tokens: bool = False) -> Any:
        return types.SimpleNamespace(slots=())

    async def get_json(self, path: str) -> dict[str, Any]:
        return {"data": [{"id": "m"}]}


async def test_startup_serves_it_with_moves_off_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(connect, "ServerClient", _Client)
    config = Config(backends=("http://127.0.0.1:1",), kv_share=False)
    metrics = Metrics(CollectorRegistry(), ("s0",))
    with caplog.at_level(logging.WARNING, logger="radix"):
        session: Any = None  # never used: the client is replaced above
        state = await connect._connect(
            config, "s0", "http://127.0.0.1:1", session, metrics, LayoutChecks(), None
        )
    assert not state.moves and "do not say where its KV lives" in state.moves_off[0]
    assert state.mover.layout is None and state.kv.unknown == state.moves_off[0]
    assert "KV moves are off" in caplog.text and "do not say where its KV lives" in caplog.text
    assert "served with routes A and prefill only" in caplog.text
    assert metrics.value("radix_server_moves", server="s0") == 0
    assert metrics.value("radix_server_kv_device", server="s0", device="unknown", backend="unknown") == 1


async def test_a_host_restore_is_priced_against_computing_it_at_the_servers_import_rate() -> None:
    prompt = toks(0, 100)
    for rate, route in ((400e6, Route.H), (100.0, Route.PREFILL)):  # 800 bytes: 2 ms or 8 s
        s0 = server("s0", n_slots=1)
        s0.rates.import_bytes_per_s = rate
        coord = coordinator(s0)
        coord.tree.insert(prompt, KvSegment.from_rows(0, LAYOUT, rows(prompt.tolist())))
        lease = await coord.acquire("r", np.concatenate([prompt, toks(7000, 10)]))
        assert lease.route == route, rate
        coord.release(lease)
        check(coord)


BIG = KvLayout(1, (1,), (4096,), (1,), False, (4096,), (0,), (0,))  # 8 KiB per token


class _Backend:
    """The /kvctl export and import of a server, as the mover calls them, with timings."""

    def __init__(self, t_ms: float | None) -> None:
        self.t_ms = t_ms

    async def import_(self, body: Mapping[str, Any], timeout_s: float = 0.0) -> ImportReply:
        size = len(body["segments"][0]["data"])
        return ImportReply(slot=0, n_tokens=body["p1"], n_cells=body["p1"], bytes=size, t_ms=self.t_ms)

    async def export(
        self, seq: Any, p0: int, tokens: Any, file: Any, timeout_s: float, in_place: bool
    ) -> ExportReply:
        from proxy.core.payload import blob_size, write_blob

        n = len(tokens) - p0
        buf = bytearray(blob_size(BIG, n))
        write_blob([KvSegment.from_rows(p0, BIG, np.zeros((n, 8192), np.uint8))], buf)
        return ExportReply(len(buf), n, p0, len(tokens), {}, False, None, bytes(buf), self.t_ms)


async def test_the_mover_learns_the_servers_move_rates() -> None:
    mover = KvMover(_Backend(t_ms=5000.0), BIG, {}, None, Metrics(CollectorRegistry(), ("s0",)))  # type: ignore[arg-type]
    n = 256  # 2 MiB
    (segment,) = await mover.export({"slot": 0}, 0, list(range(n)))
    assert segment.n == n and mover.rates.moves_seen == 1
    # 5 s on the server for 2 MiB: the export rate falls from the prior toward 0.4 MB/s.
    assert mover.rates.export_bytes_per_s < 0.8 * 400e6 and mover.rates.import_bytes_per_s == 400e6
    await mover.import_(1, 0, list(range(n)), [segment])
    assert mover.rates.import_bytes_per_s < 0.8 * 400e6 and mover.rates.moves_seen == 2
    silent = KvMover(_Backend(t_ms=None), BIG, {}, None, Metrics(CollectorRegistry(), ("s0",)))  # type: ignore[arg-type]
    await silent.import_(1, 0, list(range(n)), [segment])
    assert silent.rates.moves_seen == 0  # a server without t_ms teaches nothing


def test_the_health_checks_follow_where_a_restarted_servers_kv_lives() -> None:
    s0 = server("s0", n_slots=4)  # as many as the caps say
    s0.mover.compat = dict(caps().compat)  # type: ignore[misc]
    s0.kv = KvPlace.from_caps(caps(GOOD["caps"]["memory"]["buffers"]))
    coord = coordinator(s0)
    monitor = HealthMonitor(coord, 1.0, 1.0)
    # Moves are on for where its KV was: a server that no longer says is kept out.
    assert "restart the proxy" in HealthMonitor._incompatible(s0, caps())
    gpu = {**GOOD["caps"]["memory"]["buffers"][0], "name": "CUDA0", "device": "CUDA0", "backend": "CUDA"}
    moved = caps([{**gpu, "host": False}])
    assert HealthMonitor._incompatible(s0, moved) == ""
    monitor._follow_kv_place(s0, moved)
    assert s0.kv.devices == ("CUDA0",) and s0.kv.host is False
    assert coord.metrics.value("radix_server_kv_device", server="s0", device="CUDA0", backend="CUDA") == 1
    s0.moves_off = ("sliding-window attention",)  # moves off already: nothing to keep it out for
    assert HealthMonitor._incompatible(s0, caps()) == ""


def test_arena_blocks_are_never_longer_than_a_slot() -> None:
    # The server refuses a chunk over its n_ctx_slot (400), which would turn moves off.
    metrics = Metrics(CollectorRegistry(), ("s0",))
    mover = KvMover(_Backend(t_ms=None), BIG, {}, None, metrics, chunk_tokens=4096, n_ctx_slot=1024)  # type: ignore[arg-type]
    assert mover.chunk_tokens == 1024
    auto = KvMover(_Backend(t_ms=None), BIG, {}, None, metrics, n_ctx_slot=100)  # type: ignore[arg-type]
    assert auto.chunk_tokens == 100
