"""The trust boundary, tried as an attacker would, through the proxy, against a real patched
llama-server with the default model.

Each attack must be refused in llama-server's error shape, and leave every slot (its tokens
and the KV it holds, re-exported byte for byte), the host tree and the answer to a canary
prompt unchanged. Two tenants (cache-isolation keys) never reuse each other's KV, not even
through the server's own prefix reuse.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.native.launch import ServerProcess
from tests.helpers import (
    ProxyThread,
    Reply,
    ServerFactory,
    assert_same_answer,
    chat_body,
    post,
    proxy_config,
    request,
    slots_keep_kv,
)

pytestmark = pytest.mark.integration

CANARY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours of the rainbow, comma separated."},
]
HEADER_TOKENS = 8  # "<|im_start|>system\n" and the like: shorter than any part of the memo
SECRET = (
    "Internal memo for tenant A only: the launch code word is PERIWINKLE and the budget is 4.2 million. " * 6
)


@pytest.fixture(scope="module")
def backend(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    # Keyed as `radixctl up` starts it: every call the proxy makes below carries the key.
    return start_server(patched_bin, api_key=secrets.token_hex(16))


@pytest.fixture(scope="module")
def proxy(backend: ServerProcess) -> Iterator[ProxyThread]:
    assert backend.spec.kvctl_dir is not None
    config = proxy_config(backend, max_body_mib=1)
    thread = ProxyThread(config).start()
    yield thread
    thread.stop()


def canary(proxy: ProxyThread) -> Reply:
    reply = post(f"{proxy.url}/v1/chat/completions", chat_body(CANARY, 12))
    assert reply.status == 200, reply.body
    proxy.settle()
    return reply


def snapshot(proxy: ProxyThread, backend: ServerProcess) -> dict[str, Any]:
    """Every slot's tokens and a hash of the KV it really holds, and the tree's totals."""
    proxy.settle()

    async def take(rt: Any) -> dict[str, Any]:
        server = rt.coordinator.servers[0]
        slots = {}
        for slot in server.slots:
            kv = b""
            if len(slot.tokens):
                async with server.move_lock:
                    run = await server.mover.export({"slot": slot.slot_id}, 0, slot.tokens)
                kv = b"".join(seg.rows().tobytes() for seg in run)
            slots[slot.slot_id] = (slot.tokens.tolist(), hashlib.sha256(kv).hexdigest())
        stats = rt.coordinator.tree.stats()
        return {"slots": slots, "tree": (stats.nodes, stats.unique_tokens, stats.bytes)}

    assert proxy.runtime is not None
    return proxy.run(take(proxy.runtime))


@pytest.fixture
def unchanged(proxy: ProxyThread, backend: ServerProcess) -> Iterator[None]:
    """The attack in the test body must change nothing a later request depends on."""
    before_answer = canary(proxy)
    before = snapshot(proxy, backend)
    yield
    assert snapshot(proxy, backend) == before
    assert_same_answer(canary(proxy), before_answer)


def assert_error_shape(reply: Reply, status: int, what: str = "") -> None:
    assert reply.status == status, (what, reply.status, reply.body)
    err = reply.body["error"]
    assert set(err) >= {"code", "message", "type"} and err["code"] == status and err["message"]


CONTROL = [
    ("GET", "/kvctl/slots?tokens=1", None),
    ("GET", "/kvctl/caps", None),
    ("GET", "/kvctl/cells", None),
    ("POST", "/kvctl/erase", {"slot": 0}),
    ("POST", "/kvctl/export", {"slot": 0, "p0": 0, "p1": 4}),
    ("POST", "/kvctl/import", {"slot": 0, "p0": 0, "tokens": [1], "segments": []}),
    ("POST", "/kvctl/publish", {"slot": 0, "owner": 4, "n": 4}),
    ("GET", "/slots", None),
    ("POST", "/slots/0?action=erase", {}),
    ("POST", "/props", {"n_ctx": 1}),
    ("GET", "/lora-adapters", None),
    ("POST", "/lora-adapters", [{"id": 0, "scale": 1.0}]),
    ("GET", "/metrics/../kvctl/slots", None),
]


def test_control_and_unsteered_paths_are_closed(proxy: ProxyThread, unchanged: None) -> None:
    # One snapshot around every attack: each canary and snapshot costs a generation.
    for method, path, body in CONTROL:
        assert_error_shape(request(f"{proxy.url}{path}", method, body), 404, f"{method} {path}")


def test_cors_preflight_to_the_control_api_is_not_granted(proxy: ProxyThread) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.config.port, timeout=30)
    conn.request(
        "OPTIONS",
        "/kvctl/erase",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 404
    assert resp.getheader("Access-Control-Allow-Origin") is None
    assert resp.getheader("Access-Control-Allow-Credentials") is None


SIDE_DOOR = [
    ("POST", "/completion", {"prompt": "hi", "n_predict": 0, "id_slot": 0}),
    ("GET", "/slots", None),
    ("POST", "/tokenize", {"content": "hi"}),
    ("GET", "/props", None),
]


def test_the_servers_own_port_is_keyed_and_grants_no_origin(backend: ServerProcess) -> None:
    # Before, anyone who reached the port read timings.cache_n of any slot (a cross-tenant
    # oracle) and could break the proxy's saves.
    evil = {"Origin": "http://evil.example"}
    for method, path, body in SIDE_DOOR:
        reply = request(f"{backend.url}{path}", method, body, headers=evil)
        assert reply.status == 401, (method, path, reply.status, reply.body)
        assert reply.headers.get("Access-Control-Allow-Origin", "") in ("",)
        assert reply.headers.get("Access-Control-Allow-Credentials") != "true"
    conn = http.client.HTTPConnection("127.0.0.1", backend.spec.port, timeout=30)
    conn.request("OPTIONS", "/completion", headers={**evil, "Access-Control-Request-Method": "POST"})
    resp = conn.getresponse()
    resp.read()
    assert resp.getheader("Access-Control-Allow-Origin", "") == ""
    assert resp.getheader("Access-Control-Allow-Credentials") != "true"


def test_health_on_the_client_port_names_no_server_url(proxy: ProxyThread, backend: ServerProcess) -> None:
    reply = request(f"{proxy.url}/health")
    assert reply.status == 200 and reply.body["servers"][0]["name"] == "s0"
    assert str(backend.spec.port) not in json.dumps(reply.body)


def test_admin_api_and_metrics_refuse_a_rebound_host_and_unplain_paths(proxy: ProxyThread) -> None:
    for path in ("/radix/routes", "/metrics"):
        assert request(f"{proxy.url}{path}").status == 200  # loopback, by a loopback name
        # A page whose name was rebound to 127.0.0.1: local by address, not by name.
        rebound = request(f"{proxy.url}{path}", headers={"Host": "evil.example:8080"})
        assert_error_shape(rebound, 403, path)
    for path in ("/%72adix/routes", "//radix/routes", "/v1/../radix/routes", "/%6bvctl/caps"):
        conn = http.client.HTTPConnection("127.0.0.1", proxy.config.port, timeout=30)
        conn.request("GET", path)  # sent as written (urllib would not normalize either)
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 404 and body["error"]["code"] == 404, (path, resp.status, body)


def test_read_only_paths_still_pass(proxy: ProxyThread) -> None:
    assert request(f"{proxy.url}/v1/models").status == 200
    tok = post(f"{proxy.url}/tokenize", {"content": "hello world"})
    assert tok.status == 200 and tok.body["tokens"]


BAD_COMPLETIONS = [
    ("/v1/chat/completions", {**chat_body(CANARY, 4), "n": 2}, 400),
    ("/v1/chat/completions", {**chat_body(CANARY, 4), "n_cmpl": 2}, 400),
    ("/v1/completions", {"prompt": "a", "n": 3, "max_tokens": 2}, 400),
    ("/v1/completions", {"prompt": ["one", "two"], "max_tokens": 2}, 400),
    ("/completion", {"prompt": [1, 2, 10**9], "n_predict": 2}, 400),
    ("/completion", {"prompt": [1, -4], "n_predict": 2}, 400),
    ("/completion", {"prompt": list(range(100_000)), "n_predict": 2}, 400),
    ("/v1/completions", {"prompt": {"a": 1}, "max_tokens": 2}, 400),
    ("/v1/chat/completions", {**chat_body(CANARY, 4), "cache_salt": 7}, 400),
    ("/v1/chat/completions", {**chat_body(CANARY, 4), "cache_salt": "a\nheader:b"}, 400),
]


def test_bad_completion_requests_are_refused(proxy: ProxyThread, unchanged: None) -> None:
    for path, body, status in BAD_COMPLETIONS:
        assert_error_shape(post(f"{proxy.url}{path}", body), status, f"{path} {str(body)[:80]}")
    reply = post(f"{proxy.url}/v1/chat/completions", None, raw=b'{"messages": "' + b"x" * (2 << 20) + b'"}')
    assert_error_shape(reply, 413)


def nested_grammar(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


PROMPT = "The sky is"
# Each was forwarded before: an answer of tens of MiB, a server killed by its grammar parser, or a 500.
BOMBS = [
    ("/v1/chat/completions", {**chat_body(CANARY, 2), "logprobs": True, "top_logprobs": 1000}),
    ("/v1/chat/completions", {**chat_body(CANARY, 2), "n_probs": 49152}),
    ("/completion", {"prompt": PROMPT, "n_predict": 2, "n_probs": 49152}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 100}),
    ("/completion", {"prompt": PROMPT, "n_predict": 2, "grammar": nested_grammar(100_000)}),
    ("/completion", {"prompt": PROMPT, "n_predict": 2, "grammar": nested_grammar(1_000)}),
    (
        "/completion",
        {"prompt": PROMPT, "n_predict": 2, "grammar": "".join(f"r{i} ::= r{i + 1}\n" for i in range(50_000))},
    ),
    ("/completion", {"prompt": PROMPT, "n_predict": 2, "json_schema": nested_schema(100)}),
    (
        "/v1/chat/completions",
        {**chat_body(CANARY, 2), "response_format": {"type": "json_object", "schema": nested_schema(100)}},
    ),
    ("/completion", {"prompt": [1, 2, 2**63], "n_predict": 2}),
]


def test_amplifiers_and_parser_bombs_are_refused(proxy: ProxyThread, unchanged: None) -> None:
    for path, body in BOMBS:
        assert_error_shape(post(f"{proxy.url}{path}", body), 400, f"{path} {str(body)[:80]}")
    for depth in (255, 600, 1024):  # orjson reads 1,024 levels; the proxy writes 254 at most
        raw = b'{"messages": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
        assert_error_shape(post(f"{proxy.url}/v1/chat/completions", None, raw=raw), 400, f"depth {depth}")


def test_twenty_logprobs_and_a_small_grammar_still_pass(proxy: ProxyThread) -> None:
    body = {**chat_body(CANARY, 4), "top_logprobs": 20}
    reply = post(f"{proxy.url}/v1/chat/completions", body)
    assert (
        reply.status == 200 and len(reply.body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20
    )
    grammar = 'root ::= ("red" | "blue") ", " ("green" | "violet")'
    reply = post(f"{proxy.url}/completion", {"prompt": PROMPT, "n_predict": 8, "grammar": grammar})
    assert reply.status == 200 and reply.body["content"] in {
        f"{a}, {b}" for a in ("red", "blue") for b in ("green", "violet")
    }
    proxy.settle()


def test_llama_cpp_completion_endpoint_is_steered(proxy: ProxyThread) -> None:
    body = {"prompt": "The capital of France is", "n_predict": 4, "temperature": 0}
    for path in ("/completion", "/completions"):
        reply = post(f"{proxy.url}{path}", body)
        assert reply.status == 200, reply.body
        assert reply.headers["X-Radix-Route"] and reply.headers["X-Radix-Slot"]
    proxy.settle()


def test_admin_api_shows_no_prompt_text_by_default(proxy: ProxyThread) -> None:
    canary(proxy)
    routes = request(f"{proxy.url}/radix/routes").body["decisions"]
    assert routes and all(set(d["diverge"]) == {"at", "source", "complete"} for d in routes)
    slots = request(f"{proxy.url}/radix/slots").body["servers"][0]
    assert all(s["preview"] is None for s in slots["slots"])
    tree = request(f"{proxy.url}/radix/tree").body
    assert all(p["preview"] is None and p["head"] is None for p in tree["top"])
    assert "rainbow" not in json.dumps([routes, slots, tree])


def tenant_ask(proxy: ProxyThread, salt: str | None, question: str) -> Reply:
    messages = [{"role": "system", "content": SECRET}, {"role": "user", "content": question}]
    body = chat_body(messages, 4)
    if salt is not None:
        body["cache_salt"] = salt
    reply = post(f"{proxy.url}/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    proxy.settle()
    return reply


def test_two_tenants_never_reuse_each_others_kv(proxy: ProxyThread) -> None:
    # Slots keep their KV here (--cache-idle-release off): with the default an answered slot is
    # emptied, and the erase of another tenant's slot before its reuse would never be reached.
    with slots_keep_kv(proxy):
        _two_tenants(proxy)


def _two_tenants(proxy: ProxyThread) -> None:
    first = tenant_ask(proxy, "tenant-a", "What is the code word?")
    n = int(first.headers["X-Radix-Prompt-Tokens"])
    again = tenant_ask(proxy, "tenant-a", "What is the budget?")
    assert again.body["timings"]["cache_n"] > n * 0.8  # the same tenant reuses its prefix
    for salt in ("tenant-b", None):
        probe = tenant_ask(proxy, salt, "What is the code word?")
        # Neither the proxy (tree, slots, residents) nor the server's own slot reuse may hand
        # tenant A's KV to anyone else: the memo is computed again. (Without a key the request
        # is in the shared namespace, where the canary's chat-template header, a few tokens,
        # may be reused: that is not tenant A's.)
        assert int(probe.headers["X-Radix-Predicted-Cached-Tokens"]) < HEADER_TOKENS
        assert probe.body["timings"]["cache_n"] < HEADER_TOKENS, probe.body["timings"]
    # By header too, and the first tenant still finds its own prefix afterwards.
    other = post(
        f"{proxy.url}/v1/chat/completions",
        chat_body([{"role": "system", "content": SECRET}, {"role": "user", "content": "What is it?"}], 4),
        headers={"X-Cache-Salt": "tenant-c"},
    )
    assert other.status == 200 and other.body["timings"]["cache_n"] == 0
    proxy.settle()
    back = tenant_ask(proxy, "tenant-a", "What is the code word?")
    assert back.body["timings"]["cache_n"] > n * 0.8
    proxy.call(lambda rt: rt.coordinator.tree.check_invariants())


def test_cache_information_can_be_hidden(backend: ServerProcess, proxy: ProxyThread) -> None:
    assert backend.spec.kvctl_dir is not None
    proxy.stop()  # one proxy per server: the proxy must be the only user of the slots
    config = proxy_config(backend, cache_ram_mib=64, cache_info=False)
    hidden = ProxyThread(config).start()
    try:
        reply = post(f"{hidden.url}/v1/chat/completions", chat_body(CANARY, 4))
        assert reply.status == 200 and "timings" not in reply.body
        assert not [h for h in reply.headers if h.lower().startswith("x-radix")]
        assert reply.headers["X-Request-Id"]
        conn = http.client.HTTPConnection("127.0.0.1", config.port, timeout=120)
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({**chat_body(CANARY, 4), "stream": True}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        raw = resp.read()
        assert resp.status == 200 and b"data: " in raw
        assert b"timings" not in raw and b"cache_n" not in raw
        assert not [h for h, _ in resp.getheaders() if h.lower().startswith("x-radix")]
        hidden.settle()
    finally:
        hidden.stop()
