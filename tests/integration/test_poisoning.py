"""Cache poisoning under a race, and fuzzing of the proxy's JSON front.

Poisoning: while the proxy serves and saves real prompts, attackers run completions of other
prompts directly on the server's slots (bypassing the proxy, as anything with access to the
server could) and send multi-choice requests through the proxy. Whatever the timing, the
host tree may only hold KV under the tokens it belongs to (invariant 6: every export names
the tokens, the server refuses otherwise), so every prompt restored afterwards must answer
like a full prefill (near-tie rule of invariant 5).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.native.launch import ServerProcess
from tests.helpers import ProxyThread, ServerFactory, assert_same_answer, chat_body, get, post, proxy_config

pytestmark = pytest.mark.integration

WORDS = [
    "audit",
    "beacon",
    "copper",
    "delta",
    "ember",
    "fjord",
    "granite",
    "harbor",
    "iris",
    "juniper",
    "kelp",
    "lumen",
    "mesa",
    "nickel",
    "onyx",
    "prairie",
    "quartz",
    "rivet",
    "sable",
    "tundra",
]


def text(seed: int, n: int = 150) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def convo(seed: int, question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"Field notes {seed}: {text(seed)}"},
        {"role": "user", "content": question},
    ]


@pytest.fixture(scope="module")
def backend(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    return start_server(patched_bin)


@pytest.fixture(scope="module")
def proxy(backend: ServerProcess) -> Iterator[ProxyThread]:
    assert backend.spec.kvctl_dir is not None
    config = proxy_config(backend)
    thread = ProxyThread(config).start()
    yield thread
    thread.stop()


def test_unsteered_and_multi_choice_requests_cannot_poison_the_tree(
    backend: ServerProcess, proxy: ProxyThread, stock_server: ServerProcess
) -> None:
    stop = threading.Event()
    refused: list[int] = []

    def attacker(k: int) -> None:
        i = 0
        while not stop.is_set():
            # Straight to the server, on a slot the proxy may be saving right now.
            post(
                f"{backend.url}/completion",
                {
                    "prompt": f"Intruder {k}.{i}: {text(1000 + 10 * k + i, 80)}",
                    "n_predict": 4,
                    "id_slot": (i + k) % 4,
                    "cache_prompt": True,
                },
                timeout=120,
            )
            refused.append(
                post(f"{proxy.url}/v1/chat/completions", {**chat_body(convo(i, "Again?"), 2), "n": 2}).status
            )
            i += 1

    threads = [threading.Thread(target=attacker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(2):
            for seed in range(6):
                assert (
                    post(f"{proxy.url}/v1/chat/completions", chat_body(convo(seed, "One word?"), 4)).status
                    == 200
                )
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    proxy.settle()
    assert refused and set(refused) == {400}
    proxy.call(lambda rt: rt.coordinator.tree.check_invariants())
    # Four other prompts take every slot; then each prompt comes back from the host tree when
    # its save got through (a save that met an intruder was refused, 409, and stored nothing),
    # and must answer like a full prefill either way.
    for seed in range(100, 104):
        assert post(f"{proxy.url}/v1/chat/completions", chat_body(convo(seed, "Hello?"), 2)).status == 200
        proxy.settle()
    restored = 0
    for seed in range(6):
        messages = convo(seed, "Which word comes first?")
        got = post(f"{proxy.url}/v1/chat/completions", chat_body(messages, 8))
        assert got.status == 200
        restored += got.headers["X-Radix-Route"] in ("H", "A+H") and got.body["timings"]["cache_n"] > 100
        ref = post(f"{stock_server.url}/v1/chat/completions", chat_body(messages, 8, cache_prompt=False))
        assert_same_answer(got, ref)
        proxy.settle()
    assert restored >= 1, "no prompt came back from the host tree: the race exercised nothing"


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "messages",
    "prompt",
    "n",
    "n_cmpl",
    "max_tokens",
    "n_predict",
    "stream",
    "cache_salt",
    "id_slot",
    "cache_prompt",
    "tokens",
    "model",
    "temperature",
    "logprobs",
]
BODIES = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6)
PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/completion"])


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(path=PATHS, body=BODIES)
def test_the_json_front_survives_random_bodies(proxy: ProxyThread, path: str, body: dict[str, Any]) -> None:
    if isinstance(body.get("max_tokens"), int) or isinstance(body.get("n_predict"), int):
        body["max_tokens"] = body["n_predict"] = 2  # keep generations short
    if body.get("stream") is True:
        body["stream"] = False
    reply = post(f"{proxy.url}{path}", body, timeout=120)
    assert reply.status < 500, (path, body, reply.status, reply.body)
    if reply.status >= 400:
        err = reply.body["error"]
        assert err["code"] == reply.status and err["message"] and err["type"]


def test_after_the_fuzz_the_proxy_is_sane(proxy: ProxyThread) -> None:
    proxy.settle()
    proxy.call(lambda rt: rt.coordinator.tree.check_invariants())
    assert (
        proxy.call(lambda rt: [s.slot_id for sv in rt.coordinator.servers for s in sv.slots if s.busy]) == []
    )
    assert get(f"{proxy.url}/health").status == 200
