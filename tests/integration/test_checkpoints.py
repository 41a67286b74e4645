"""Whole-state checkpoints of recurrent, hybrid and window-sized SWA models (patches 0017,
0025), against real servers.

A recurrent state cannot be cut at a position, and a window-sized SWA cache holds only the
window of a sequence's last position, so these models' KV moves are off. The server
takes context checkpoints of its recurrent state while it computes a prompt; the proxy keeps
the whole state at those positions in host memory after each answer and restores it into any
slot later (route H), which stock llama-server cannot do once another conversation took the
slot. Each answer is compared with stock computing the same prompt from scratch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.core.payload import tokens_sha256
from proxy.native.launch import ServerProcess
from proxy.server.ops.runtime import Runtime
from tests.helpers import ProxyThread, ServerFactory, assert_same_answer, get, post, proxy_config
from tests.integration.test_architectures import KV_CONFIGS, _ask, _fallbacks, _from_scratch, _kvctl
from tests.integration.test_proxy import convo, document
from tests.tinymodels import tiny_model

# Hybrid (short conv + attention), recurrent, and a sliding window of 32 at the server's default
# window-sized cache (gemma3: every other layer), whose state holds only the window.
FAMILIES = ("lfm2", "mamba2", "gemma3")


@pytest.fixture(scope="module", params=[(f, kv) for f in FAMILIES for kv in KV_CONFIGS], ids="-".join)
def recurrent(
    request: pytest.FixtureRequest, start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> Iterator[tuple[str, ProxyThread, ServerProcess, ServerProcess]]:
    family, kv = request.param
    model, args = tiny_model(family), KV_CONFIGS[kv]
    # Two slots: a second conversation takes the first one's slot.
    patched = start_server(patched_bin, model=model, ctx_size=4096, threads=1, n_parallel=2, extra_args=args)
    stock = start_server(stock_bin, model=model, ctx_size=4096, threads=1, kvctl=False, extra_args=args)
    proxy = ProxyThread(proxy_config(patched)).start()
    yield family, proxy, patched, stock
    proxy.stop()
    patched.stop()
    stock.stop()


def _count(proxy: ProxyThread, name: str) -> float:
    return float(proxy.call(lambda rt: getattr(rt.metrics, name)._value.get()))


def _first_turn(proxy: ProxyThread, stock: ServerProcess, seed: int) -> list[dict[str, str]]:
    messages = convo(document(seed, 120), "What is the first word?")
    first = _ask(proxy, messages)
    # A: the opening words of the system prompt that another conversation's slot holds.
    assert first.headers["X-Radix-Route"] in ("prefill", "A"), first.headers
    assert_same_answer(first, _from_scratch(stock, messages))
    return messages + [
        {"role": "assistant", "content": first.body["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the last word?"},
    ]


def _next_token(
    server: ServerProcess, prompt: list[int], slot: int, cache: bool
) -> tuple[list[tuple[int, float]], int]:
    """One greedy token of ``prompt`` on ``slot``: its top three (id, logprob) and the tokens the
    server reused (timings.cache_n)."""
    body = {
        "prompt": prompt,
        "n_predict": 1,
        "id_slot": slot,
        "cache_prompt": cache,
        "temperature": 0,
        "n_probs": 3,
    }
    reply = post(f"{server.url}/completion", body)
    assert reply.status == 200, reply.body
    top = reply.body["completion_probabilities"][0]["top_logprobs"]
    return [(t["id"], t["logprob"]) for t in top], int(reply.body["timings"]["cache_n"])


def test_checkpoint_restores_a_conversation_on_a_taken_slot(
    recurrent: tuple[str, ProxyThread, ServerProcess, ServerProcess],
) -> None:
    family, proxy, patched, stock = recurrent
    caps = _kvctl(patched, "caps").body
    assert caps["moves"] is False and caps["checkpoints"]["on"] is True, caps
    entry = get(f"{proxy.url}/health").body["servers"][0]
    assert entry["kv_moves"] == "off" and entry["kv_checkpoints"] == "on", entry
    assert proxy.call(lambda rt: rt.metrics.server_checkpoints.labels("s0")._value.get()) == 1

    saves = _count(proxy, "checkpoint_saves")
    second_turn = _first_turn(proxy, stock, seed=21)
    assert _count(proxy, "checkpoint_saves") > saves  # the states the server took of the prompt
    # Two other conversations take both slots (the first one's slot first: it shares the
    # system prompt's opening words).
    _first_turn(proxy, stock, seed=22)
    _first_turn(proxy, stock, seed=23)

    restores = _count(proxy, "checkpoint_restores")
    second = _ask(proxy, second_turn)
    # Stock would compute the whole conversation again here; the proxy restored the state the
    # server took just before the first turn's prompt ended, on whichever slot it leased.
    assert second.headers["X-Radix-Route"] == "H", second.headers
    assert int(second.headers["X-Radix-Cached-Tokens"]) > 150, second.headers
    assert_same_answer(second, _from_scratch(stock, second_turn))
    assert _count(proxy, "checkpoint_restores") == restores + 1
    assert _fallbacks(proxy) == 0
    # The tree holds no KV segments of such a model: only checkpoints.
    assert proxy.call(lambda rt: rt.coordinator.tree.stats().unique_tokens) == 0


def test_a_corrupt_checkpoint_falls_back_to_prefill(
    recurrent: tuple[str, ProxyThread, ServerProcess, ServerProcess],
) -> None:
    """The server checks a checkpoint's bytes against the hash it wrote: a damaged one is
    refused (400), the slot cleared, and the request prefilled, counted, with a right answer."""
    family, proxy, patched, stock = recurrent
    second_turn = _first_turn(proxy, stock, seed=31)
    _first_turn(proxy, stock, seed=32)
    _first_turn(proxy, stock, seed=33)

    def damage(rt: Runtime) -> int:
        store = rt.coordinator.checkpoints
        for cp in store.entries:
            data = bytearray(cp.data)
            data[-1] ^= 0xFF
            cp.data = bytes(data)
        return len(store.entries)

    assert proxy.call(damage) > 0
    fallbacks = _fallbacks(proxy)
    second = _ask(proxy, second_turn)
    assert second.headers["X-Radix-Route"] == "prefill", second.headers
    assert_same_answer(second, _from_scratch(stock, second_turn))
    assert _fallbacks(proxy) == fallbacks + 1


def test_checkpoint_api_binds_the_state_to_its_tokens(start_server: ServerFactory, patched_bin: Path) -> None:
    """/kvctl/checkpoint and /kvctl/restore on a real server: the positions listed in
    /kvctl/slots, a round trip into another slot, and every refusal leaving nothing half done."""
    server = start_server(patched_bin, model=tiny_model("lfm2"), ctx_size=4096, threads=1, n_parallel=2)
    try:
        reply = _kvctl(server, "caps")
        assert reply.body["checkpoints"]["on"] is True, reply.body
        done = post(
            f"{server.url}/completion",
            {"prompt": document(41, 120), "n_predict": 4, "id_slot": 0, "cache_prompt": True},
        )
        assert done.status == 200, done.body
        slots = _kvctl(server, "slots?tokens=1").body["slots"]
        tokens = slots[0]["tokens"]
        positions = slots[0]["checkpoints"]
        assert positions and all(0 < n <= len(tokens) for n in positions), slots[0]
        n = max(positions)

        want = {"slot": 0, "n": n, "expect_sha256": tokens_sha256(tokens[:n])}
        cp = _kvctl(server, "checkpoint", want)
        assert cp.status == 200 and cp.body["n_tokens"] == n, cp.body
        data = cp.body["data"]  # base64 in a JSON reply

        # Wrong tokens, a position without a checkpoint: refused, nothing exported.
        assert _kvctl(server, "checkpoint", {**want, "expect_sha256": "0" * 64}).status == 409
        assert _kvctl(server, "checkpoint", {**want, "n": n - 1}).status == 404

        restore = {"slot": 1, "tokens": tokens[:n], "segments": [{"data": data}]}
        assert _kvctl(server, "restore", {**restore, "tokens": tokens[: n - 1]}).status == 409
        assert _kvctl(server, "restore", {**restore, "segments": [{"data": "AAAA" + data[4:]}]}).status == 400
        done = _kvctl(server, "restore", restore)
        assert done.status == 200 and done.body["n_tokens"] == n, done.body
        slot1 = _kvctl(server, "slots?tokens=1").body["slots"][1]
        assert slot1["tokens"] == tokens[:n] and slot1["pos_max"] == n - 1, slot1
    finally:
        server.stop()


def test_no_checkpoint_holds_tokens_a_prompt_replaced(start_server: ServerFactory, patched_bin: Path) -> None:
    """A prompt that keeps only a slot's first k tokens leaves no checkpoint of the old tokens
    past k (patch 0018): stock kept the one taken after k + 1 tokens, which holds the old token
    at k, and a later prompt extending the new tokens could continue from it, on the server's
    own reuse or through /kvctl/checkpoint. Every checkpoint the slot lists must then restore
    into another slot and continue as a computation from scratch."""
    server = start_server(patched_bin, model=tiny_model("lfm2"), ctx_size=4096, threads=1, n_parallel=2)
    rnd = random.Random(5)

    def toks(n: int) -> list[int]:
        return [rnd.randrange(10, 1000) for _ in range(n)]

    def complete(prompt: list[int], slot: int, cache: bool = True) -> list[tuple[int, float]]:
        return _next_token(server, prompt, slot, cache)[0]

    try:
        a = toks(200)
        complete(a, 0)  # a checkpoint 4 tokens before the end: after 196 tokens
        b = a[:197] + [a[197] + 1] + toks(3)  # keeps 197 tokens of a: a checkpoint after 197
        complete(b, 0)
        c = b[:196] + [b[196] + 1] + toks(103)  # keeps 196 tokens of b
        complete(c, 0)
        slot0 = _kvctl(server, "slots?tokens=1").body["slots"][0]
        assert slot0["tokens"][: len(c)] == c, slot0["n_tokens"]
        assert 197 not in slot0["checkpoints"], slot0["checkpoints"]  # b's, past the 196 kept
        for n in slot0["checkpoints"]:
            cp = _kvctl(server, "checkpoint", {"slot": 0, "n": n, "expect_sha256": tokens_sha256(c[:n])})
            assert cp.status == 200, cp.body
            done = _kvctl(
                server, "restore", {"slot": 1, "tokens": c[:n], "segments": [{"data": cp.body["data"]}]}
            )
            assert done.status == 200, done.body
            d = c[:n] + toks(10)
            restored, scratch = complete(d, 1), complete(d, 1, cache=False)
            assert restored[0][0] == scratch[0][0], (n, restored, scratch)
            assert max(abs(x[1] - y[1]) for x, y in zip(restored, scratch, strict=True)) < 5e-3, (
                n,
                restored,
                scratch,
            )
    finally:
        server.stop()


def test_the_startup_probe_fits_a_small_batch(start_server: ServerFactory, patched_bin: Path) -> None:
    """The probe decodes 64 tokens in batches of -b: a server with -b 32 starts (it aborted on
    llama_decode's batch limit before) and has checkpoints on."""
    server = start_server(
        patched_bin, model=tiny_model("lfm2"), ctx_size=4096, threads=1, extra_args=("-b", "32", "-ub", "32")
    )
    try:
        caps = _kvctl(server, "caps").body
        assert caps["checkpoints"]["on"] is True, caps["checkpoints"]
    finally:
        server.stop()


@pytest.mark.parametrize(("ctx", "on"), [(256, False), (512, True)])
def test_a_slot_too_small_to_cut_the_window_keeps_checkpoints_off(
    ctx: int, on: bool, start_server: ServerFactory, patched_bin: Path
) -> None:
    """The probe must decode past the window (200 here) for its restored state to be cut by it,
    within half a slot: a slot of 256 cells cannot, so checkpoints stay off, and the finding says
    what slot would do; 512 cells can (the server pads each slot to a multiple of 256)."""
    server = start_server(patched_bin, model=tiny_model("gemma3-w200"), ctx_size=ctx, threads=1, n_parallel=1)
    try:
        caps = _kvctl(server, "caps").body
        assert caps["n_ctx_slot"] == ctx and caps["checkpoints"]["on"] is on, caps
        if not on:
            finding = " ".join(caps["checkpoints"]["off"])
            assert "256 cells is too small to check a state cut by the window of 200" in finding, finding
            assert "at least 410" in finding, finding
    finally:
        server.stop()


@pytest.mark.parametrize("kv", sorted(KV_CONFIGS))
@pytest.mark.parametrize("length", [24, 200])  # within the window of 32, and far past it
def test_a_restored_window_continues_where_it_was_taken(
    length: int, kv: str, start_server: ServerFactory, patched_bin: Path
) -> None:
    """A window-sized SWA cache (tiny gemma3, window 32, no --swa-full): a checkpoint's state
    holds only the window of its last position. Restored into another slot, the slot takes it as
    the context checkpoint the server took (patch 0025), so the server's own reuse rule, which
    wants older cells than a bare window holds, goes on from it: the next prompt computes only its
    new tokens and the checkpoint's last one, as from scratch. Without the slot's checkpoint the
    server's rule finds nothing to go on from and computes everything."""
    server = start_server(
        patched_bin,
        model=tiny_model("gemma3"),
        ctx_size=4096,
        threads=1,
        n_parallel=2,
        extra_args=KV_CONFIGS[kv],
    )
    rnd = random.Random(length)
    window = 32

    def complete(prompt: list[int], slot: int, cache: bool = True) -> tuple[list[tuple[int, float]], int]:
        return _next_token(server, prompt, slot, cache)

    try:
        caps = _kvctl(server, "caps").body
        assert caps["moves"] is False and caps["checkpoints"]["on"] is True, caps
        a = [rnd.randrange(10, 1000) for _ in range(length)]
        complete(a, 0)
        slot0 = _kvctl(server, "slots?tokens=1").body["slots"][0]
        assert slot0["checkpoints"], slot0
        n = max(slot0["checkpoints"])
        cp = _kvctl(server, "checkpoint", {"slot": 0, "n": n, "expect_sha256": tokens_sha256(a[:n])})
        assert cp.status == 200, cp.body
        done = _kvctl(
            server, "restore", {"slot": 1, "tokens": a[:n], "segments": [{"data": cp.body["data"]}]}
        )
        assert done.status == 200, done.body
        slot1 = _kvctl(server, "slots?tokens=1").body["slots"][1]
        assert slot1["tokens"] == a[:n] and slot1["checkpoints"] == [n], slot1
        if length > window:
            assert slot1["pos_min"] == n - window, slot1  # the state holds only the window

        d = a[:n] + [rnd.randrange(10, 1000) for _ in range(10)]
        restored, cached = complete(d, 1)
        scratch, _ = complete(d, 1, cache=False)
        assert cached == n - 1, (n, cached)  # the restored state, less the token computed again
        assert restored[0][0] == scratch[0][0], (restored, scratch)
        assert max(abs(x[1] - y[1]) for x, y in zip(restored, scratch, strict=True)) < 5e-3, (
            restored,
            scratch,
        )
    finally:
        server.stop()
