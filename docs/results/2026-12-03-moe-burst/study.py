"""MoE bursts: is a route-H answer that differs from stock-from-scratch the cache or the batch?

Run from the repository root:
``.venv/bin/python docs/results/2026-12-03-moe-burst/study.py CONFIG ROUNDS`` (CONFIG: f16,
f16-fa or q8_0-fa).
It needs the patched and stock builds (``radixctl build --variant stock && radixctl build``).

The tiny qwen3moe model (8 experts, 2 used), 4 slots, K/V and flash attention per CONFIG. For each
round, 4 conversations on one shared document take a first turn one at a time, then their
second turns arrive together (a burst of 4). The same bursts go to:

- the proxy in front of a patched server (second turns: route H, a host restore, then the
  suffix is computed, 4 slots in one batch);
- stock llama-server with its own prompt cache (second turns reuse each slot's KV, the same
  suffixes computed, 4 slots in one batch);
- stock from scratch, as a burst (cache_prompt false, the whole prompts, 4 slots together);
- and the reference: stock from scratch, one request at a time (what the suite compares with).

Every answer is compared with the reference token by token (a part at a top-two margin under
0.5 nats is a near-tie, not a difference), and the proxy's with stock's own-cache answers
(same batches, different KV source): equal there means the KV the proxy restored is what
stock's own cache holds.
"""

from __future__ import annotations

import concurrent.futures
import json
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from proxy.native.build import BuildSpec, build_server  # noqa: E402
from proxy.native.launch import ServerProcess, ServerSpec, free_port  # noqa: E402
from tests.helpers import NEAR_TIE_NATS, ProxyThread, Reply, answer_tokens, chat_body, post, proxy_config  # noqa: E402
from tests.integration.test_proxy import convo, document  # noqa: E402
from tests.tinymodels import tiny_model  # noqa: E402

N_PREDICT = 24
CONFIGS = {
    "f16": ("-fa", "off"),
    "f16-fa": ("-fa", "on"),
    "q8_0-fa": ("-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"),
}


def part(got: Reply, ref: Reply) -> tuple[int, float] | None:
    """Where two answers part beyond a near-tie of ``ref``: (token index, ref's top-two margin)."""
    for i, (x, y) in enumerate(zip(answer_tokens(got), answer_tokens(ref), strict=False)):
        if x[0] != y[0]:
            return None if y[2] < NEAR_TIE_NATS else (i, round(y[2], 3))
    return None


def identical(a: Reply, b: Reply) -> bool:
    return [t[0] for t in answer_tokens(a)] == [t[0] for t in answer_tokens(b)]


def ask(url: str, messages: list[dict[str, str]], **extra: Any) -> Reply:
    reply = post(f"{url}/v1/chat/completions", chat_body(messages, N_PREDICT, **extra), timeout=300)
    assert reply.status == 200, reply.body
    return reply


def burst(url: str, convos: list[list[dict[str, str]]], **extra: Any) -> list[Reply]:
    with concurrent.futures.ThreadPoolExecutor(len(convos)) as pool:
        return list(pool.map(lambda m: ask(url, m, **extra), convos))


def start(binary: Path, root: Path, kvctl: bool, args: tuple[str, ...]) -> ServerProcess:
    port = free_port()
    spec = ServerSpec(
        binary=binary,
        model=tiny_model("qwen3moe"),
        port=port,
        n_parallel=4,
        ctx_size=8192,
        threads=2,
        kvctl=kvctl,
        kvctl_dir=root / f"kv-{port}" if kvctl else None,
        kvctl_key=secrets.token_hex(16) if kvctl else None,
        extra_args=args,
    )
    return ServerProcess(spec, root / f"server-{port}.log").start(timeout=180)


def main(config: str, rounds: int) -> None:
    args = CONFIGS[config]
    root = Path(tempfile.mkdtemp(prefix="moe-burst-"))
    patched_bin = build_server(BuildSpec(variant="patched"))
    stock_bin = build_server(BuildSpec(variant="stock"))
    patched, stock = start(patched_bin, root, True, args), start(stock_bin, root, False, args)
    scratch = start(stock_bin, root, False, args)
    proxy = ProxyThread(proxy_config(patched)).start()
    rows: list[dict[str, Any]] = []
    firsts_rows: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            doc = document(100 + r, 120)
            questions = [
                "What is the first word?",
                "Name three nouns.",
                "Summarise it.",
                "What is the last word?",
            ]
            firsts = [convo(doc, q) for q in questions]
            seconds = []
            for i, m in enumerate(firsts):
                # One at a time: the proxy restores the shared document (route H after the
                # first), stock reuses the slot it picks by similarity.
                p, s = ask(proxy.url, m), ask(stock.url, m)
                proxy.settle()
                ref = ask(scratch.url, m, cache_prompt=False)
                firsts_rows.append(
                    {
                        "round": r,
                        "conversation": i,
                        "proxy_route": p.headers.get("X-Radix-Route"),
                        "proxy_vs_ref": part(p, ref),
                        "own_cache_vs_ref": part(s, ref),
                    }
                )
                print(json.dumps({"first_turn": True, **firsts_rows[-1]}), flush=True)
                # Second turns continue the reference's answer: the same prompt for everyone.
                seconds.append(
                    [*m, {"role": "assistant", "content": ref.body["choices"][0]["message"]["content"]}]
                    + [{"role": "user", "content": "And then?"}]
                )
            via_proxy = burst(proxy.url, seconds)
            proxy.settle()
            own_cache = burst(stock.url, seconds)
            scratch_burst = burst(scratch.url, seconds, cache_prompt=False)
            reference = [ask(scratch.url, m, cache_prompt=False) for m in seconds]
            for i in range(4):
                rows.append(
                    {
                        "round": r,
                        "conversation": i,
                        "proxy_route": via_proxy[i].headers.get("X-Radix-Route"),
                        "proxy_vs_ref": part(via_proxy[i], reference[i]),
                        "own_cache_vs_ref": part(own_cache[i], reference[i]),
                        "scratch_burst_vs_ref": part(scratch_burst[i], reference[i]),
                        "proxy_identical_to_own_cache": identical(via_proxy[i], own_cache[i]),
                        "proxy_vs_own_cache": part(via_proxy[i], own_cache[i]),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        proxy.stop()
        for s in (patched, stock, scratch):
            s.stop()

    def count(key: str, of: list[dict[str, Any]] = rows) -> int:
        return sum(row[key] is not None for row in of)

    summary = {
        "config": config,
        "first_turns": len(firsts_rows),
        "first_turn_routes": sorted({str(row["proxy_route"]) for row in firsts_rows}),
        "first_turn_proxy_differs_from_ref": count("proxy_vs_ref", firsts_rows),
        "first_turn_stock_own_cache_differs_from_ref": count("own_cache_vs_ref", firsts_rows),
        "bursts_of_4": len(rows) // 4,
        "requests": len(rows),
        "routes": sorted({str(row["proxy_route"]) for row in rows}),
        "proxy_differs_from_ref": count("proxy_vs_ref"),
        "stock_own_cache_differs_from_ref": count("own_cache_vs_ref"),
        "stock_scratch_burst_differs_from_ref": count("scratch_burst_vs_ref"),
        "proxy_identical_to_stock_own_cache": sum(row["proxy_identical_to_own_cache"] for row in rows),
        "proxy_differs_from_stock_own_cache": count("proxy_vs_own_cache"),
    }
    print(json.dumps(summary, indent=1))
    differing = [
        row
        for row in firsts_rows + rows
        if row["proxy_vs_ref"] or row.get("own_cache_vs_ref") or row.get("scratch_burst_vs_ref")
    ]
    print("differing:", json.dumps(differing, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "f16", int(sys.argv[2]) if len(sys.argv) > 2 else 8)
