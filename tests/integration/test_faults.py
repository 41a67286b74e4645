"""Faults and load against real patched llama-servers, all traffic on loopback, every wait
bounded: a server killed between requests and restarted on its port, two servers with one
killed, a server dying mid-stream, a burst far past the queue bound, and slow readers.

Each test asserts that every request got a correct answer or a clear error, that none hung
past its deadline, and that the proxy's state is consistent afterwards (no busy slot, the
tree's invariants hold).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.errors import ConfigError
from proxy.native.launch import ServerProcess, free_port, llama_server_pids
from tests.helpers import ProxyThread, Reply, ServerFactory, chat_body, get, post, proxy_config

pytestmark = pytest.mark.integration

FAST = {
    "health_interval_s": 0.2,
    "health_timeout_s": 1.0,
    "queue_timeout_s": 60.0,
    "min_restore_tokens": 32,
    "cache_ram_mib": 128,
}
DOC = (
    "The turbine log for unit seven shows pressure rising through the night shift, the valve audit "
    "found two sensors out of calibration, and the copper lattice in the inverter was replaced. "
) * 4


def messages(question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"Maintenance notes:\n{DOC}"},
        {"role": "user", "content": question},
    ]


def start_proxy(*servers: ServerProcess, **over: Any) -> ProxyThread:
    return ProxyThread(proxy_config(*servers, **{**FAST, **over})).start()


def settled(proxy: ProxyThread) -> None:
    proxy.settle()
    proxy.call(lambda rt: rt.coordinator.tree.check_invariants())
    busy = proxy.call(
        lambda rt: [(sv.name, s.slot_id) for sv in rt.coordinator.servers for s in sv.slots if s.busy]
    )
    assert busy == []


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def restart(server: ServerProcess, work_dir: Path) -> ServerProcess:
    """The same spec (port, model, key) as a new process."""
    return ServerProcess(server.spec, work_dir / f"server-{server.spec.port}-again.log").start(timeout=180)


@pytest.fixture
def lone_server(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    return start_server(patched_bin, n_parallel=2)


def test_a_killed_server_is_restarted_on_its_port_and_nothing_is_lost(
    lone_server: ServerProcess, work_dir: Path
) -> None:
    proxy = start_proxy(lone_server)
    again: ServerProcess | None = None
    try:
        first = post(f"{proxy.url}/v1/chat/completions", chat_body(messages("Which unit?"), 8))
        assert first.status == 200
        settled(proxy)
        assert lone_server.proc is not None
        lone_server.proc.kill()
        lone_server.proc.wait(10)
        wait_for(lambda: get(f"{proxy.url}/health").status == 503, 10, "/health to say 503")
        # A request sent while the server is dead waits (bounded) for it to come back.
        result: dict[str, Reply] = {}
        sender = threading.Thread(
            target=lambda: result.update(
                r=post(
                    f"{proxy.url}/v1/chat/completions", chat_body(messages("Which valve?"), 8), timeout=120
                )
            )
        )
        sender.start()
        time.sleep(1.0)
        again = restart(lone_server, work_dir)
        sender.join(150)
        assert not sender.is_alive(), "the request hung"
        assert result["r"].status == 200, result["r"].body
        assert get(f"{proxy.url}/health").body["status"] == "ok"
        settled(proxy)
        # The host tree outlived the server: the notes come back from it, not from a prefill.
        warm = post(f"{proxy.url}/v1/chat/completions", chat_body(messages("Which sensors?"), 8))
        assert warm.status == 200 and warm.headers["X-Radix-Route"] in ("A", "H", "A+H"), (
            warm.headers,
            proxy.call(lambda rt: [d.summary() for d in rt.coordinator.log.decisions]),
        )
        assert warm.body["timings"]["cache_n"] > 100, warm.body["timings"]
        settled(proxy)
    finally:
        proxy.stop()
        if again is not None:
            again.stop()


def test_two_servers_one_killed_no_request_fails(start_server: ServerFactory, patched_bin: Path) -> None:
    key = secrets.token_hex(16)  # one proxy, one key for its servers
    a, b = (start_server(patched_bin, n_parallel=2, kvctl_key=key) for _ in range(2))
    proxy = start_proxy(a, b)
    try:
        assert post(f"{proxy.url}/v1/chat/completions", chat_body(messages("Which unit?"), 4)).status == 200
        assert a.proc is not None
        a.proc.kill()
        a.proc.wait(10)
        # Sent at once, before the health check noticed: a request routed to the dead server is
        # retried on the other one; none gets a 5xx.
        statuses = [
            post(f"{proxy.url}/v1/chat/completions", chat_body(messages(f"Question {i}?"), 4)).status
            for i in range(6)
        ]
        assert statuses == [200] * 6
        health = get(f"{proxy.url}/health")
        assert health.status == 200 and health.body["status"] == "degraded"
        settled(proxy)
    finally:
        proxy.stop()


def test_a_server_dying_mid_stream_ends_the_stream_cleanly(lone_server: ServerProcess) -> None:
    proxy = start_proxy(lone_server)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.config.port, timeout=60)
        body = {**chat_body(messages("Write a long report on every unit."), 400), "stream": True}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: ")
        assert lone_server.proc is not None
        lone_server.proc.kill()
        rest = resp.read()  # ends: no hang, no second HTTP response inside the body
        events = [line for line in rest.split(b"\n") if line.startswith(b"data: ")]
        error = json.loads(events[-1][6:])["error"]
        assert error["code"] == 502 and "mid-stream" in error["message"]
        assert b"HTTP/1.1" not in rest
        settled(proxy)
    finally:
        proxy.stop()


def test_a_burst_far_past_the_queue_is_answered_or_refused_fast(
    start_server: ServerFactory, patched_bin: Path
) -> None:
    server = start_server(patched_bin)  # 4 slots
    proxy = start_proxy(server, max_queue=8)

    async def burst() -> list[tuple[int, str | None, bool]]:
        timeout = aiohttp.ClientTimeout(total=180)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def one(i: int) -> tuple[int, str | None, bool]:
                body = chat_body([{"role": "user", "content": f"Say {i}."}], 1)
                async with session.post(f"{proxy.url}/v1/chat/completions", json=body) as resp:
                    data = await resp.json()
                    ok = resp.status != 200 or bool(data["choices"][0]["message"])
                    return resp.status, resp.headers.get("Retry-After"), ok

            return await asyncio.gather(*(one(i) for i in range(500)))

    try:
        results = asyncio.run(burst())
        statuses = [s for s, _, _ in results]
        assert set(statuses) <= {200, 429, 503}, set(statuses)
        assert statuses.count(200) >= 12  # the slots and the queue were used
        assert statuses.count(429) > 0  # and the bound held
        assert all(ok for _, _, ok in results)
        assert all(retry for s, retry, _ in results if s in (429, 503))
        settled(proxy)
        assert proxy.call(lambda rt: rt.coordinator.leases.waiting()) == 0
    finally:
        proxy.stop()


def _slow_stream(port: int, question: str, out: dict[str, Any]) -> None:
    """A streaming client with a tiny receive buffer that reads a little at a time."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = json.dumps({**chat_body(messages(question), 160, top_logprobs=10), "stream": True}).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
    )
    data = b""
    while chunk := sock.recv(512):
        data += chunk
        time.sleep(0.02)
    sock.close()
    out["data"], out["done_at"] = data, time.monotonic()


def test_slow_readers_do_not_hold_slots(start_server: ServerFactory, patched_bin: Path) -> None:
    server = start_server(patched_bin, n_parallel=2)
    proxy = start_proxy(server)
    try:
        outs: list[dict[str, Any]] = [{} for _ in range(2)]
        readers = [
            threading.Thread(
                target=_slow_stream, args=(proxy.config.port, f"Report {i} on every unit.", outs[i])
            )
            for i in range(2)
        ]
        for t in readers:
            t.start()
        wait_for(
            lambda: proxy.call(lambda rt: sum(s.busy for s in rt.coordinator.servers[0].slots)) == 2,
            60,
            "both leased",
        )
        # The server finishes long before the slow clients have read the answer: the slots
        # are saved and released then, and another request is served meanwhile.
        wait_for(
            lambda: proxy.call(lambda rt: sum(s.busy for s in rt.coordinator.servers[0].slots)) == 0,
            120,
            "slots released while clients still read",
        )
        assert any(t.is_alive() for t in readers), "the readers were not slow enough to show anything"
        quick = post(f"{proxy.url}/v1/chat/completions", chat_body([{"role": "user", "content": "Hi."}], 2))
        assert quick.status == 200
        for t in readers:
            t.join(300)
        for out in outs:
            # The whole answer arrived (chunked transfer encoding: [DONE], then the last chunk).
            assert b"data: [DONE]" in out["data"] and out["data"].endswith(b"0\r\n\r\n"), out["data"][-200:]
        settled(proxy)
    finally:
        proxy.stop()


def test_a_stopped_server_makes_requests_fail_fast_and_it_is_used_again_after(
    lone_server: ServerProcess,
) -> None:
    proxy = start_proxy(lone_server, backend_read_timeout_s=3.0, queue_timeout_s=3.0)
    assert lone_server.proc is not None
    pid = lone_server.proc.pid
    try:
        assert post(f"{proxy.url}/v1/chat/completions", chat_body(messages("Which unit?"), 4)).status == 200
        settled(proxy)
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        reply = post(f"{proxy.url}/v1/chat/completions", chat_body(messages("Which valve?"), 4), timeout=60)
        assert reply.status == 503 and reply.headers.get("Retry-After"), reply.body
        assert time.monotonic() - started < 30  # bounded by the read and queue deadlines, not the client
        assert get(f"{proxy.url}/health").status == 503
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: get(f"{proxy.url}/health").status == 200, 30, "the server to be used again")
        again = post(f"{proxy.url}/v1/chat/completions", chat_body(messages("Which unit?"), 4))
        assert again.status == 200
        # The same process came back (same instance): what its slots hold was kept.
        assert again.headers["X-Radix-Route"] in ("A", "A+H", "H")
        settled(proxy)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        proxy.stop()


def _up(port: int, server_port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "up",
            "--port",
            str(port),
            "--server-port",
            str(server_port),
            "-t",
            "2",
            "-c",
            "4096",
            "-np",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def serving() -> bool:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        return _listening(port) and get(f"http://127.0.0.1:{port}/health", timeout=2).status == 200

    wait_for(serving, 240, "radixctl up to serve")
    return proc


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_up_restarts_a_killed_server_and_stops_gracefully(patched_bin: Path, model_path: Path) -> None:
    port, server_port = free_port(), free_port()
    proc = _up(port, server_port)
    url = f"http://127.0.0.1:{port}"
    try:
        (pid,) = llama_server_pids(server_port)
        os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda: llama_server_pids(server_port) not in ([], [pid]), 60, "llama-server to be restarted"
        )
        wait_for(lambda: get(f"{url}/health", timeout=2).status == 200, 120, "the restarted server to serve")
        assert post(f"{url}/v1/chat/completions", chat_body(messages("Which unit?"), 4)).status == 200
        # SIGTERM while a long answer streams: it completes, then everything stops.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({**chat_body(messages("Write a report on every unit."), 48), "stream": True}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        assert b"data: [DONE]" in resp.read()
        assert proc.wait(60) == 0
        assert llama_server_pids(server_port) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_killed_proxy_leaves_no_server(patched_bin: Path, model_path: Path) -> None:
    port, server_port = free_port(), free_port()
    proc = _up(port, server_port)
    try:
        assert len(llama_server_pids(server_port)) == 1
        proc.kill()  # SIGKILL: no cleanup code runs in the proxy
        proc.wait(10)
        wait_for(lambda: llama_server_pids(server_port) == [], 10, "the server to die with its proxy")
    finally:
        for pid in llama_server_pids(server_port):
            os.kill(pid, signal.SIGKILL)
        # What the killed proxy could not remove: its payload directory (radixctl up's default,
        # radix-<uid>-<port>- and a random suffix).
        for left in Path("/dev/shm").glob(f"radix-{os.getuid()}-{port}-*"):
            shutil.rmtree(left, ignore_errors=True)


def test_a_server_back_with_another_kv_type_is_kept_out(lone_server: ServerProcess, work_dir: Path) -> None:
    proxy = start_proxy(lone_server, queue_timeout_s=3.0)
    other: ServerProcess | None = None
    try:
        assert post(f"{proxy.url}/v1/chat/completions", chat_body(messages("Which unit?"), 4)).status == 200
        settled(proxy)
        assert lone_server.proc is not None
        lone_server.proc.kill()
        lone_server.proc.wait(10)
        spec = dataclasses.replace(lone_server.spec, extra_args=("-ctk", "q8_0"))
        other = ServerProcess(spec, work_dir / f"server-{spec.port}-q8.log").start(timeout=180)
        wait_for(
            lambda: "another model or KV layout" in json.dumps(get(f"{proxy.url}/health").body),
            30,
            "the server to be kept out",
        )
        health = get(f"{proxy.url}/health")
        assert health.status == 503
        reply = post(f"{proxy.url}/v1/chat/completions", chat_body(messages("Which valve?"), 4), timeout=120)
        assert reply.status == 503  # never answered from KV of another layout
        settled(proxy)
    finally:
        proxy.stop()
        if other is not None:
            other.stop()


def test_a_full_payload_dir_falls_back_and_keeps_serving(
    start_server: ServerFactory, patched_bin: Path, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    tiny = tmp_path / "tiny"
    tiny.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(tiny)], check=True)
    try:
        server = start_server(patched_bin, n_parallel=2, kvctl_dir=tiny)
        # No room for a KV arena of --cache-ram there: a startup error naming the size and the fix.
        with pytest.raises(ConfigError) as err:
            start_proxy(server)
        assert "128 MiB KV arena" in err.value.message and "--kv-arena off" in (err.value.fix or "")
        assert not [p for p in tiny.iterdir() if p.name.startswith("radix-arena-")]
        proxy = start_proxy(server, kv_arena=False)  # payload files, which do not fit either
        try:
            for seed in range(3):
                q = f"Question {seed}: which unit, which valve, which sensor?"
                assert post(f"{proxy.url}/v1/chat/completions", chat_body(messages(q), 4)).status == 200
                proxy.settle()
            again = post(f"{proxy.url}/v1/chat/completions", chat_body(messages("Which valve?"), 4))
            assert again.status == 200
            settled(proxy)
            fallbacks = proxy.call(
                lambda rt: sum(
                    rt.metrics.value("radix_fallbacks_total", cause=c)
                    for c in ("export", "no_space", "transport")
                )
            )
            assert fallbacks > 0  # the saves did not fit: counted, not crashed
            assert get(f"{proxy.url}/health").status == 200
        finally:
            proxy.stop()
            server.stop()
    finally:
        # Lazily: something of this process may still hold the directory open (the umount then
        # failed with EBUSY and each run left a tmpfs mounted under /tmp).
        subprocess.run(["umount", "-l", str(tiny)], check=False)


def test_a_server_that_starts_after_the_proxy_is_taken_in(
    start_server: ServerFactory, patched_bin: Path, work_dir: Path
) -> None:
    first = start_server(patched_bin, n_parallel=1)
    late_spec = dataclasses.replace(first.spec, port=free_port())
    proxy = ProxyThread(_two(first, late_spec)).start()
    late: ServerProcess | None = None
    try:
        health = get(f"{proxy.url}/health")
        assert health.status == 200 and health.body["status"] == "ok"  # the late one is not known yet
        assert post(f"{proxy.url}/v1/chat/completions", chat_body(messages("Which unit?"), 4)).status == 200
        late = ServerProcess(late_spec, work_dir / f"server-{late_spec.port}-late.log").start(timeout=180)
        wait_for(lambda: proxy.call(lambda rt: len(rt.coordinator.servers)) == 2, 30, "the late server")
        # Two requests at once: one slot each; the second goes to the late server.
        results: list[Any] = []
        threads = [
            threading.Thread(
                target=lambda q=q: results.append(
                    post(f"{proxy.url}/v1/chat/completions", chat_body(messages(q), 16))
                )
            )
            for q in ("A?", "B?")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [r.status for r in results] == [200, 200]
        assert {r.headers["X-Radix-Server"] for r in results} == {"s0", "s1"}
        settled(proxy)
    finally:
        proxy.stop()
        if late is not None:
            late.stop()


def _two(first: ServerProcess, late: Any) -> Any:
    """A proxy config naming a running server and one that is not started yet."""
    config = proxy_config(first, **FAST)
    return dataclasses.replace(config, backends=(first.url, late.url))


def test_a_kill_during_a_restore_or_a_save_loses_nothing(lone_server: ServerProcess, work_dir: Path) -> None:
    """The server is killed right after answers (while the proxy saves them) and right after a
    request that restores from the host tree was sent; whatever was in flight, every request
    gets an answer or a clear error, nothing hangs, and the tree stays valid and usable."""
    proxy = start_proxy(lone_server)
    server = lone_server
    try:
        for seed in range(2):
            assert (
                post(f"{proxy.url}/v1/chat/completions", chat_body(messages(f"Unit {seed}?"), 4)).status
                == 200
            )
        # During a save: the answer is back, its KV export has just started.
        reply = post(f"{proxy.url}/v1/chat/completions", chat_body(messages("Unit 9?"), 4))
        assert reply.status == 200
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait(10)
        proxy.settle()  # the save fails fast (counted), the slot is released
        settled(proxy)
        server = restart(server, work_dir)
        wait_for(lambda: get(f"{proxy.url}/health").status == 200, 30, "the restarted server")
        # During a restore: sent, then the server dies while the proxy imports from the tree.
        result: dict[str, Reply] = {}
        sender = threading.Thread(
            target=lambda: result.update(
                r=post(
                    f"{proxy.url}/v1/chat/completions", chat_body(messages("Unit 0 again?"), 4), timeout=150
                )
            )
        )
        sender.start()
        time.sleep(0.05)
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait(10)
        server = restart(server, work_dir)
        sender.join(160)
        assert not sender.is_alive()
        assert result["r"].status in (200, 502, 503), result["r"].body
        settled(proxy)
        after = post(f"{proxy.url}/v1/chat/completions", chat_body(messages("Unit 1 again?"), 4))
        assert after.status == 200
        settled(proxy)
    finally:
        proxy.stop()
        if server is not lone_server:
            server.stop()
