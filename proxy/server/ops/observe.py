"""What the proxy reports without being asked per request: pool and resident gauges read
from the servers on scrape, the tree mirror, and the periodic cache summary log line."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

import aiohttp

from proxy.errors import RadixError
from proxy.server.coordinator import ServerState
from proxy.server.dataplane.kvctl import Cells
from proxy.server.metrics import FALLBACK_CAUSES
from proxy.server.ops.runtime import Runtime

log = logging.getLogger("radix")

POOL_TIMEOUT_S = 2.0
T = TypeVar("T")


async def server_json(
    server: ServerState, what: str, call: Awaitable[T], timeout_s: float = POOL_TIMEOUT_S
) -> tuple[T | None, str | None]:
    try:
        return await asyncio.wait_for(call, timeout_s), None
    except (RadixError, aiohttp.ClientError, TimeoutError) as exc:
        return None, f"{server.name} {what}: {exc or type(exc).__name__}"


async def refresh_pool_gauges(
    runtime: Runtime, timeout_s: float = POOL_TIMEOUT_S
) -> dict[str, dict[str, Any] | None]:
    """Read every server's GET /kvctl/cells (concurrently) into the kv_cache_*_cells gauges.

    A server that does not answer within ``timeout_s`` keeps its last counts and gets
    ``radix_backend_up 0``. Returns ``{server: cells or None}``.
    """
    servers = runtime.coordinator.servers

    async def one(server: ServerState) -> dict[str, Any] | None:
        cells, err = await server_json(server, "/kvctl/cells", server.backend.cells(), timeout_s)
        if err:
            log.debug("pool gauges: %s", err)
        pool = cells.as_json() if cells is not None else None
        runtime.metrics.set_pool(server.name, pool)
        set_resident(runtime, server, cells)
        return pool

    results = await asyncio.gather(*(one(s) for s in servers))
    return {s.name: r for s, r in zip(servers, results, strict=True)}


def set_resident(runtime: Runtime, server: ServerState, cells: Cells | None) -> None:
    """Resident entries from the proxy's index; their cells are the pool's owner cells."""
    m = runtime.metrics
    if server.sharing is None:
        m.resident_entries.labels(server.name).set(0)
        m.resident_cells.labels(server.name).set(0)
        return
    stats = server.sharing.index.stats()
    m.resident_entries.labels(server.name).set(stats.entries)
    m.resident_pinned.labels(server.name).set(stats.pinned)
    m.resident_evictions[server.name].set(stats.evicted)
    m.resident_admitted[server.name].set(stats.admitted)
    if cells is not None:
        m.resident_cells.labels(server.name).set(float(cells.owner))


async def refresh_metrics(runtime: Runtime) -> None:
    """Everything /metrics shows that is not counted as it happens: tree mirror, pool gauges and
    the servers' learned move rates."""
    runtime.metrics.sync_tree(runtime.coordinator.tree.stats())
    runtime.metrics.queue_length.set(runtime.coordinator.leases.waiting())
    if runtime.arena is not None:
        runtime.metrics.set_arena(runtime.arena.stats())
    for server in runtime.coordinator.servers:
        runtime.metrics.set_move_rates(
            server.name, server.rates.export_bytes_per_s, server.rates.import_bytes_per_s
        )
    await refresh_pool_gauges(runtime)


# ---- the periodic log line ----------------------------------------------------------------------


def cache_summary(runtime: Runtime) -> str:
    """One structured log line on the host cache (key=value, like the per-request line)."""
    s = runtime.coordinator.tree.stats()
    m = runtime.metrics
    # One collection of the registry (a value() per cause collected it once per cause: tens of
    # milliseconds of a loaded event loop, once a minute, in every request's tail latency).
    counts = m.total("radix_fallbacks_total", "cause", FALLBACK_CAUSES)
    fallbacks = ",".join(f"{c}:{int(counts[c])}" for c in FALLBACK_CAUSES)
    dedup = s.logical_tokens / s.unique_tokens if s.unique_tokens else 0.0
    return (
        f"cache terminal_nodes={s.leaves} nodes={s.nodes} host_bytes={s.bytes} budget_bytes={s.budget_bytes} "
        f"unique_tokens={s.unique_tokens} logical_tokens={s.logical_tokens} dedup={dedup:.2f} "
        f"saves={s.saves} loads={s.loads} evictions={s.evictions} evicted_tokens={s.evicted_tokens} "
        f"fallbacks={fallbacks}"
    )


async def summary_loop(runtime: Runtime, interval_s: float = 60.0) -> None:
    """Log ``cache_summary`` every ``interval_s`` seconds when it changed since the last line.

    Run it as its own task and cancel it on shutdown (not with ``runtime.spawn``: drain()
    waits for spawned tasks to end, and this one never does)."""
    last = ""
    while True:
        await asyncio.sleep(interval_s)
        line = cache_summary(runtime)
        if line != last:
            log.info("%s", line)
            last = line
