"""Read-only pass-through requests take turns per server (proxy/server/ops/runtime.py)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.errors import Unavailable
from proxy.server.ops.runtime import PassthroughTurns


def test_at_most_limit_run_at_once_per_server_and_a_waiter_past_the_deadline_gets_503() -> None:
    async def main() -> None:
        turns = PassthroughTurns(limit=2, timeout_s=0.05)
        running, peak = 0, 0
        release = asyncio.Event()

        async def one(url: str) -> None:
            nonlocal running, peak
            async with turns.turn(url):
                running += 1
                peak = max(peak, running)
                await release.wait()
                running -= 1

        held = [asyncio.create_task(one("http://a")) for _ in range(2)]
        other = asyncio.create_task(one("http://b"))  # another server: its own turns
        await asyncio.sleep(0.01)
        assert running == 3
        with pytest.raises(Unavailable, match="--max-passthrough 2"):
            await one("http://a")  # a third at a: waits past the deadline
        release.set()
        await asyncio.gather(*held, other)
        assert peak == 3 and running == 0
        await one("http://a")  # the turns came back

    asyncio.run(main())


def test_a_failed_request_gives_its_turn_back() -> None:
    async def main() -> None:
        turns = PassthroughTurns(limit=1, timeout_s=0.05)
        with pytest.raises(RuntimeError):
            async with turns.turn("http://a"):
                raise RuntimeError("the server went away")
        async with turns.turn("http://a"):
            pass

    asyncio.run(main())
