"""``radixctl bench capacity``: the smallest KV pool that serves one concurrent wave.

The wave is ``prompts`` requests (default 4) with a common prefix (default 50 %) sent at
once to a cold arm, host caches off (stock ``--cache-ram 0``; the proxy with a 1 MiB tree
budget, ``radixctl serve --cache-ram 1``), so only what the server's KV pool holds counts.
Per arm, the pool size (``-c``) is binary-searched on a grid of ``step`` cells between a
lower bound, one request's prompt plus generation (nothing smaller can serve even one),
and ``upper_factor`` times that; every probe starts a fresh arm. A probe passes when every
request ends with HTTP 200, no error, and exactly ``max_tokens`` generated tokens (requests
carry ``ignore_eos``, so fewer means the server cut the answer short).

Serving the wave one request after the other fits in one request's pool: the proxy does
that when a pool is too small to hold the fan-out (requests wait for the one holding their
prefix and then reuse its slot). So each probe also measures how many requests the server
worked on at once: a request is in the server from its first token minus its ``prompt_ms``
to its last byte, and the peak overlap of these windows is the probe's ``together``. Two
searches per arm: the smallest pool that served every request in full (any order), and
the smallest that also served at least ``min_together`` at once (default ``prompts - 1``:
with fan-out the first request computes the common prefix alone, then the others attach it
together). The second is the capacity comparable across arms; Legacy (every slot computes
at once or the pool runs out) gets the same figure from both.

llama.cpp rounds the pool up to a multiple of 256 cells, so several ``-c`` values of the grid
make the same pool. The search records what each probe's server really allocated and, where
two probes bracket a ``-c`` with the same pool, reuses their verdict instead of starting the
arm again. Figures are reported in allocated cells; the saving of an arm is against Legacy.

Without sharing, every request holds its own copy of the prefix: about ``n x (prefix +
suffix + generation)`` cells. With sharing, requests sharing a prefix on a cold server
compute it once and attach it (fan-out): about ``prefix + n x (suffix + generation)``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.traffic.runner import RequestResult
from proxy.traffic.spec import Workload

DEFAULT_STEP = 64
DEFAULT_UPPER_FACTOR = 4.0
DEFAULT_PROBE_TIMEOUT_S = 300.0


# ---- pure logic ---------------------------------------------------------------------------


def pool_grid(lower: int, upper_factor: float = DEFAULT_UPPER_FACTOR, step: int = DEFAULT_STEP) -> list[int]:
    """Pool sizes to try: multiples of ``step`` from ``lower`` (rounded up) to ``upper_factor x lower``."""
    if lower < 1 or step < 1 or upper_factor < 1:
        raise ValueError("lower and step must be positive and upper_factor at least 1")
    start = math.ceil(lower / step) * step
    end = max(start, math.ceil(upper_factor * lower / step) * step)
    return list(range(start, end + 1, step))


def search_smallest(grid: Sequence[int], passes: Callable[[int], bool]) -> int | None:
    """The smallest value of ``grid`` that passes, assuming passing is monotone in the value.

    The largest value is tried first (None if even it fails); then a binary search between
    the grid's start (assumed failing below) and the smallest value known to pass.
    """
    if not grid or not passes(grid[-1]):
        return None
    lo, hi = -1, len(grid) - 1  # grid[hi] passes; everything at or below grid[lo] failed
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(grid[mid]):
            hi = mid
        else:
            lo = mid
    return grid[hi]


def known_cells(ctx: int, seen: Sequence[tuple[int, int]]) -> int | None:
    """The pool a server would allocate for ``-c ctx``, if probes already pin it down.

    ``seen`` holds (requested ``-c``, allocated cells) pairs. The allocation only ever
    rounds up and grows with ``-c``, so two probes on either side of ``ctx`` (or at it) that
    got the same pool say what ``ctx`` gets.
    """
    below = [cells for c, cells in seen if c <= ctx]
    above = [cells for c, cells in seen if c >= ctx]
    if not below or not above:
        return None
    lo, hi = max(below), min(above)
    return lo if lo == hi else None


def probe_verdict(results: Sequence[RequestResult], max_tokens: int) -> tuple[bool, str]:
    """Whether a probe served every request in full, and if not, why (the first failure)."""
    if not results:
        return False, "no requests"
    for r in results:
        error = r.error or ""
        if "context" in error.lower():
            return False, f"{r.id}: context: {error[:160]}"
        if r.status != 200:
            return False, f"{r.id}: HTTP {r.status}" + (f": {error[:160]}" if error else "")
        if error:
            return False, f"{r.id}: error: {error[:160]}"
        if r.predicted_n != max_tokens:
            return False, f"{r.id}: truncated: {r.predicted_n} of {max_tokens} tokens ({r.finish_reason})"
    return True, "ok"


def server_windows(results: Sequence[RequestResult]) -> list[tuple[float, float]]:
    """When each request was in the server: from its first token minus the server's own prefill
    time (``prompt_ms``) to its last byte, in seconds from the start of the run."""
    out = []
    for r in results:
        if r.ttft_s is None or r.e2e_s is None or r.prompt_ms is None:
            continue
        out.append((r.sent_s + r.ttft_s - r.prompt_ms / 1000, r.sent_s + r.e2e_s))
    return out


def peak_overlap(windows: Sequence[tuple[float, float]]) -> int:
    """The most windows open at one instant (a window ending as another starts does not overlap)."""
    events = sorted([(start, 1) for start, _ in windows] + [(end, -1) for _, end in windows])
    peak = cur = 0
    for _, delta in events:  # at equal times ends (-1) sort before starts (+1)
        cur += delta
        peak = max(peak, cur)
    return peak


def ideal_cells(prompt_tokens: Sequence[int], shared_tokens: int, max_tokens: int) -> dict[str, Any]:
    """Cells the wave needs in theory: every prompt held whole, or the common prefix held once."""
    unshared = sum(n + max_tokens for n in prompt_tokens)
    shared = shared_tokens + sum(n - shared_tokens + max_tokens for n in prompt_tokens)
    return {
        "unshared_cells": unshared,
        "shared_cells": shared,
        "saving_pct": 100 * (1 - shared / unshared) if unshared else None,
    }


def common_prefix(token_lists: Sequence[Sequence[Hashable]]) -> int:
    if not token_lists:
        return 0
    n = min(len(t) for t in token_lists)
    for i in range(n):
        if any(t[i] != token_lists[0][i] for t in token_lists[1:]):
            return i
    return n


@dataclass
class Probe:
    ctx: int  # the -c given
    cells: int | None  # the pool the server allocated
    ok: bool  # every request served in full
    reason: str
    together: int | None = None  # most requests in the server at once (peak_overlap)
    reused: bool = False  # verdict taken from an earlier probe of the same pool
    wall_s: float | None = None
    ttft_max_s: float | None = None
    cache_n: int | None = None
    prompt_n: int | None = None
    predicted_n: int | None = None
    kv_cells_used: int | None = None
    routes: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class PoolSearch:
    """One arm's searches: ``run(ctx)`` starts a fresh arm at ``-c ctx`` and returns its Probe.

    A probe is only run once per pool: a later ``-c`` that earlier probes show gets the same
    pool reuses its verdict.
    """

    def __init__(self, run: Callable[[int], Probe], min_together: int = 0) -> None:
        self.run = run
        self.min_together = min_together
        self.probes: list[Probe] = []

    def probe(self, ctx: int) -> Probe:
        same = next((p for p in self.probes if p.ctx == ctx), None)
        if same is not None:  # the other search was here already
            return same
        cells = known_cells(ctx, [(p.ctx, p.cells) for p in self.probes if p.cells is not None])
        earlier = next(
            (p for p in self.probes if cells is not None and p.cells == cells and not p.reused), None
        )
        if earlier is not None:
            self.probes.append(dataclasses.replace(earlier, ctx=ctx, reused=True))
        else:
            self.probes.append(self.run(ctx))
        return self.probes[-1]

    def served_together(self, probe: Probe) -> bool:
        return probe.ok and (probe.together or 0) >= self.min_together

    def _smallest(self, grid: Sequence[int], criterion: Callable[[Probe], bool]) -> dict[str, Any]:
        smallest = search_smallest(grid, lambda ctx: criterion(self.probe(ctx)))
        passed = next((p for p in self.probes if p.ctx == smallest and criterion(p)), None)
        failed = [p.cells for p in self.probes if not criterion(p) and p.cells is not None]
        min_cells = passed.cells if passed else None
        # The search assumes a larger pool never does worse; a failure above the result says it did.
        above = sorted({c for c in failed if min_cells is not None and c > min_cells})
        return {
            "min_ctx": smallest,
            "min_cells": min_cells,
            "max_failed_cells": max(failed) if failed else None,
            "failed_above_cells": above,
        }

    def search(self, grid: Sequence[int]) -> dict[str, Any]:
        together = self._smallest(grid, self.served_together)
        any_order = self._smallest(grid, lambda p: p.ok)
        return {
            **together,
            "any_order": any_order,
            "min_together": self.min_together,
            "probes": [p.to_json() for p in self.probes],
            "started": sum(1 for p in self.probes if not p.reused),
        }


def capacity_report(
    workload: dict[str, Any],
    settings: dict[str, Any],
    search: dict[str, Any],
    arms: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The report: per arm the smallest pools that passed and their saving against Legacy.

    ``min_cells`` (served together) is the headline; ``any_order.min_cells`` also counts a
    wave served one request after the other. Both savings are against Legacy's ``min_cells``.
    """
    legacy = (arms.get("legacy") or {}).get("min_cells")
    for entry in arms.values():
        for part in (entry, entry.get("any_order") or {}):
            cells = part.get("min_cells")
            part["saving_vs_legacy_pct"] = 100 * (1 - cells / legacy) if cells and legacy else None
    return {"workload": workload, "settings": settings, "search": search, "capacity": arms}


# ---- driving the arms ---------------------------------------------------------------------


def _summarize_probe(
    ctx: int,
    cells: int | None,
    results: list[RequestResult],
    max_tokens: int,
    kv_used: int | None,
    wall_s: float,
) -> Probe:
    ok, reason = probe_verdict(results, max_tokens)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    routes: dict[str, int] = {}
    for r in results:
        if r.route:
            routes[r.route] = routes.get(r.route, 0) + 1

    def total(key: str) -> int | None:
        vals = [getattr(r, key) for r in results if getattr(r, key) is not None]
        return sum(vals) if vals else None

    return Probe(
        ctx,
        cells,
        ok,
        reason,
        together=peak_overlap(server_windows(results)),
        wall_s=wall_s,
        ttft_max_s=max(ttfts) if ttfts else None,
        cache_n=total("cache_n"),
        prompt_n=total("prompt_n"),
        predicted_n=total("predicted_n"),
        kv_cells_used=kv_used,
        routes=routes,
    )


def run_capacity(
    workload: Workload,
    arm_names: list[str],
    settings: Any,
    out_dir: Path,
    *,
    step: int = DEFAULT_STEP,
    upper_factor: float = DEFAULT_UPPER_FACTOR,
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
    min_together: int | None = None,
    say: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Tokenize the wave on the first arm's server, then search each arm's smallest pool."""
    from proxy.bench.arms import ARMS, _get_json, arm_binary, pool_cells, start_arm
    from proxy.bench.limit import prompt_token_lists
    from proxy.traffic.runner import run_workload, write_results

    max_tokens = int(workload.params["max_tokens"])
    if min_together is None:
        min_together = max(1, len(workload.requests) - 1)
    # Host caches off: stock --cache-ram 0; the proxy's tree gets 1 MiB.
    settings = dataclasses.replace(settings, proxy_cache_mib=1, stock_cache_mib=0)
    binaries = {name: arm_binary(ARMS[name], settings.build_backend) for name in arm_names}  # build first
    first = arm_names[0]
    calib = dataclasses.replace(settings, log_dir=out_dir / "logs" / "tokenize")
    say(f"tokenizing the wave on a {first} server")
    with start_arm(first, calib, binaries[first]) as arm:
        token_lists = asyncio.run(prompt_token_lists(arm.server_url, workload.requests))
    prompt_tokens = [len(t) for t in token_lists]
    shared = common_prefix(token_lists)
    lower = max(prompt_tokens) + max_tokens
    grid = pool_grid(lower, upper_factor, step)
    search = {
        "step": step,
        "upper_factor": upper_factor,
        "lower": lower,
        "grid": [grid[0], grid[-1]],
        "prompt_tokens": prompt_tokens,
        "shared_tokens": shared,
        "ideal": ideal_cells(prompt_tokens, shared, max_tokens),
        "probe_timeout_s": probe_timeout_s,
        "min_together": min_together,
        "host_cache": "off (stock --cache-ram 0; proxy --cache-ram 1)",
    }
    say(
        f"prompts {prompt_tokens} tokens, common prefix {shared}; lower bound {lower} cells; "
        f"-c from {grid[0]} to {grid[-1]} in steps of {step}"
    )
    arms: dict[str, dict[str, Any]] = {}
    for name in arm_names:
        all_results: list[RequestResult] = []

        def run(ctx: int, name: str = name, all_results: list[RequestResult] = all_results) -> Probe:
            probe_settings = dataclasses.replace(
                settings, ctx_size=ctx, log_dir=out_dir / "logs" / f"{name}-c{ctx}"
            )
            started = time.perf_counter()
            try:
                with start_arm(name, probe_settings, binaries[name]) as arm:
                    cells = pool_cells(arm)
                    results = asyncio.run(
                        run_workload(
                            workload,
                            arm.front_url,
                            arm.server_url,
                            overrides=arm.overrides,
                            manifest=out_dir / f"manifest-{name}-c{ctx}.jsonl",
                            label=f"{name} -c {ctx}",
                            timeout_s=probe_timeout_s,
                        )
                    )
                    kv = _get_json(f"{arm.server_url}/kvctl/cells") if arm.arm.proxy else None
            except Exception as exc:  # a server or proxy that does not start at this size fails the probe
                probe = Probe(
                    ctx,
                    None,
                    False,
                    f"start failed: {type(exc).__name__}: {str(exc)[:200]}",
                    wall_s=time.perf_counter() - started,
                )
            else:
                for r in results:
                    r.meta.update({"ctx": ctx, "cells": cells})
                all_results.extend(results)
                kv_used = kv.get("used") if isinstance(kv, dict) else None
                probe = _summarize_probe(
                    ctx, cells, results, max_tokens, kv_used, time.perf_counter() - started
                )
            say(
                f"{name} -c {ctx} ({probe.cells} cells): {'served' if probe.ok else 'failed'} ({probe.reason}), "
                f"{probe.together} at once"
            )
            return probe

        say(f"arm {name}: {ARMS[name].description}")
        result = PoolSearch(run, min_together).search(grid)
        write_results(out_dir / f"results-{name}.jsonl", all_results)
        say(
            f"arm {name}: smallest pool {result['min_cells']} cells served together (-c {result['min_ctx']}), "
            f"{result['any_order']['min_cells']} in any order; {result['started']} arms started"
        )
        arms[name] = result
    shared_settings = {
        "model": settings.model.name,
        "n_parallel": settings.n_parallel,
        "threads": settings.threads,
        "batch_size": settings.batch_size,
        "ubatch_size": settings.ubatch_size,
        **settings.cpus_setting(),
    }
    wl = {
        "name": workload.name,
        "description": workload.description,
        "params": workload.params,
        "requests": len(workload.requests),
        "concurrency": workload.concurrency,
    }
    return capacity_report(wl, shared_settings, search, arms)
