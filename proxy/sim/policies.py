"""Routing policies: given a request and every server's state, pick a server.

A policy is any callable ``(request, servers, now) -> server index`` (`Policy`), so another
cost model plugs in without touching the engine. The engine then runs the real planner on the
chosen server, when one of its slots is idle, to pick the slot and the route.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol

from proxy.core.routing import CostModel, ServerLoad, choose_server
from proxy.sim.model import Calibration
from proxy.sim.state import Request, ServerView


class Policy(Protocol):
    def __call__(self, req: Request, servers: Sequence[ServerView], now: float) -> int: ...


def stable_hash(key: str) -> int:
    """A hash that is the same in every process (Python's hash() of str is salted)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class RoundRobin:
    """Each request to the next server in turn, whatever it holds or does."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, req: Request, servers: Sequence[ServerView], now: float) -> int:
        i = self.next % len(servers)
        self.next += 1
        return i


def least_loaded(req: Request, servers: Sequence[ServerView], now: float) -> int:
    """Fewest requests running or queued; ties the lowest index."""
    return min(range(len(servers)), key=lambda i: (servers[i].in_flight() + servers[i].queue_len(), i))


def session_sticky(req: Request, servers: Sequence[ServerView], now: float) -> int:
    """A session always lands on the server its key hashes to (an L7 balancer hashing a header)."""
    return stable_hash(f"session-{req.session_id}") % len(servers)


class CacheAware:
    """The smallest estimated time to first token: the server's backlog, plus the KV it
    would move and the tokens it would prefill under the real planner's plan there (the
    host tree's match is the same for every server: one proxy, one tree). Ties: the
    session's previous server (affinity as a tie-break only), then fewer in flight."""

    def __init__(self, calib: Calibration) -> None:
        self.calib = calib
        self.last: dict[int, int] = {}

    def __call__(self, req: Request, servers: Sequence[ServerView], now: float) -> int:
        prev = self.last.get(req.session_id, -1)
        best = min(range(len(servers)), key=lambda i: self._key(req, servers[i], now, prev))
        self.last[req.session_id] = best
        return best

    def _key(self, req: Request, sv: ServerView, now: float, prev: int) -> tuple[float, int, int, int]:
        p = sv.estimate(req.tokens, req.host_len)
        c = self.calib
        est = (
            sv.backlog_s(now)
            + c.move_s(p.host_to - p.host_from)
            + c.prefill_s(p.predicted_cached, len(req.tokens))
        )
        # Round to a millisecond so that near-equal estimates fall to the tie-breaks.
        return (round(est, 3), sv.index != prev, sv.in_flight() + sv.queue_len(), sv.index)


class ProxyCostModel:
    """The proxy's own routing (``proxy.core.routing``, what the coordinator runs), on the
    simulated servers: the real planner's plan per server turned into a ``ServerLoad``, with
    the cost model's rates taken from the calibration. The proxy holds waiting requests in
    its own queue; a simulated server queues them itself, so its queue counts as busy slots."""

    def __init__(self, calib: Calibration) -> None:
        self.model = CostModel(
            prefill_s_per_token=1 / calib.prefill_tok_s, move_bytes_per_s=calib.move_mb_s * 1e6
        )
        self.bytes_per_token = calib.bytes_per_token
        self.last: dict[int, int] = {}

    def __call__(self, req: Request, servers: Sequence[ServerView], now: float) -> int:
        prev = self.last.get(req.session_id, -1)
        loads = [self._load(req, sv, prev) for sv in servers]
        best = choose_server(loads, self.model)
        chosen = best.index if best is not None else 0
        self.last[req.session_id] = chosen
        return chosen

    def _load(self, req: Request, sv: ServerView, prev: int) -> ServerLoad:
        plan = sv.estimate(req.tokens, req.host_len)
        return ServerLoad(
            index=sv.index,
            n_prompt=len(req.tokens),
            cached=plan.predicted_cached,
            moved_bytes=max(0, plan.host_to - plan.host_from) * self.bytes_per_token,
            busy_slots=sv.in_flight() + sv.queue_len(),
            affinity=sv.index == prev,
        )


POLICIES: dict[str, Callable[[Calibration], Policy]] = {
    "cache-aware": lambda c: CacheAware(c),
    "proxy-cost": lambda c: ProxyCostModel(c),
    "round-robin": lambda c: RoundRobin(),
    "least-loaded": lambda c: least_loaded,
    "session-sticky": lambda c: session_sticky,
}
