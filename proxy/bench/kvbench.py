"""``radixctl bench kvctl``: KV export/import throughput through the proxy's mover.

One prefill puts ``max(sizes)`` real tokens of KV into slot 0 of a patched server. For each
size, ``reps`` exports of ``[0,n)`` from slot 0 and ``reps`` imports of that payload into
slot 1 go through ``KvMover`` (payload files in the shared-memory directory, as in
production). Each is timed twice: the whole mover call, and the /kvctl HTTP call inside it,
during which the server's main loop does the copy and serves nothing else. A plain numpy
copy of the same number of bytes on this machine is the yardstick. The server's own copy
(``t_ms``) is its device-to-host rate for an export and host-to-device for an import where its
KV is on a device (where it lives: its caps, ``memory.buffers``), and the rates the mover learned
from these moves are the ones the proxy's cost model would price restores at. Optionally a tiny
generation on slot 3 is sent during one export and one import, and when idle, to see the
main loop's stall from a client's side.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
from prometheus_client import CollectorRegistry

from proxy.config import Config
from proxy.core.payload import KvLayout, blob_size
from proxy.errors import FallbackCause
from proxy.server.dataplane.arena import Arena
from proxy.server.dataplane.backend import MOVE_BASE_S, ServerClient
from proxy.server.dataplane.kvctl import KvRoute
from proxy.server.dataplane.mover import INLINE_LIMIT, KvMover
from proxy.server.metrics import ARENA_PATHS, Metrics
from proxy.traffic.text import prose, seeded

DEFAULT_SIZES = (512, 2048, 8192)
PARALLEL_SLOTS = (1, 2)  # slot 0 holds the prefill, slot 3 serves the probe
PREFILL_READ_S = 3600.0


class TimedBackend(ServerClient):
    """A ServerClient that records the wall time of every /kvctl POST."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.last_call_s = 0.0
        self.last_loop_ms: float | None = None

    async def kv_post(
        self, route: KvRoute, body: Mapping[str, Any], cause: FallbackCause, timeout_s: float = MOVE_BASE_S
    ) -> Any:
        started = time.perf_counter()
        self.last_loop_ms = None
        try:
            reply = await super().kv_post(route, body, cause, timeout_s)
        finally:
            self.last_call_s = time.perf_counter() - started
        # The server's own time on its main loop for the move (``t_ms``, when it reports one).
        if isinstance(reply, dict) and isinstance(reply.get("t_ms"), int | float):
            self.last_loop_ms = float(reply["t_ms"])
        return reply


def clamp_sizes(sizes: tuple[int, ...], n_ctx_slot: int, say: Any) -> tuple[int, ...]:
    """Sizes a slot can hold: a prompt must be shorter than the slot's context (which the
    server caps at the model's training context), so larger sizes move ``n_ctx_slot - 1``."""
    limit = n_ctx_slot - 1
    for n in sizes:
        if n > limit:
            say(
                f"{n} tokens exceed what one slot can hold (slot context {n_ctx_slot}, capped by "
                f"the model's training context): moving {limit} tokens instead"
            )
    return tuple(sorted({min(n, limit) for n in sizes}))


async def _prefill(backend: ServerClient, tokens: list[int]) -> None:
    """Slot 0 computes ``tokens`` (a long prefill: not the 10 s deadline of plain calls)."""
    body = {"prompt": tokens, "n_predict": 1, "id_slot": 0, "cache_prompt": True, "temperature": 0}
    async with backend.request(
        "POST",
        "/completion",
        data=orjson.dumps(body),
        headers={"Content-Type": "application/json"},
        # One response after the whole prefill: 8k tokens took over 10 min on a loaded 2-core machine.
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=PREFILL_READ_S),
    ) as resp:
        if resp.status != 200:
            raise RuntimeError(f"prefill of {len(tokens)} tokens answered {resp.status}: {await resp.text()}")


def kvctl_ctx_size(sizes: tuple[int, ...]) -> int:
    """KV pool for slot 0 and the parallel imports' slots all holding the largest size, plus
    the probe."""
    return (1 + len(PARALLEL_SLOTS)) * max(sizes) + 1024


async def _parallel_imports(
    mover: KvMover, tokens: list[int], segment: Any, reps: int, one_ms: float, size: int
) -> dict[str, Any]:
    """The same payload imported into PARALLEL_SLOTS at once, as the proxy's restores into
    different slots run (movelock.py), against one import after the other (``one_ms`` each):
    the server's main loop copies them in turn, while each one's HTTP-thread checks overlap."""
    walls = []
    for _ in range(reps):
        started = time.perf_counter()
        await asyncio.gather(*(mover.import_(slot, 0, tokens, segment) for slot in PARALLEL_SLOTS))
        walls.append(1000 * (time.perf_counter() - started))
    wall = statistics.median(walls)
    serial = len(PARALLEL_SLOTS) * one_ms
    return {
        "slots": len(PARALLEL_SLOTS),
        "wall_ms_p50": wall,
        "serial_ms": serial,
        "speedup": serial / wall,
        "mb_s": len(PARALLEL_SLOTS) * size / (wall / 1000) / 1e6,
    }


async def _tokens(backend: ServerClient, n: int) -> list[int]:
    text = prose(seeded("kvctl"), max(64, n))
    ids = await backend.tokenize(text, add_special=False)
    while len(ids) < n:
        ids += ids
    return ids[:n]


async def _probe(backend: ServerClient) -> float:
    started = time.perf_counter()
    await backend.post_json(
        "/completion", {"prompt": "Hi", "n_predict": 1, "id_slot": 3, "cache_prompt": False}
    )
    return 1000 * (time.perf_counter() - started)


def memcpy_mb_s(nbytes: int, reps: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(max(1, reps)):
        started = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times) / 1e6


async def _timed(coro: Any, probe: ServerClient | None) -> tuple[float, float | None]:
    started = time.perf_counter()
    if probe is None:
        await coro
        return time.perf_counter() - started, None
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0.002)  # let the /kvctl call reach the server first
    probe_ms = await _probe(probe)
    await task
    return time.perf_counter() - started, probe_ms


async def run_kvctl_bench(
    server_url: str,
    shm_dir: Path | None,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    reps: int = 5,
    probe: bool = True,
    progress: Any = None,
    kvctl_key: str | None = None,
    arena: bool = False,
    chunk_tokens: int = Config.kv_arena_chunk,
) -> dict[str, Any]:
    """With ``arena`` (and ``shm_dir``): moves through a KV arena made in ``shm_dir`` for
    the run, as the proxy's with --kv-arena (else through payload files, or inline)."""
    say = progress or (lambda _msg: None)
    sizes = tuple(sorted(set(sizes)))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        backend = TimedBackend(server_url, session, kvctl_key)
        plain = ServerClient(server_url, session)
        caps = await backend.caps()
        compat = dict(caps.compat)
        layout = KvLayout.from_caps(compat)
        shm = shm_dir if shm_dir and caps.dir and Path(caps.dir).resolve() == shm_dir.resolve() else None
        sizes = clamp_sizes(sizes, caps.n_ctx_slot, say)
        home = None
        if arena and shm is not None and caps.export_chunks:
            # Room for one export's blocks while the previous one is still imported from.
            home = Arena.create(shm, 3 * blob_size(layout, max(sizes)) + (64 << 20))
            say(f"KV arena: {home.capacity >> 20} MiB ({home.note})")
        try:
            metrics = Metrics(CollectorRegistry(), ("s0",))
            mover = KvMover(
                backend,
                layout,
                compat,
                shm,
                metrics,
                arena=home,
                chunk_tokens=chunk_tokens,
                n_ctx_slot=caps.n_ctx_slot,
            )
            tokens = await _tokens(plain, max(sizes))
            say(f"prefilling {len(tokens)} tokens into slot 0")
            started = time.perf_counter()
            await _prefill(plain, tokens)
            prefill_s = time.perf_counter() - started
            slot0 = (await backend.slots(tokens=True)).slot(0)
            held = slot0.held_tokens().tolist()[: slot0.pos_max + 1]
            probe_idle = statistics.median([await _probe(plain) for _ in range(3)]) if probe else None
            rows = []
            for n in sizes:
                if n > len(held):
                    say(f"skipping {n} tokens: slot 0 holds only {len(held)}")
                    continue
                size = blob_size(layout, n)
                if shm is None and size > INLINE_LIMIT:
                    # The server refuses a larger payload in a body: the proxy's own moves of such a
                    # prefix to an inline server fall back to prefill (docs/bench.md).
                    say(f"skipping {n} tokens inline: {size} bytes exceed the inline limit of {INLINE_LIMIT}")
                    continue
                row: dict[str, Any] = {"tokens": n, "bytes": size, "bytes_per_token": layout.bytes_per_token}
                segment = None
                for op in ("export", "import"):
                    totals, servers, loops, probes = [], [], [], []
                    for rep in range(reps):
                        with_probe = plain if probe and rep == reps - 1 else None
                        if op == "export":
                            holder: dict[str, Any] = {}

                            async def export(holder: dict[str, Any] = holder, n: int = n) -> None:
                                holder["seg"] = await mover.export({"slot": 0}, 0, held[:n])

                            total, probe_ms = await _timed(export(), with_probe)
                            segment = holder["seg"]
                        else:
                            assert segment is not None
                            total, probe_ms = await _timed(mover.import_(1, 0, held[:n], segment), with_probe)
                        totals.append(1000 * total)
                        servers.append(1000 * backend.last_call_s)
                        if backend.last_loop_ms is not None:
                            loops.append(backend.last_loop_ms)
                        if probe_ms is not None:
                            probes.append(probe_ms)
                    row[op] = {
                        "total_ms_p50": statistics.median(totals),
                        "total_ms_max": max(totals),
                        "server_ms_p50": statistics.median(servers),
                        "server_ms_max": max(servers),
                        "mb_s": size / (statistics.median(totals) / 1000) / 1e6,
                        "server_mb_s": size / (statistics.median(servers) / 1000) / 1e6,
                        "loop_ms_p50": statistics.median(loops) if loops else None,
                        "loop_ms_max": max(loops) if loops else None,
                        # The server's copy alone: device-to-host (export), host-to-device (import).
                        "device_mb_s": size / (statistics.median(loops) / 1000) / 1e6 if loops else None,
                        "probe_ms": probes[0] if probes else None,
                    }
                assert segment is not None
                row["parallel_import"] = await _parallel_imports(
                    mover, held[:n], segment, reps, row["import"]["total_ms_p50"], size
                )
                row["memcpy_mb_s"] = memcpy_mb_s(size, max(5, reps))
                rows.append(row)
                say(
                    f"{n} tokens ({size / 2**20:.1f} MiB): export {row['export']['total_ms_p50']:.1f} ms "
                    f"({row['export']['mb_s']:.0f} MB/s), import {row['import']['total_ms_p50']:.1f} ms "
                    f"({row['import']['mb_s']:.0f} MB/s), {len(PARALLEL_SLOTS)} imports at once "
                    f"{row['parallel_import']['wall_ms_p50']:.1f} ms "
                    f"({row['parallel_import']['speedup']:.2f}x one after the other), "
                    f"memcpy {row['memcpy_mb_s']:.0f} MB/s"
                )
        finally:
            if home is not None:
                home.close()  # the file goes; the mapping with the last segment
    paths = {
        f"{d}_{p}_bytes": metrics.value("radix_arena_move_bytes_total", direction=d, path=p)
        for d in ("export", "import")
        for p in ARENA_PATHS
    }
    return {
        "workload": {"name": "kvctl", "params": {"sizes": list(sizes), "reps": reps, "probe": probe}},
        "transport": ("shm arena" if home else "shm files") if shm else "inline msgpack",
        "arena": {"chunk_tokens": mover.chunk_tokens, **paths} if home else None,
        "prefill_s": prefill_s,
        "probe_idle_ms": probe_idle,
        "layout_bytes_per_token": layout.bytes_per_token,
        "kv": {
            "devices": list(caps.kv_devices),
            "backends": list(caps.kv_backends),
            "on_host": all(b.host for b in caps.kv_buffers) if caps.kv_buffers else None,
            "unknown": caps.kv_where_unknown(),
            "buffers": [asdict(b) for b in caps.kv_buffers or ()],
        },
        # What the mover learned from these moves (bytes over the server's copy plus the proxy's).
        "learned": {
            "export_mb_s": mover.rates.export_bytes_per_s / 1e6,
            "import_mb_s": mover.rates.import_bytes_per_s / 1e6,
            "moves": mover.rates.moves_seen,
        },
        "sizes": rows,
    }
