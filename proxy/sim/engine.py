"""The event loop: arrivals, dispatch through the real planner, first token, answer, save.

Events are (time, sequence number): same inputs, same order, same results. The host radix
tree is the proxy's real ``RadixTree``; its KV segments are zero-filled (never written, so
the OS maps no memory for them) with a 1 KiB row per token, and its budget is scaled so it
holds as many tokens as the real budget would with the real model's rows.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from proxy.config import Config
from proxy.core.payload import KvLayout, KvSegment
from proxy.core.planner import Plan, Route, plan
from proxy.core.radix import RadixTree
from proxy.sim.model import Calibration
from proxy.sim.policies import POLICIES, Policy, stable_hash
from proxy.sim.state import Request, SimServer, SimSlot
from proxy.sim.workload import Session, WorkloadSpec, generate

SIM_LAYOUT = KvLayout(1, (1,), (512,), (1,), False, (512,), (0,), (0,))


@dataclass(frozen=True)
class SimConfig:
    servers: int = 8
    slots: int = 4
    policy: str = "cache-aware"
    host_tree: bool = True
    # Proxies, each owning servers // proxies servers and its own host tree, behind an L7
    # balancer that hashes the session id (deploy/nginx): 1 is one proxy in front of all.
    proxies: int = 1
    share: bool = False
    host_budget_mib: int = Config.cache_ram_mib  # as `--cache-ram` (real bytes)
    min_restore_tokens: int = Config.min_restore_tokens  # as `--min-restore-tokens`
    share_cells: int = 8192  # resident tokens per server before releasing owners
    calib: Calibration = field(default_factory=Calibration)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)


@dataclass(frozen=True)
class Served:
    request_id: int
    session_id: int
    server: int
    route: Route
    n_prompt: int
    cached: int
    restored: int  # of which imported from the host tree (route H, A+H, S+H)
    ttft_s: float
    e2e_s: float


@dataclass
class SimResult:
    config: SimConfig
    served: list[Served]
    busy_s: list[float]  # engine time per server
    requests: list[int]  # requests per server
    end_s: float
    tree_bytes: int
    sessions_moved: int  # sessions whose requests ran on more than one server


class Simulator:
    def __init__(self, config: SimConfig, policy: Policy | None = None) -> None:
        if config.servers < 1 or config.slots < 1:
            raise ValueError("servers and slots must be >= 1")
        if not 1 <= config.proxies <= config.servers:
            raise ValueError("proxies must be between 1 and the number of servers")
        if policy is None and config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r} (one of {', '.join(POLICIES)})")
        self.cfg = config
        self.calib = config.calib
        self.policy = policy if policy is not None else POLICIES[config.policy](config.calib)
        self.servers = [
            SimServer(
                i,
                config.slots,
                config.calib,
                share=config.share,
                min_restore_tokens=config.min_restore_tokens,
            )
            for i in range(config.servers)
        ]
        scale = (SIM_LAYOUT.bytes_per_token + 4) / (config.calib.bytes_per_token + 4)
        budget = int(config.host_budget_mib * 2**20 * scale)
        # Server i belongs to proxy i % proxies; each proxy has its own tree.
        self.trees = [
            RadixTree(budget, SIM_LAYOUT) if config.host_tree else None for _ in range(config.proxies)
        ]
        self.groups = [self.servers[g :: config.proxies] for g in range(config.proxies)]
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.seq = 0
        self.next_id = 0
        self.served: list[Served] = []
        self.where: dict[int, set[int]] = {}
        self.sessions: dict[int, Session] = {}

    # ---- the loop -----------------------------------------------------------------------

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn))

    def run(self, sessions: list[Session] | None = None) -> SimResult:
        for s in sessions if sessions is not None else generate(self.cfg.workload):
            self.sessions[s.session_id] = s
            self.at(s.start_s, functools.partial(self.send_step, session=s, step=0))
        now = 0.0
        while self.events:
            now, _, fn = heapq.heappop(self.events)
            fn(now)
        return SimResult(
            self.cfg,
            self.served,
            [s.engine_busy_s for s in self.servers],
            [s.served for s in self.servers],
            now,
            sum(t.stats().bytes for t in self.trees if t is not None),
            sum(1 for v in self.where.values() if len(v) > 1),
        )

    def send_step(self, now: float, *, session: Session, step: int) -> None:
        for turn in session.steps[step]:
            self.next_id += 1
            req = Request(self.next_id, session.session_id, step, turn.tokens, turn.answer, now)
            self.arrive(now, req)

    def arrive(self, now: float, req: Request) -> None:
        # The balancer's key (X-Session-Id); salted apart from session-sticky's own hash.
        g = stable_hash(f"balancer-{req.session_id}") % self.cfg.proxies
        tree, group = self.trees[g], self.groups[g]
        if tree is not None:
            req.host_len = tree.match(req.tokens, touch=False).length
        i = self.policy(req, group, now)
        if not 0 <= i < len(group):
            raise ValueError(f"policy returned server {i} of {len(group)}")
        server = group[i]
        est = server.estimate(req.tokens, req.host_len)
        req.est_s = server.job_s(est, len(req.tokens))
        server.queue.append(req)
        self.where.setdefault(req.session_id, set()).add(i)
        self.dispatch(now, server)

    # ---- one server ---------------------------------------------------------------------

    def dispatch(self, now: float, server: SimServer) -> None:
        while server.queue and server.idle_slot():
            req = server.queue.popleft()
            tree = self.tree_of(server)
            host_len = tree.match(req.tokens).length if tree is not None else 0
            p = plan(server.plan_input(req.tokens, host_len))
            assert p is not None  # a slot is idle
            self.start(now, server, req, p)

    def start(self, now: float, server: SimServer, req: Request, p: Plan) -> None:
        slot = server.slots[p.slot_id]
        slot.busy = True
        if p.owner_id is not None and server.residents is not None:
            server.residents.attached(p.owner_id, slot.slot_id, p.reuse_len, now)
        tree = self.tree_of(server)
        if tree is not None and p.host_to > p.host_from:
            tree.record_load(p.host_to - p.host_from)
        first = server.run(now, server.job_s(p, len(req.tokens)))
        done = first + self.calib.decode_s(len(req.answer))
        slot.free_at = done
        n = len(req.tokens)
        self.served.append(
            Served(
                req.request_id,
                req.session_id,
                server.index,
                p.route,
                n,
                p.predicted_cached,
                p.host_to - p.host_from,
                first - req.arrival_s,
                done - req.arrival_s,
            )
        )
        server.served += 1
        self.at(done, lambda t: self.finish(t, server, slot, req, p))

    def finish(self, now: float, server: SimServer, slot: SimSlot, req: Request, p: Plan) -> None:
        # The slot holds the prompt and the answer but its last token (not yet decoded).
        slot.tokens = np.concatenate([req.tokens, req.answer[:-1]])
        session = self.sessions[req.session_id]
        if req.step + 1 < len(session.steps) and req.tokens is session.steps[req.step][0].tokens:
            pause = session.think_s[req.step]
            self.at(now + pause, functools.partial(self.send_step, session=session, step=req.step + 1))
        back = self.save(now, server, slot)
        self.share(now, server, slot, req, p)
        self.at(back, lambda t: self.release(t, server, slot))

    def save(self, now: float, server: SimServer, slot: SimSlot) -> float:
        """Export what the host tree lacks (saves.save): engine time; returns when it ends (the slot is
        handed on then; takes of a saving slot are not modelled)."""
        tree = self.tree_of(server)
        if tree is None:
            return now
        tokens = slot.tokens
        match = tree.match(tokens)
        missing = len(tokens) - match.length
        if missing < max(1, self.cfg.min_restore_tokens // 4):
            return now
        end = server.run(now, self.calib.move_s(missing))
        tree.insert(tokens, KvSegment.zeros(match.length, SIM_LAYOUT, missing))
        return end

    def share(self, now: float, server: SimServer, slot: SimSlot, req: Request, p: Plan) -> None:
        """Publish the prompt (and a restored host prefix) as resident prefixes (moves._share)."""
        index = server.residents
        if index is None:
            return
        index.slot_changed(slot.slot_id, slot.tokens)
        for n in sorted({len(req.tokens), p.host_to}):
            if n < 32 or n > len(slot.tokens) or index.has(slot.tokens[:n]):
                continue
            # Release least useful owners until one id is free and the newcomer fits the
            # owner budget (counted as the sum of entry lengths: shared cells counted twice).
            owner = index.free_owner()
            for victim in index.release_order():
                if owner is not None and self._owner_tokens(server) + n <= self.cfg.share_cells:
                    break
                index.remove(victim)
                owner = index.free_owner()
            if owner is None or self._owner_tokens(server) + n > self.cfg.share_cells:
                return
            server.run(now, self.calib.attach_s)  # publish: an ownership copy, no K/V copy
            index.add(owner, slot.tokens[:n], slot.slot_id, now)

    @staticmethod
    def _owner_tokens(server: SimServer) -> int:
        assert server.residents is not None
        return sum(e.n for e in server.residents.entries.values())

    def tree_of(self, server: SimServer) -> RadixTree | None:
        return self.trees[server.index % self.cfg.proxies]

    def release(self, now: float, server: SimServer, slot: SimSlot) -> None:
        slot.busy = False
        slot.last_used = now
        self.dispatch(now, server)
