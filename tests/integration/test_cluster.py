"""Several real patched servers behind one proxy: spread, cross-server reuse, models, leave and return.

Servers A and B share the proxy's payload directory (files, "same host"); C has its own
directory, so the proxy moves its KV inline over HTTP (msgpack binary), as for a server on
another host. Q runs the same GGUF with a q8_0 K cache: another compatibility key, served as
a second model. A server is made to leave with SIGSTOP (its /health stops answering, the
health monitor takes it out; SIGCONT brings it back) or SIGKILL and a restart on its port.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import secrets
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.native.launch import ServerProcess
from proxy.server.ops.runtime import Runtime
from tests.helpers import (
    ProxyThread,
    Reply,
    ServerFactory,
    assert_same_answer,
    chat_body,
    get,
    post,
    proxy_config,
)
from tests.integration.test_proxy import convo, document

pytestmark = pytest.mark.integration

KEY = secrets.token_hex(16)  # one /kvctl key for every server behind one proxy
SMALL = {"n_parallel": 2, "ctx_size": 4096, "kvctl_key": KEY}
# A long queue deadline: on this shared 2-core machine two concurrent prompts can take a minute.
FAST = {
    "health_interval_s": 0.2,
    "health_timeout_s": 1.0,
    "min_restore_tokens": 32,
    "cache_ram_mib": 128,
    "queue_timeout_s": 600.0,
}


@pytest.fixture(scope="module")
def shared_dir(shm_root: Path) -> Path:
    path = shm_root / "cluster"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def trio(start_server: ServerFactory, patched_bin: Path, shared_dir: Path) -> list[ServerProcess]:
    """A and B share the proxy's payload dir; C does not (inline payloads)."""
    a = start_server(patched_bin, kvctl_dir=shared_dir, **SMALL)
    b = start_server(patched_bin, kvctl_dir=shared_dir, **SMALL)
    c = start_server(patched_bin, **SMALL)
    return [a, b, c]


@contextmanager
def proxy_over(
    *servers: ServerProcess, shm: Path, names: tuple[str, ...] = (), **over: Any
) -> Iterator[ProxyThread]:
    # Slots keep their KV after an answer: these tests compare what a slot holds with the tree.
    config = proxy_config(*servers, **{**FAST, "shm_dir": shm, "idle_release": False, **over})
    if names:
        specs = tuple(f"{n}={s.url}" for n, s in zip(names, servers, strict=True))
        config = dataclasses.replace(config, backends=specs)
    thread = ProxyThread(config).start()
    try:
        yield thread
        settled(thread)
    finally:
        thread.stop()


def settled(proxy: ProxyThread) -> None:
    proxy.settle()
    proxy.call(lambda rt: rt.coordinator.tree.check_invariants())
    busy = proxy.call(
        lambda rt: [(sv.name, s.slot_id) for sv in rt.coordinator.servers for s in sv.slots if s.busy]
    )
    assert busy == []


def ask(proxy: ProxyThread, messages: list[dict[str, str]], n: int = 8, **extra: Any) -> Reply:
    reply = post(f"{proxy.url}/v1/chat/completions", chat_body(messages, n, **extra))
    assert reply.status == 200, reply.body
    return reply


def reference(stock: ServerProcess, messages: list[dict[str, str]], n: int = 8) -> Reply:
    reply = post(f"{stock.url}/v1/chat/completions", chat_body(messages, n, cache_prompt=False))
    assert reply.status == 200, reply.body
    return reply


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def server_status(proxy: ProxyThread, name: str) -> str:
    servers = get(f"{proxy.url}/health").body["servers"]
    return str(next(s["status"] for s in servers if s["name"] == name))


@contextmanager
def paused(proxy: ProxyThread, *pairs: tuple[str, ServerProcess]) -> Iterator[None]:
    """The servers stop answering (SIGSTOP) until the block ends; the proxy has taken them out."""
    stopped = []
    try:
        for _, server in pairs:
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGSTOP)
            stopped.append(server)
        for name, _ in pairs:
            wait_for(lambda n=name: server_status(proxy, n) == "down", 20, f"{name} to be taken out")
        yield
    finally:
        for server in stopped:
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGCONT)
        for name, _ in pairs:
            wait_for(lambda n=name: server_status(proxy, n) == "ok", 30, f"{name} to be back")


def kv_matches_tree(proxy: ProxyThread, reply: Reply) -> bool:
    """The KV the server's slot holds for the restored prefix is byte-identical to the tree's."""
    name, slot = reply.headers["X-Radix-Server"], int(reply.headers["X-Radix-Slot"])
    restored = int(reply.headers["X-Radix-Predicted-Cached-Tokens"])

    async def compare(rt: Runtime) -> bool:
        server = next(s for s in rt.coordinator.servers if s.name == name)
        tokens = server.slots[slot].tokens[:restored]
        match = rt.coordinator.tree.match(tokens, ns=server.model_ns)
        assert match.length == restored
        saved = np.concatenate([s.rows() for s in rt.coordinator.tree.segments(match, 0, restored)])
        async with server.move_lock:
            live = await server.mover.export({"slot": slot}, 0, tokens)
        return bool(np.array_equal(saved, np.concatenate([seg.rows() for seg in live])))

    assert proxy.runtime is not None
    return bool(proxy.run(compare(proxy.runtime)))


def fallbacks(proxy: ProxyThread) -> float:
    """Requests that fell back to a prefill, or saves that failed, by any cause."""
    families = proxy.call(lambda rt: list(rt.metrics.registry.collect()))
    return sum(
        sample.value
        for family in families
        if family.name == "radix_fallbacks"
        for sample in family.samples
        if sample.name == "radix_fallbacks_total"
    )


def longest_saved(rt: Runtime, ns: str) -> int:
    """The longest prompt a server of model namespace ``ns`` holds, as found in that namespace."""
    slots = [s for server in rt.coordinator.servers if server.model_ns == ns for s in server.slots]
    held = max(slots, key=lambda s: len(s.tokens)).tokens
    return rt.coordinator.tree.match(held, ns=ns).length


def test_requests_spread_when_slots_are_busy(trio: list[ServerProcess], shared_dir: Path) -> None:
    with proxy_over(*trio, shm=shared_dir) as proxy:
        docs = [convo(document(100 + i), "Summarize in one line.") for i in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda m: ask(proxy, m, n=24), docs))
        # The first goes to s0; each next one finds a server with fewer requests running.
        assert sorted(r.headers["X-Radix-Server"] for r in replies) == ["s0", "s1", "s2"]
        modes = proxy.call(lambda rt: [s.mover.shm_dir is not None for s in rt.coordinator.servers])
        assert modes == [True, True, False]  # C names another payload dir: inline


@pytest.mark.parametrize(("target", "transport"), [(1, "shared"), (2, "inline")])
def test_prefix_computed_on_one_server_is_restored_on_another(
    trio: list[ServerProcess], shared_dir: Path, stock_server: ServerProcess, target: int, transport: str
) -> None:
    doc = document(200 + target)
    with proxy_over(*trio, shm=shared_dir) as proxy:
        first = ask(proxy, convo(doc, "Name one word."))
        assert first.headers["X-Radix-Server"] == "s0" and first.headers["X-Radix-Route"] == "prefill"
        settled(proxy)
        others = [(f"s{i}", trio[i]) for i in range(3) if i not in (target,)]
        with paused(proxy, *others):  # only the target serves: s0, which holds the prefix, is away
            messages = convo(doc, "Name two words.")
            got = ask(proxy, messages)
            settled(proxy)
            assert got.headers["X-Radix-Server"] == f"s{target}"
            assert got.headers["X-Radix-Route"] == "H", got.headers
            assert (
                int(got.body["timings"]["cache_n"])
                >= int(got.headers["X-Radix-Predicted-Cached-Tokens"])
                > 300
            )
            assert kv_matches_tree(proxy, got)
        assert_same_answer(got, reference(stock_server, messages))
        inline = proxy.call(lambda rt: rt.coordinator.servers[target].mover.shm_dir is None)
        assert inline == (transport == "inline")
        assert fallbacks(proxy) == 0  # every move, inline exports and imports included, succeeded


@pytest.fixture(scope="module")
def q8_server(start_server: ServerFactory, patched_bin: Path, shared_dir: Path) -> ServerProcess:
    return start_server(patched_bin, kvctl_dir=shared_dir, extra_args=("-ctk", "q8_0"), **SMALL)


def test_two_models_side_by_side(
    trio: list[ServerProcess], q8_server: ServerProcess, shared_dir: Path
) -> None:
    a = trio[0]
    with proxy_over(a, q8_server, shm=shared_dir, names=("smol", "smol-q8")) as proxy:
        listed = get(f"{proxy.url}/v1/models").body
        assert [m["id"] for m in listed["data"]] == ["smol", "smol-q8"]
        assert all(m["meta"]["n_vocab"] > 0 for m in listed["data"])
        doc = document(300)
        first = ask(proxy, convo(doc, "Name one word."), model="smol")
        assert first.headers["X-Radix-Server"] == "s0"
        settled(proxy)
        # The same prompt for the other model: none of smol's KV is usable there.
        other = ask(proxy, convo(doc, "Name one word."), model="smol-q8")
        assert other.headers["X-Radix-Server"] == "s1" and other.headers["X-Radix-Route"] == "prefill"
        settled(proxy)
        again = ask(proxy, convo(doc, "Name two words."), model="smol-q8")
        assert again.headers["X-Radix-Server"] == "s1" and again.headers["X-Radix-Route"] in ("A", "H", "A+H")
        # Its save may end after the answer (the slot is handed on first): read the tree after it.
        settled(proxy)
        namespaces = proxy.call(lambda rt: sorted({s.model_ns for s in rt.coordinator.servers}))
        assert len(namespaces) == 2
        for ns in namespaces:
            assert proxy.call(functools.partial(longest_saved, ns=ns)) > 300

        # Unknown and missing model names.
        unknown = post(f"{proxy.url}/v1/chat/completions", chat_body(convo(doc, "Hi"), 2, model="gpt-4"))
        assert unknown.status == 404 and unknown.body["error"]["type"] == "not_found_error"
        assert (
            set(unknown.body["error"]) == {"code", "message", "type"}
            and "gpt-4" in unknown.body["error"]["message"]
        )
        missing = post(f"{proxy.url}/v1/chat/completions", chat_body(convo(doc, "Hi"), 2))
        assert missing.status == 400
        # Three at once for smol (two slots): the third waits for smol, never goes to smol-q8.
        settled(proxy)  # smol-q8's last answer is saved and its slot released: nothing moves after
        before = proxy.call(lambda rt: [s.last_used for s in rt.coordinator.servers[1].slots])
        docs = [convo(document(310 + i, 80), "Say yes.") for i in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda m: ask(proxy, m, n=4, model="smol"), docs))
        assert {r.headers["X-Radix-Server"] for r in replies} == {"s0"}
        assert proxy.call(lambda rt: [s.last_used for s in rt.coordinator.servers[1].slots]) == before


def test_a_server_that_leaves_and_comes_back(
    start_server: ServerFactory,
    patched_bin: Path,
    trio: list[ServerProcess],
    shared_dir: Path,
    stock_server: ServerProcess,
    work_dir: Path,
) -> None:
    a = trio[0]
    e = start_server(patched_bin, kvctl_dir=shared_dir, **SMALL)
    again: ServerProcess | None = None
    try:
        with proxy_over(a, e, shm=shared_dir) as proxy:
            assert e.proc is not None
            e.proc.kill()
            e.proc.wait(10)
            wait_for(lambda: server_status(proxy, "s1") == "down", 20, "s1 to be taken out")
            doc = document(400)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both on s0
                replies = list(
                    pool.map(lambda q: ask(proxy, convo(doc if q == "a" else document(401), q)), ["a", "b"])
                )
            assert {r.headers["X-Radix-Server"] for r in replies} == {"s0"}
            settled(proxy)
            again = ServerProcess(e.spec, work_dir / f"server-{e.spec.port}-again.log").start(timeout=180)
            wait_for(lambda: server_status(proxy, "s1") == "ok", 30, "s1 to be back")
            with paused(proxy, ("s0", a)):  # the prefix computed on s0 while s1 was away warms s1
                messages = convo(doc, "a")
                got = ask(proxy, messages)
                settled(proxy)
                assert got.headers["X-Radix-Server"] == "s1" and got.headers["X-Radix-Route"] in ("H", "A+H")
                assert kv_matches_tree(proxy, got)
            assert_same_answer(got, reference(stock_server, messages))
            assert fallbacks(proxy) == 0
    finally:
        if again is not None:
            again.stop()
