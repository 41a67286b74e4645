"""One server's KV-move lock: a slot's moves exclude each other, moves into different slots
run together, and a move that touches the whole server excludes every other.

Why not one lock per server: the server's main loop runs /kvctl moves one after another
anyway, but each move's request is also checked on one of the server's HTTP threads (the
payload's layout, positions and NaN/Inf scan read every byte once), its payload is mapped,
and its round trip and the proxy's part take time. Under one lock a second restore waited
for all of that; with a slot's own hold, a restore into another slot is checked while the
first one is copied, and only the copies queue on the main loop.

What needs the whole server: the room checks and the erases of idle slots that make room
(they read and change the pool every slot draws from), and owner sequences (published,
attached, released: shared by every slot). What needs one slot: an import, a whole-state
checkpoint written or read, an erase of that slot. A slot's blocks in the host tree are
pinned by the lease that reads them, so no lock guards them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

WHOLE = None  # a holder of the whole server, not one slot


@dataclass(eq=False)
class _Waiter:
    slot: int | None  # WHOLE, or the slot it moves into
    future: asyncio.Future[None]


class MoveLock:
    """``async with lock`` holds the whole server (first come, first served, like
    ``asyncio.Lock``); ``lock.held(slot)`` holds one slot. Holders taken with ``first=True``
    (restores: a request's first token waits on them) go before every queued plain holder
    (saves after an answer, which only keep their own slot busy a little longer). A queued
    whole-server waiter keeps every waiter behind it waiting, so slot moves never starve it;
    a slot waiter behind a busy slot lets waiters for other slots pass."""

    def __init__(self) -> None:
        self._whole = False
        self._slots: set[int] = set()
        self._first: collections.deque[_Waiter] = collections.deque()
        self._plain: collections.deque[_Waiter] = collections.deque()
        self._restores = 0  # restore steps holding or waiting for the lock
        self._no_restores = asyncio.Event()
        self._no_restores.set()

    def locked(self) -> bool:
        """Whether anyone holds any part of it."""
        return self._whole or bool(self._slots)

    def slots_held(self) -> frozenset[int]:
        return frozenset(self._slots)

    async def acquire(self, first: bool = False, slot: int | None = WHOLE) -> None:
        waiter = _Waiter(slot, asyncio.get_running_loop().create_future())
        (self._first if first else self._plain).append(waiter)
        self._grant()
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(slot)  # handed over, then cancelled: pass it on
            else:
                self._grant()  # a whole-server waiter leaving may let others in
            raise

    def release(self, slot: int | None = WHOLE) -> None:
        if slot is WHOLE:
            assert self._whole, "released the whole server's move lock without holding it"
            self._whole = False
        else:
            assert slot in self._slots, f"released slot {slot}'s move lock without holding it"
            self._slots.discard(slot)
        self._grant()

    def _grant(self) -> None:
        """Hand the lock to every waiter that may hold it now, in order (restores first)."""
        passed_over: set[int] = set()  # slots with an earlier waiter still waiting
        for queue in (self._first, self._plain):
            for waiter in list(queue):
                if waiter.future.done():  # cancelled while queued
                    queue.remove(waiter)
                    continue
                if self._whole:
                    return
                if waiter.slot is WHOLE:
                    if not self._slots:
                        self._whole = True
                        queue.remove(waiter)
                        waiter.future.set_result(None)
                    return  # nobody passes a whole-server waiter
                if waiter.slot in self._slots or waiter.slot in passed_over:
                    passed_over.add(waiter.slot)
                    continue
                self._slots.add(waiter.slot)
                queue.remove(waiter)
                waiter.future.set_result(None)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    @contextlib.asynccontextmanager
    async def held(self, slot: int | None = WHOLE, first: bool = False) -> AsyncIterator[None]:
        """Hold ``slot`` (or the whole server) for the block."""
        await self.acquire(first=first, slot=slot)
        try:
            yield
        finally:
            self.release(slot)

    @contextlib.asynccontextmanager
    async def first(self, slot: int | None = WHOLE) -> AsyncIterator[None]:
        """A restore step's hold: ahead of queued saves, and counted by ``restores_done``."""
        async with self.restoring(), self.held(slot, first=True):
            yield

    @contextlib.asynccontextmanager
    async def restoring(self) -> AsyncIterator[None]:
        """A restore step under way, holding the lock or not yet (its payload being written):
        ``restores_done`` waits for it."""
        self.planned()
        try:
            yield
        finally:
            self.unplanned()

    def planned(self) -> None:
        """A restore was planned (its request not at its restore yet): requests sent now
        wait for it as for one under way (``restores_done``). Ended by ``unplanned``."""
        self._restores += 1
        self._no_restores.clear()

    def unplanned(self) -> None:
        self._restores -= 1
        if not self._restores:
            self._no_restores.set()

    async def restores_done(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no restore holds or waits for the lock. A
        /kvctl move waits for the server's main loop, which a prompt being computed keeps
        busy: a request sent while another's restore is pending makes that restore wait for
        its whole prefill, where sending it a moment later lets both prefills run together."""
        if self._no_restores.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._no_restores.wait()
