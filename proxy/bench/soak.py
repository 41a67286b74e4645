"""``radixctl bench soak``: the agents workload against ``radixctl up`` for a long while, with
its llama-server killed every few minutes (the supervisor restarts it).

What it reports: requests answered and failed, TTFT p50/p99 in each window between kills,
how long after each kill the first answer reused cached tokens again (the host tree warming
the new server), and the proxy's resident memory over time (it should stay flat).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from proxy.bench.agents import agents
from proxy.errors import ConfigError
from proxy.native.launch import free_port, llama_server_pids
from proxy.traffic.runner import RequestResult, run_workload

RSS_EVERY_S = 10.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(
    results: list[RequestResult],
    kills: list[float],
    rss: list[tuple[float, int]],
    duration_s: float,
    tree: list[tuple[float, int]] | None = None,
    parts: list[tuple[float, int, int]] | None = None,
) -> dict[str, Any]:
    """Pure: figures from the results (``sent_s`` from the run's start), kill times, RSS samples
    (KiB) and host-tree sizes (bytes: RSS minus the tree is what must stay flat). ``parts``:
    (time, RssAnon KiB, RssShmem KiB): with the KV arena the tree lives in shared memory mapped
    whole at startup, counted once in RssShmem, so RssAnon is what must stay flat."""
    ok = [r for r in results if r.ok]
    bounds = [0.0, *kills, duration_s]
    windows = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        ttfts = [r.ttft_s for r in ok if start <= r.sent_s < end and r.ttft_s is not None]
        windows.append(
            {
                "from_s": round(start, 1),
                "to_s": round(end, 1),
                "answered": len(ttfts),
                "ttft_p50_s": percentile(ttfts, 50),
                "ttft_p99_s": percentile(ttfts, 99),
            }
        )
    warm = []
    for k in kills:
        hit = next(
            (r for r in sorted(ok, key=lambda r: r.sent_s) if r.sent_s >= k and (r.cache_n or 0) > 0), None
        )
        warm.append(round(hit.sent_s - k, 1) if hit is not None else None)
    rss_mib = [v / 1024 for _, v in rss]
    return {
        "duration_s": round(duration_s, 1),
        "requests": len(results),
        "answered": len(ok),
        "failed": len(results) - len(ok),
        "failures": sorted({f"{r.status} {r.error or ''}".strip() for r in results if not r.ok}),
        "kills_s": [round(k, 1) for k in kills],
        "windows": windows,
        "seconds_to_first_cache_hit_after_kill": warm,
        "rss_mib": {
            "first": rss_mib[0] if rss_mib else None,
            "last": rss_mib[-1] if rss_mib else None,
            "max": max(rss_mib) if rss_mib else None,
        },
        "rss_samples": [(round(t, 1), v) for t, v in rss],
        "rss_anon_mib": _first_last_max([a / 1024 for _, a, _ in parts or []]),
        "rss_shmem_mib": _first_last_max([s / 1024 for _, _, s in parts or []]),
        "tree_mib_samples": [(round(t, 1), round(v / 2**20, 1)) for t, v in tree or []],
    }


def _first_last_max(values: list[float]) -> dict[str, float | None]:
    return {
        "first": values[0] if values else None,
        "last": values[-1] if values else None,
        "max": max(values) if values else None,
    }


def _status_kib(pid: int) -> dict[str, int]:
    """The ``kB`` fields of /proc/PID/status (VmRSS, RssAnon, RssShmem, ...); empty when gone."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            fields = rest.split()
            if len(fields) == 2 and fields[1] == "kB":
                out[key] = int(fields[0])
    except OSError:
        return {}
    return out


def _tree_bytes(url: str) -> int | None:
    """The host tree's bytes from the proxy's admin API (local clients need no key)."""
    try:
        with urllib.request.urlopen(f"{url}/radix/stats", timeout=10) as resp:
            return int(json.loads(resp.read())["tree"]["bytes"])
    except (OSError, ValueError, KeyError):
        return None


def _wait_serving(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"radixctl up exited with code {proc.returncode}", fix="see its output above")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise ConfigError(f"radixctl up did not serve within {timeout_s:.0f} s", fix="see its output above")


def run_soak(
    out_dir: Path,
    minutes: float,
    kill_every_min: float,
    sessions: int,
    system_tokens: int,
    max_tokens: int,
    threads: int,
    ctx_size: int,
    say: Any = print,
) -> dict[str, Any]:
    port, server_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "proxy.cli",
        "up",
        "--port",
        str(port),
        "--server-port",
        str(server_port),
        "-t",
        str(threads),
        "-c",
        str(ctx_size),
        "-np",
        "4",
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "up.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_serving(url, proc, 600)
        say(f"soak: {minutes:g} min against {url}, llama-server killed every {kill_every_min:g} min")
        results, kills, rss, tree, parts, duration = asyncio.run(
            _soak(
                url,
                proc.pid,
                server_port,
                minutes * 60,
                kill_every_min * 60,
                sessions,
                system_tokens,
                max_tokens,
                say,
            )
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
    report = summarize(results, kills, rss, duration, tree, parts)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    (out_dir / "results.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in results))
    return report


async def _soak(
    url: str,
    proxy_pid: int,
    server_port: int,
    duration_s: float,
    kill_every_s: float,
    sessions: int,
    system_tokens: int,
    max_tokens: int,
    say: Any,
) -> tuple[
    list[RequestResult],
    list[float],
    list[tuple[float, int]],
    list[tuple[float, int]],
    list[tuple[float, int, int]],
    float,
]:
    t0 = time.monotonic()
    results: list[RequestResult] = []
    kills: list[float] = []
    rss: list[tuple[float, int]] = []
    tree: list[tuple[float, int]] = []
    parts: list[tuple[float, int, int]] = []

    async def killer() -> None:
        while True:
            await asyncio.sleep(kill_every_s)
            pid = next(iter(llama_server_pids(server_port)), None)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                kills.append(time.monotonic() - t0)
                say(f"soak: killed llama-server (pid {pid}) at {kills[-1]:.0f} s")

    async def sampler() -> None:
        while True:
            status = _status_kib(proxy_pid)
            if "VmRSS" in status:
                rss.append((time.monotonic() - t0, status["VmRSS"]))
                parts.append((time.monotonic() - t0, status.get("RssAnon", 0), status.get("RssShmem", 0)))
            nbytes = await asyncio.to_thread(_tree_bytes, url)
            if nbytes is not None:
                tree.append((time.monotonic() - t0, nbytes))
            await asyncio.sleep(RSS_EVERY_S)

    tasks = [asyncio.create_task(killer()), asyncio.create_task(sampler())]
    try:
        round_no = 0
        while time.monotonic() - t0 < duration_s:
            start = time.monotonic() - t0
            # The same sessions every round: what the cache is for, and what a restart loses.
            workload = agents(system_tokens=system_tokens, sessions=sessions, max_tokens=max_tokens, seed=0)
            for r in await run_workload(workload, url, label=f"soak round {round_no}", timeout_s=600):
                r.sent_s += start
                results.append(r)
            round_no += 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results, kills, rss, tree, parts, time.monotonic() - t0
