"""Host restores into different slots of one real patched server run together (movelock.py),
on a tiny random-weight model made here, with f16 and q8_0 KV, against stock llama-server of
the same commit computing from scratch.

Three conversations' first turns are answered and saved (their slots released to the host
tree); their next turns are then sent at once. Each import is held inside its server part
until all three are there (bounded: without slot-scoped holds the second never gets in, and
the wait runs out), so the server receives the three /kvctl imports together; each answer
must still equal stock's from scratch, with no fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from proxy.server.ops.runtime import Runtime
from tests.helpers import ProxyThread, ServerFactory, assert_same_answer, proxy_config
from tests.integration.test_architectures import KV_CONFIGS, _ask, _fallbacks, _from_scratch
from tests.integration.test_proxy import convo, document
from tests.tinymodels import tiny_model

pytestmark = pytest.mark.integration

FAMILY = "llama-h128"
SESSIONS = 3
TOGETHER_S = 20.0  # how long an import waits inside its hold for the others


def _hold_imports_together(rt: Runtime, inside_max: list[int]) -> None:
    """Wrap the server's mover so that each import, once inside its hold (the move lock's part
    for its slot), waits until SESSIONS imports are inside or TOGETHER_S passed."""
    server = rt.coordinator.servers[0]
    mover = server.mover
    plain = mover.import_
    inside = [0]
    all_in = asyncio.Event()

    @contextlib.asynccontextmanager
    async def together(hold: contextlib.AbstractAsyncContextManager[Any] | None) -> AsyncIterator[None]:
        async with hold or contextlib.nullcontext():
            inside[0] += 1
            inside_max[0] = max(inside_max[0], inside[0])
            if inside[0] >= SESSIONS:
                all_in.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TOGETHER_S):
                    await all_in.wait()
            try:
                yield
            finally:
                inside[0] -= 1

    async def import_(
        slot: int, p0: int, tokens: Any, segments: Any, hold: Any = None, lora: Any = None, media: Any = ()
    ) -> None:
        await plain(slot, p0, tokens, segments, hold=together(hold), lora=lora, media=media)

    mover.import_ = import_  # type: ignore[method-assign]


@pytest.mark.parametrize("kv", ("f16", "q8_0-fa"))
def test_restores_into_different_slots_run_together_and_answer_as_stock(
    kv: str, start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> None:
    model = tiny_model(FAMILY)
    args = KV_CONFIGS[kv]
    patched = start_server(patched_bin, model=model, ctx_size=4096, threads=1, extra_args=args)
    stock = start_server(stock_bin, model=model, ctx_size=4096, threads=1, kvctl=False, extra_args=args)
    proxy = ProxyThread(proxy_config(patched)).start()
    try:
        assert proxy.call(lambda rt: rt.coordinator.servers[0].moves) is True
        turns = []
        for i in range(SESSIONS):
            messages = convo(document(40 + i, 120), "What is the first word?")
            first = _ask(proxy, messages)  # answered, saved, its slot released to the host tree
            turns.append(
                messages
                + [
                    {"role": "assistant", "content": str(first.body["choices"][0]["message"]["content"])},
                    {"role": "user", "content": "And the last word?"},
                ]
            )
        inside_max = [0]
        proxy.call(lambda rt: _hold_imports_together(rt, inside_max))
        with ThreadPoolExecutor(SESSIONS) as pool:
            replies = list(pool.map(lambda m: _ask(proxy, m), turns))
        assert inside_max[0] == SESSIONS  # the three imports were in the server's part together
        for messages, reply in zip(turns, replies, strict=True):
            assert reply.headers["X-Radix-Route"] == "H", reply.headers
            assert reply.body["timings"]["cache_n"] > 0, reply.body["timings"]
            assert_same_answer(reply, _from_scratch(stock, messages))
        assert len({r.headers["X-Radix-Slot"] for r in replies}) == SESSIONS
        assert _fallbacks(proxy) == 0
    finally:
        proxy.stop()
        patched.stop()
        stock.stop()
