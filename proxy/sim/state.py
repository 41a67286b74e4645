"""Fake servers: slots, a FIFO queue, one compute engine, an optional resident index.

A server runs its prefill work (KV moves, prefill, saves) one job at a time on its engine
(llama-server's single main loop); each slot then decodes on its own at the calibrated
per-slot rate, so decoding never delays another request's prefill (batched decoding is
cheap next to prefill on this model). What the policies may read is `ServerView`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from proxy.core.planner import Plan, PlanInput, SlotView, plan
from proxy.core.prefix import common_prefix
from proxy.core.resident import ResidentIndex
from proxy.sim.model import Calibration

EMPTY = np.empty(0, np.int32)


@dataclass
class Request:
    request_id: int
    session_id: int
    step: int
    tokens: np.ndarray
    answer: np.ndarray
    arrival_s: float
    host_len: int = 0  # the host tree's match when it arrived (an estimate for the policy)
    est_s: float = 0.0  # the policy's estimate of its engine time, while it is queued


@dataclass
class SimSlot:
    slot_id: int
    tokens: np.ndarray = field(default_factory=lambda: EMPTY)
    busy: bool = False
    last_used: float = 0.0
    free_at: float = 0.0  # when a busy slot is expected back (end of its decode)


class ServerView(Protocol):
    """What a routing policy may read about one server."""

    @property
    def index(self) -> int: ...
    @property
    def n_slots(self) -> int: ...
    def queue_len(self) -> int: ...
    def in_flight(self) -> int: ...
    def backlog_s(self, now: float) -> float: ...
    def estimate(self, tokens: np.ndarray, host_len: int) -> Plan: ...


class SimServer:
    def __init__(
        self, index: int, n_slots: int, calib: Calibration, *, share: bool, min_restore_tokens: int
    ) -> None:
        self.index = index
        self.n_slots = n_slots
        self.calib = calib
        self.min_restore_tokens = min_restore_tokens
        self.slots = [SimSlot(i) for i in range(n_slots)]
        # Owner ids follow the slot ids, as on the patched server (n_seq_extra).
        self.residents = ResidentIndex(range(n_slots, n_slots + 64), 0) if share else None
        self.queue: deque[Request] = deque()
        self.engine_free_at = 0.0
        self.engine_busy_s = 0.0
        self.served = 0

    # ---- what policies read -----------------------------------------------------------

    def queue_len(self) -> int:
        return len(self.queue)

    def in_flight(self) -> int:
        return sum(1 for s in self.slots if s.busy)

    def backlog_s(self, now: float) -> float:
        """Seconds before a new request's own prefill could start: the engine's queued work,
        the queued requests' estimates, and the wait for a slot when none is idle."""
        wait = max(0.0, self.engine_free_at - now) + sum(r.est_s for r in self.queue)
        if self.in_flight() + len(self.queue) >= self.n_slots:
            wait += max(0.0, min(s.free_at for s in self.slots) - now)
        return wait

    def estimate(self, tokens: np.ndarray, host_len: int) -> Plan:
        """The planner's plan as if a slot were idle now (every slot counts as a candidate)."""
        p = plan(self.plan_input(tokens, host_len, all_idle=True))
        assert p is not None
        return p

    # ---- what the engine does ----------------------------------------------------------

    def plan_input(self, tokens: np.ndarray, host_len: int, all_idle: bool = False) -> PlanInput:
        views = tuple(
            SlotView(
                s.slot_id, all_idle or not s.busy, common_prefix(s.tokens, tokens), len(s.tokens), s.last_used
            )
            for s in self.slots
        )
        residents = self.residents.views(tokens) if self.residents is not None else ()
        return PlanInput(
            n_prompt=len(tokens),
            slots=views,
            host_len=host_len,
            residents=residents,
            min_restore_tokens=self.min_restore_tokens,
            share_enabled=self.residents is not None,
        )

    def idle_slot(self) -> bool:
        return any(not s.busy for s in self.slots)

    def run(self, now: float, seconds: float) -> float:
        """Queue ``seconds`` of work on the engine; returns when it ends."""
        start = max(now, self.engine_free_at)
        self.engine_free_at = start + seconds
        self.engine_busy_s += seconds
        return self.engine_free_at

    def job_s(self, p: Plan, n_prompt: int) -> float:
        """Engine time of a request planned as ``p``: its KV moves and its prefill."""
        c = self.calib
        t = c.request_overhead_s + c.move_s(p.host_to - p.host_from)
        if p.owner_id is not None:
            t += c.attach_s
        return t + c.prefill_s(p.predicted_cached, n_prompt)
