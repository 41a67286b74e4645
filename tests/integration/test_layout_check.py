"""The startup layout check on a busy server: no verdict is not a verdict.

A server whose every slot is busy when the proxy starts (one slot, a long answer running on it)
cannot be checked yet. The proxy must not turn KV moves off for good on that (a server restarted
under load would lose its moves until the proxy restarts): it waits, checks once a slot is idle,
and serves with moves on.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.helpers import ProxyThread, Reply, ServerFactory, get, post, proxy_config


def test_a_busy_server_is_checked_once_a_slot_is_idle(start_server: ServerFactory, patched_bin: Path) -> None:
    server = start_server(patched_bin, n_parallel=1, ctx_size=2048)
    answer: list[Reply] = []
    headers = {"Authorization": f"Bearer {server.spec.api_key}"} if server.spec.api_key else None
    long_answer = threading.Thread(
        target=lambda: answer.append(
            post(
                f"{server.url}/completion",
                {"prompt": "Count slowly:", "n_predict": 160, "ignore_eos": True, "temperature": 0},
                headers=headers,
                timeout=300,
            )
        )
    )
    long_answer.start()
    deadline = time.monotonic() + 60
    while not any(s.get("is_processing") for s in get(f"{server.url}/slots").body):
        assert time.monotonic() < deadline, "the long answer never took the slot"
        time.sleep(0.05)

    proxy = ProxyThread(proxy_config(server, startup_timeout_s=300)).start()
    try:
        long_answer.join(300)
        assert answer and answer[0].status == 200, answer
        # The check waited for the slot (the proxy could not start before it was free) and then
        # found the layout exact: moves are on.
        assert proxy.call(lambda rt: rt.coordinator.servers[0].moves_off) == ()
        assert proxy.call(lambda rt: rt.metrics.server_moves.labels("s0")._value.get()) == 1
        entry = get(f"{proxy.url}/health").body["servers"][0]
        assert entry["kv_moves"] == "on", entry
        # Where its KV lives, from its caps (patch 0019), in /health and the info metric.
        assert entry["kv_devices"] == ["CPU"] and entry["kv_backends"] == ["CPU"], entry
        assert entry["kv_on_host"] is True, entry
        assert (
            proxy.call(
                lambda rt: rt.metrics.value(
                    "radix_server_kv_device", server="s0", device="CPU", backend="CPU"
                )
            )
            == 1
        )
    finally:
        proxy.stop()
        server.stop()
