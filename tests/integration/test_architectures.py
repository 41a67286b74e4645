"""Other architectures through the proxy, on tiny random-weight models made here
(tests/tinymodels.py), each against stock llama-server of the same commit computing from scratch.

- Models whose KV the patch moves exactly (standard attention at other head dims, q/k norms, MoE, MLA,
  M-RoPE's 24-byte cells): every turn's answer equals stock's from scratch under the near-tie
  rule, the second turn is a host restore (idle release erased the slot), and no move fell back.
- Waves (a prefix computed once for requests sent together) on M-RoPE, MLA, full-size SWA and
  MoE, with f16 and q8_0 KV.
- Models whose memory cannot be moved exactly (a sliding window, a recurrent state): the patched
  server starts with moves off instead of exiting, the proxy serves it with routes A and prefill
  only and says so (log, /health, metric), and answers equal stock's.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.native.launch import ServerProcess
from tests.helpers import (
    ProxyThread,
    Reply,
    ServerFactory,
    assert_same_answer,
    chat_body,
    get,
    post,
    proxy_config,
    request,
)
from tests.integration.test_proxy import convo, document
from tests.tinymodels import tiny_model

MOVABLE = [
    "qwen2vl",
    "llama-h80",
    "llama-h128",
    "qwen3",
    "qwen3moe",
    "mistral3",
    "deepseek2",
    "gemma2-swafull",
    "gemma3-swafull",
]
# A sliding-window family with --swa-full: both caches keep every cell, a payload holds one
# section per cache (the full-attention layers, then the window layers), and the moves are on.
SWA_FULL = "-swafull"
# K/V types and flash attention: f16 with V transposed (flash attention off), and q8_0 K and V
# (quantized V needs flash attention, which stores V untransposed).
KV_CONFIGS = {
    "f16": ("-fa", "off"),
    "f16-fa": ("-fa", "on"),
    "q8_0-fa": ("-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"),
}
# q8_0's 32-element blocks do not divide a head dim of 80: llama.cpp (stock too) refuses it.
_NO_CONFIG = {("llama-h80", "q8_0-fa"), ("deepseek2", "q8_0-fa")}  # MLA key length 48 here
# MLA (deepseek2) is a KV cache of K only: moves off, memory kind still kv.
UNMOVABLE = {
    "gemma2": "kv_swa",
    "gemma3": "kv_swa",
    "mamba2": "recurrent",
    "lfm2": "hybrid",
}


def _servers(
    start_server: ServerFactory, patched: Path, stock: Path, family: str, kv: str = "f16"
) -> tuple[ServerProcess, ...]:
    model, args = tiny_model(family.removesuffix(SWA_FULL)), KV_CONFIGS[kv]
    if family.endswith(SWA_FULL):
        args += ("--swa-full",)  # stock too: started alike, it computes from scratch
    # Small pools: the models are tiny and the suite runs many servers on 2 cores.
    return (
        start_server(patched, model=model, ctx_size=4096, threads=1, extra_args=args),
        start_server(stock, model=model, ctx_size=4096, threads=1, kvctl=False, extra_args=args),
    )


def _kvctl(server: ServerProcess, route: str, body: object = None) -> Reply:
    return request(
        f"{server.url}/kvctl/{route}",
        "POST" if body is not None else "GET",
        body,
        headers={"Authorization": f"Bearer {server.spec.kvctl_key}"},
        timeout=60,
    )


def _ask(proxy: ProxyThread, messages: list[dict[str, str]]) -> Reply:
    reply = post(f"{proxy.url}/v1/chat/completions", chat_body(messages, 16))
    assert reply.status == 200, reply.body
    proxy.settle()
    return reply


def _from_scratch(stock: ServerProcess, messages: list[dict[str, str]]) -> Reply:
    reply = post(f"{stock.url}/v1/chat/completions", chat_body(messages, 16, cache_prompt=False))
    assert reply.status == 200, reply.body
    return reply


def _fallbacks(proxy: ProxyThread) -> float:
    return float(
        proxy.call(
            lambda rt: sum(
                s.value
                for m in rt.metrics.fallbacks.collect()
                for s in m.samples
                if s.name.endswith("_total")
            )
        )
    )


def _two_turns(proxy: ProxyThread, stock: ServerProcess, seed: int) -> tuple[Reply, Reply]:
    messages = convo(document(seed, 120), "What is the first word?")
    first = _ask(proxy, messages)
    assert_same_answer(first, _from_scratch(stock, messages))
    messages += [
        {"role": "assistant", "content": first.body["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the last word?"},
    ]
    second = _ask(proxy, messages)
    assert_same_answer(second, _from_scratch(stock, messages))
    return first, second


@pytest.fixture(
    scope="module",
    params=[(f, kv) for f in MOVABLE for kv in KV_CONFIGS if (f, kv) not in _NO_CONFIG],
    ids="-".join,
)
def movable(
    request: pytest.FixtureRequest, start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> Iterator[tuple[str, ProxyThread, ServerProcess, ServerProcess]]:
    family, kv = request.param
    patched, stock = _servers(start_server, patched_bin, stock_bin, family, kv)
    proxy = ProxyThread(proxy_config(patched)).start()
    yield family, proxy, patched, stock
    proxy.stop()
    patched.stop()
    stock.stop()


def test_moved_kv_answers_as_stock_from_scratch(
    movable: tuple[str, ProxyThread, ServerProcess, ServerProcess],
) -> None:
    family, proxy, patched, stock = movable
    caps = _kvctl(patched, "caps").body
    assert caps["moves"] is True, caps
    layout = proxy.call(lambda rt: rt.coordinator.servers[0].mover.layout)
    assert layout is not None
    # M-RoPE cells carry 12 more bytes (two position axes and the token): taken from caps.
    assert caps["compat"]["cell_meta_bytes"] == (24 if family == "qwen2vl" else 12)
    assert layout.cell_ext_bytes == caps["compat"]["cell_meta_bytes"] - 12
    assert layout.v_trans == (patched.spec.extra_args[:2] == ("-fa", "off"))
    # One payload section per KV cache: two for a full-size SWA cache (gemma3: every other
    # layer has the window; gemma2 here too), else one.
    n_layer = caps["compat"]["n_layer"]
    sections = [n_layer // 2, n_layer - n_layer // 2] if family.endswith(SWA_FULL) else [n_layer]
    assert caps["compat"]["sections"] == sections and layout.section_layers == tuple(sections), caps

    first, second = _two_turns(proxy, stock, seed=7)
    assert first.headers["X-Radix-Route"] == "prefill"
    # Idle release erased the slot once the tree held it: the next turn is a host restore.
    assert second.headers["X-Radix-Route"] == "H", second.headers
    assert int(second.headers["X-Radix-Cached-Tokens"]) > 100
    # Another question on the document: a restore of a prefix that ends well before the saved
    # KV does (more than the tiny SWA models' window of 32 tokens): the window layers' cells
    # before the cut come from the export of the longer slot.
    messages = convo(document(7, 120), "Which word is the longest?")
    third = _ask(proxy, messages)
    assert third.headers["X-Radix-Route"] == "H", third.headers
    assert_same_answer(third, _from_scratch(stock, messages))
    assert _fallbacks(proxy) == 0
    assert proxy.call(lambda rt: rt.metrics.server_moves.labels("s0")._value.get()) == 1


@pytest.mark.parametrize(
    ("family", "kv"), [(f, kv) for f in sorted(UNMOVABLE) for kv in KV_CONFIGS], ids="-".join
)
def test_unmovable_memory_is_served_with_moves_off(
    family: str, kv: str, start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> None:
    patched, stock = _servers(start_server, patched_bin, stock_bin, family, kv)
    try:
        caps = _kvctl(patched, "caps").body
        assert caps["moves"] is False and caps["moves_off"], caps
        assert caps["memory"]["kind"] == UNMOVABLE[family]
        assert caps["sharing"] is False
        # Every move is refused with the reason, and nothing is changed.
        export = _kvctl(patched, "export", {"slot": 0, "p0": 0, "p1": 1, "expect_sha256": "0" * 64})
        assert export.status == 501 and "moves are off" in export.body["error"]["message"], export.body

        proxy = ProxyThread(proxy_config(patched)).start()
        try:
            health = get(f"{proxy.url}/health").body
            entry = health["servers"][0]
            assert health["status"] == "ok" and entry["kv_moves"] == "off", health
            assert entry["kv_moves_off"] == caps["moves_off"]
            assert proxy.call(lambda rt: rt.metrics.server_moves.labels("s0")._value.get()) == 0
            # Recurrent, hybrid and window-sized SWA memory: whole-state checkpoints instead
            # (test_checkpoints.py).
            assert caps["checkpoints"]["on"] is True, caps["checkpoints"]
            assert entry.get("kv_checkpoints") == "on", entry

            first, second = _two_turns(proxy, stock, seed=11)
            # Never a host restore or an attach; the second turn reuses the slot's own memory
            # (the server's checkpoints of its window or recurrent state): about 170-190 of the
            # first turn's 191 tokens on these models.
            assert first.headers["X-Radix-Route"] == "prefill", first.headers
            assert second.headers["X-Radix-Route"] == "A", second.headers
            assert int(second.headers["X-Radix-Cached-Tokens"]) > 100, second.headers
            assert second.headers["X-Radix-Slot"] == first.headers["X-Radix-Slot"]  # steered to its slot
            assert _fallbacks(proxy) == 0
            assert proxy.call(lambda rt: rt.coordinator.tree.stats().unique_tokens) == 0  # nothing saved
        finally:
            proxy.stop()
    finally:
        patched.stop()
        stock.stop()


def test_plain_swa_says_that_swa_full_turns_moves_on(start_server: ServerFactory, patched_bin: Path) -> None:
    """A window-sized SWA cache forgets cells older than the window: moves off, and the reason
    names the fix (--swa-full, whose servers move KV: the `*-swafull` families above)."""
    server = start_server(patched_bin, model=tiny_model("gemma3"), ctx_size=4096, threads=1)
    try:
        caps = _kvctl(server, "caps").body
        assert caps["moves"] is False and caps["memory"]["swa_full"] is False, caps
        assert caps["moves_off"] == [
            "sliding-window attention: the window layers' cache forgets cells older than the window"
            " (--swa-full keeps them and turns moves on)"
        ], caps
    finally:
        server.stop()


def _ask_together(proxy: ProxyThread, conversations: list[list[dict[str, str]]]) -> list[Reply]:
    with concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:
        replies = list(pool.map(lambda m: _ask(proxy, m), conversations))
    proxy.settle()
    return replies


@pytest.mark.parametrize("family", MOVABLE)
def test_kv_is_reused_exactly_on_every_route(
    family: str, start_server: ServerFactory, patched_bin: Path, stock_bin: Path, tmp_path: Path
) -> None:
    """Every family whose KV moves (M-RoPE's 24-byte cells, MLA's K-only cache, MoE, other head
    dims): A, A+H (an import at p0 > 0), S (resident sharing) and a restore from the disk tier
    after a restart (H), each equal to stock from scratch, with no fallback."""
    patched, stock = _servers(start_server, patched_bin, stock_bin, family)
    routes: set[str] = set()

    def check(proxy: ProxyThread, messages: list[dict[str, str]], reply: Reply | None = None) -> Reply:
        reply = reply or _ask(proxy, messages)
        assert_same_answer(reply, _from_scratch(stock, messages))
        routes.add(reply.headers["X-Radix-Route"])
        assert _fallbacks(proxy) == 0
        return reply

    doc = document(23, 150)
    # A, then A+H: the slot keeps its KV (idle release off); the tree tops up a shorter slot
    # (by 30-50 tokens, depending on how each model's answer re-tokenizes: a lower threshold).
    config = proxy_config(patched, idle_release=False, cache_disk=tmp_path / "disk", min_restore_tokens=16)
    proxy = ProxyThread(config).start()
    try:
        first = check(proxy, convo(doc, "What is the first word?"))
        turn = convo(doc, "What is the first word?") + [
            {"role": "assistant", "content": first.body["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And the last word?"},
        ]
        second = check(proxy, turn)
        assert second.headers["X-Radix-Route"] == "A"
        # The slot is taken by another question on the document (A again, shorter) ...
        check(proxy, convo(doc, "Which word is the longest?"))
        # ... so the conversation's next turn is the slot's document plus the rest from the tree.
        turn3 = turn + [
            {"role": "assistant", "content": second.body["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Which word comes second?"},
        ]
        assert check(proxy, turn3).headers["X-Radix-Route"] == "A+H"
    finally:
        proxy.stop()  # graceful: the tree is written to the disk tier
    # A restart: the tree is empty, the disk tier restores it (route H), the slots were erased.
    for slot in range(patched.spec.n_parallel):
        _kvctl(patched, "erase", {"slot": slot})
    proxy = ProxyThread(proxy_config(patched, cache_disk=tmp_path / "disk")).start()
    try:
        assert check(proxy, turn + [{"role": "user", "content": "One more?"}]).headers["X-Radix-Route"] == "H"
    finally:
        proxy.stop()
    # S and S+H: a resident prefix attached to another slot, topped up from the tree.
    proxy = ProxyThread(proxy_config(patched, kv_share=True, idle_release=False)).start()
    try:
        check(proxy, convo(doc, "Name a word."))
        pair = [convo(doc, "Name a verb."), convo(doc, "Name a noun.")]
        for reply, messages in zip(_ask_together(proxy, pair), pair, strict=True):
            check(proxy, messages, reply)
    finally:
        proxy.stop()
    assert {"A", "A+H", "H"} <= routes and routes & {"S", "S+H"}, routes


def test_moe_burst_of_host_restores_answers_as_stock_from_scratch(
    start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> None:
    """qwen3moe (8 experts, 2 used): four second turns restored from the host tree at once
    (route H, their suffixes computed in one batch) answer as stock computing each from
    scratch alone. The study behind it (docs/results/2026-12-03-moe-burst) found the parts
    seen earlier in such bursts in stock's own prompt cache too (flash attention on): batch and
    cell-order numerics that expert routing amplifies, not the restored KV. With flash
    attention off every answer of 300 was equal, so this runs there."""
    patched, stock = _servers(start_server, patched_bin, stock_bin, "qwen3moe")
    proxy = ProxyThread(proxy_config(patched)).start()
    try:
        doc = document(41, 120)
        seconds = []
        for question in (
            "What is the first word?",
            "Name three nouns.",
            "Summarise it.",
            "What is the last word?",
        ):
            messages = convo(doc, question)
            first = _ask(proxy, messages)
            assert_same_answer(first, _from_scratch(stock, messages))
            seconds.append(
                [*messages, {"role": "assistant", "content": first.body["choices"][0]["message"]["content"]}]
                + [{"role": "user", "content": "And then?"}]
            )
        for reply, messages in zip(_ask_together(proxy, seconds), seconds, strict=True):
            assert reply.headers["X-Radix-Route"] == "H", reply.headers
            assert_same_answer(reply, _from_scratch(stock, messages))
        assert _fallbacks(proxy) == 0
    finally:
        proxy.stop()
        patched.stop()
        stock.stop()


@pytest.mark.parametrize(
    ("family", "kv"),
    [("qwen2vl", "f16"), ("deepseek2", "f16-fa"), ("gemma3-swafull", "q8_0-fa"), ("qwen3moe", "q8_0-fa")],
    ids="-".join,
)
def test_a_wave_computes_its_shared_prefix_once(
    family: str, kv: str, start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> None:
    """Three requests sent together on a document nobody has computed (docs/design.md,
    Waves): one prefix step, the others restore it, every answer as stock's from scratch. A
    fresh proxy prices prefill at its CPU calibration until it has seen answers, so even these
    fast tiny models get the head's window."""
    patched, stock = _servers(start_server, patched_bin, stock_bin, family, kv)
    proxy = ProxyThread(proxy_config(patched)).start()
    try:
        doc = document(31, 260)
        wave = [convo(doc, q) for q in ("Name a word.", "Name a verb.", "Name a noun.")]
        replies = _ask_together(proxy, wave)
        heads = [r for r in replies if "X-Radix-Prefix-Step" in r.headers]
        assert len(heads) == 1, [dict(r.headers) for r in replies]
        assert sorted(r.headers["X-Radix-Route"] for r in replies if r is not heads[0]) == ["H", "H"]
        for reply, messages in zip(replies, wave, strict=True):
            assert_same_answer(reply, _from_scratch(stock, messages))
        assert _fallbacks(proxy) == 0
        assert proxy.call(lambda rt: rt.metrics.value("radix_prefix_steps_total", outcome="done")) == 1
    finally:
        proxy.stop()
