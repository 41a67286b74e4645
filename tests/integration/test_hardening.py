"""Bounds on what one request can make the proxy hold and a server do, against real patched
llama-servers: answers larger than the proxy holds are cut with a clear error, a request
after which its server died is answered 502 and never sent again; /metrics, an oracle for
other clients' cache hits, follows the admin rule (or has its own port); and idle, slow and
too many client connections are cut.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.native.launch import ServerProcess, free_port
from tests.helpers import ProxyThread, ServerFactory, get, post, proxy_config, request

pytestmark = pytest.mark.integration

PROMPT = "Write a long story about a lighthouse keeper and the sea."
ANSWER_CAP = 16 << 10


@pytest.fixture(scope="module")
def backend(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    return start_server(patched_bin, n_parallel=2)


@pytest.fixture
def capped(backend: ServerProcess) -> Iterator[ProxyThread]:
    proxy = ProxyThread(proxy_config(backend, max_answer_bytes=ANSWER_CAP)).start()
    yield proxy
    proxy.stop()


def _metric(proxy: ProxyThread, name: str, **labels: str) -> float:
    value = proxy.call(lambda rt: rt.metrics.registry.get_sample_value(name, labels))
    return float(value or 0.0)


def test_an_answer_larger_than_the_proxy_holds_is_cut_with_a_502(capped: ProxyThread) -> None:
    # 64 tokens with 20 log-probabilities each: well over 16 KiB of JSON.
    body = {"prompt": PROMPT, "n_predict": 64, "n_probs": 20, "temperature": 0, "ignore_eos": True}
    reply = post(f"{capped.url}/completion", body)
    assert reply.status == 502, reply.body
    assert "--max-answer" in reply.body["error"]["message"]
    # The same through the read-only pass-through: every token's piece of a long text.
    tok = post(f"{capped.url}/tokenize", {"content": PROMPT * 200, "with_pieces": True})
    assert tok.status == 502 and "--max-answer" in tok.body["error"]["message"]
    capped.settle()
    small = post(f"{capped.url}/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0})
    assert small.status == 200, small.body
    capped.settle()
    assert (
        capped.call(lambda rt: [s.slot_id for sv in rt.coordinator.servers for s in sv.slots if s.busy]) == []
    )


def test_a_streamed_event_larger_than_the_proxy_holds_ends_the_stream(backend: ServerProcess) -> None:
    proxy = ProxyThread(proxy_config(backend, max_answer_bytes=1024)).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.config.port, timeout=120)
        body = {"prompt": PROMPT, "n_predict": 8, "n_probs": 20, "stream": True, "ignore_eos": True}
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        events = [line for line in raw.split(b"\n") if line.startswith(b"data: ")]
        error = json.loads(events[-1][6:])["error"]
        assert error["code"] == 502 and "--max-answer" in error["message"]
        proxy.settle()
    finally:
        proxy.stop()


def test_a_request_that_kills_its_server_is_not_retried(
    start_server: ServerFactory, patched_bin: Path
) -> None:
    server = start_server(patched_bin, n_parallel=2)
    # The proxy's grammar bounds lifted, so the bomb reaches the server's recursive parser.
    config = proxy_config(
        server,
        max_grammar_bytes=8 << 20,
        max_grammar_depth=1 << 30,
        max_body_mib=8,
        queue_timeout_s=30.0,
        health_interval_s=0.2,
    )
    proxy = ProxyThread(config).start()
    try:
        bomb = "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000
        started = time.monotonic()
        reply = post(
            f"{proxy.url}/completion", {"prompt": PROMPT, "n_predict": 2, "grammar": bomb}, timeout=120
        )
        elapsed = time.monotonic() - started
        assert server.proc is not None and server.proc.wait(10) is not None, (
            "the bomb did not kill the server"
        )
        # Before: retried once, so the request waited for a server to come back (and would have
        # killed it again), then got a 503 after --queue-timeout.
        assert reply.status == 502, reply.body
        assert "not retried" in reply.body["error"]["message"]
        assert elapsed < 20, elapsed
        assert _metric(proxy, "radix_poison_requests_total", server="s0") == 1.0
    finally:
        proxy.stop()


def test_metrics_follow_the_admin_rule_or_their_own_port(backend: ServerProcess) -> None:
    key = "admin-secret"
    config = proxy_config(backend, admin_key=key, metrics_port=free_port())
    proxy = ProxyThread(config).start()
    try:
        reply = post(f"{proxy.url}/completion", {"prompt": PROMPT, "n_predict": 2})
        assert reply.status == 200
        # A random id: a counter told each client how many requests others sent meanwhile.
        ids = [
            reply.headers["X-Request-Id"],
            post(f"{proxy.url}/completion", {"prompt": PROMPT, "n_predict": 2}).headers["X-Request-Id"],
        ]
        assert all(re.fullmatch(r"r[0-9a-f]{16}", i) for i in ids) and ids[0] != ids[1]
        # Before, /metrics answered anyone on the client port: a repeated request moved
        # radix_cached_tokens_total by exactly its hit, --cache-info off or not.
        assert get(f"{proxy.url}/metrics").status == 401
        keyed = request(f"{proxy.url}/metrics", headers={"Authorization": f"Bearer {key}"})
        assert keyed.status == 200 and "radix_cached_tokens_total" in keyed.body
        scraped = get(f"http://127.0.0.1:{config.metrics_port}/metrics")
        assert scraped.status == 200 and "radix_cached_tokens_total" in scraped.body
        other = get(f"http://127.0.0.1:{config.metrics_port}/v1/models")
        assert other.status == 404 and other.body["error"]["code"] == 404
        proxy.settle()
    finally:
        proxy.stop()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the proxy closed ``sock`` (EOF or reset) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def test_slow_idle_and_too_many_connections_are_cut(backend: ServerProcess) -> None:
    config = proxy_config(
        backend, idle_timeout_s=1.0, body_timeout_s=1.0, max_connections=64, max_connections_per_client=4
    )
    proxy = ProxyThread(config).start()
    port = config.port
    try:
        # Before: every one of these was still connected after 100 s (aiohttp's keep-alive
        # timeout is an hour, and nothing bounded a body).
        idle = socket.create_connection(("127.0.0.1", port))
        assert _closed_within(idle, 5), "an idle connection was not closed"
        slow_head = socket.create_connection(("127.0.0.1", port))
        slow_head.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        for i in range(4):  # a header line every 0.5 s: never a complete head
            time.sleep(0.5)
            with contextlib.suppress(OSError):
                slow_head.sendall(f"X-Slow-{i}: 1\r\n".encode())
        assert _closed_within(slow_head, 5), "a head sent a line at a time was not cut"
        slow_body = socket.create_connection(("127.0.0.1", port))
        slow_body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        slow_body.settimeout(5)
        answer = slow_body.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer, answer[:200]
        assert _closed_within(slow_body, 5)
        # Four connections from this address are the most: a fifth is closed at once, and
        # requests go through again once they are gone.
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        time.sleep(0.2)
        fifth = socket.create_connection(("127.0.0.1", port))
        assert _closed_within(fifth, 2), "a connection past the per-client cap was kept"
        for sock in held:
            sock.close()
        time.sleep(0.2)
        assert get(f"{proxy.url}/health").status == 200
        assert proxy.call(lambda rt: None) is None
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert soft == hard or soft >= config.max_connections + 256  # raised at start
    finally:
        proxy.stop()


def test_a_read_only_body_over_the_bound_is_413(backend: ServerProcess) -> None:
    proxy = ProxyThread(proxy_config(backend)).start()  # the default bound: 1 MiB
    try:
        reply = post(f"{proxy.url}/tokenize", {"content": "x" * (1 << 20)})
        assert reply.status == 413 and "--max-passthrough-body" in reply.body["error"]["message"], reply.body
        assert post(f"{proxy.url}/tokenize", {"content": "x" * 1000}).status == 200
    finally:
        proxy.stop()
