"""``radixctl bench restore --tier disk``: TTFT of a returning prompt restored from the disk tier.

For each prompt size, the same prompt is asked a second time (a new question on the same
document) and the second answer's TTFT is measured on four arms of one llama.cpp commit:

- ``disk``: the proxy with ``--cache-disk``, restarted between the two requests (its RAM
  tree is empty; the first proxy wrote what it held at shutdown), the tier's files dropped
  from the page cache first (``posix_fadvise DONTNEED``), so the bytes come from the disk;
- ``ram``: the proxy without a disk tier, the prompt evicted from every slot by fillers
  (one per slot, at once): a host restore from the RAM tree (route H);
- ``legacy``: stock llama-server with its host prompt cache (``--cache-ram 8192``), the
  same fillers: its own restore;
- ``prefill``: stock llama-server with ``cache_prompt: false``: the whole prompt computed.

Ratios are against the full prefill. Results go to ``disk-restore.json`` in the output dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import click

from proxy.bench.arms import ArmDef, ArmSettings, _start_proxy, _stop, patched_server, start_arm
from proxy.bench.workloads import QUESTION_WORDS, chat, question
from proxy.native.launch import free_port
from proxy.traffic.runner import RequestResult, _session, send
from proxy.traffic.text import prose, seeded, words_for

ARMS = ("disk", "ram", "legacy", "prefill")


@dataclass
class Row:
    tokens: int  # the size asked for
    arm: str
    ttft_s: float | None
    prompt_n: int | None  # tokens the server computed for the second request
    cache_n: int | None  # tokens it reused
    route: str | None
    error: str | None = None


@dataclass(frozen=True)
class Prompts:
    first: dict[str, Any]
    again: dict[str, Any]
    fillers: tuple[dict[str, Any], ...]


def prompts(n: int, n_fillers: int, max_tokens: int, seed: int) -> Prompts:
    doc = f"[doc-{n}] " + prose(seeded(seed, "disk", n), max(1, words_for(n) - QUESTION_WORDS - 3))
    fillers = tuple(
        chat(
            f"[filler-{n}-{j}] " + prose(seeded(seed, "disk-fill", n, j), max(1, words_for(n) // 2)),
            question(seed, "disk-fill", n, j),
            max_tokens,
        )
        for j in range(n_fillers)
    )
    return Prompts(
        chat(doc, question(seed, "disk", n, 1), max_tokens),
        chat(doc, question(seed, "disk", n, 2), max_tokens),
        fillers,
    )


async def _ask_all(url: str, bodies: list[dict[str, Any]], timeout_s: float = 1800) -> list[RequestResult]:
    async with _session(timeout_s) as session:
        results = [RequestResult(f"q{i}", "", "", "", 0.0) for i in range(len(bodies))]
        await asyncio.gather(
            *(
                send(session, f"{url}/v1/chat/completions", {**b, "stream": True}, r)
                for b, r in zip(bodies, results, strict=True)
            )
        )
    return results


def ask(url: str, *bodies: dict[str, Any]) -> list[RequestResult]:
    results = asyncio.run(_ask_all(url, list(bodies)))
    bad = [r.error or f"HTTP {r.status}" for r in results if not r.ok]
    if bad:
        raise click.ClickException(f"a benchmark request failed at {url}: {bad[0]}")
    return results


def _row(n: int, arm: str, r: RequestResult) -> Row:
    return Row(n, arm, r.ttft_s, r.prompt_n, r.cache_n, r.route, r.error)


def drop_page_cache(directory: Path) -> int:
    """Evict the tier's files from the page cache (clean pages after the fsync): the next read
    comes from the device. Returns the files dropped."""
    n = 0
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


@contextlib.contextmanager
def _proxy(server: Any, shm: Path, settings: ArmSettings, log: Path, extra: tuple[str, ...]) -> Iterator[str]:
    port = free_port()
    arm = ArmDef("proxy-disk", "patched", (), "proxy", proxy=True, proxy_args=extra)
    proc = _start_proxy(server.url, port, shm, settings, arm, log, server.spec.kvctl_key)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)  # a graceful stop: the disk tier writes what RAM holds
        try:
            proc.wait(120)
        except Exception:
            _stop(proc)


def _stock_rows(
    arm: str, sizes: tuple[int, ...], settings: ArmSettings, sets: dict[int, Prompts]
) -> list[Row]:
    rows = []
    with start_arm("nocache" if arm == "prefill" else "legacy", settings) as running:
        for n in sizes:
            p = sets[n]
            if arm == "prefill":
                (r,) = ask(running.front_url, {**p.again, "cache_prompt": False})
            else:
                ask(running.front_url, p.first)
                ask(running.front_url, *p.fillers)
                (r,) = ask(running.front_url, p.again)
            rows.append(_row(n, arm, r))
            _say(
                f"{arm:7s} {n:6d} tokens: TTFT {r.ttft_s or 0:.3f} s (computed {r.prompt_n}, reused {r.cache_n})"
            )
    return rows


def _proxy_rows(
    sizes: tuple[int, ...], settings: ArmSettings, ctx: int, sets: dict[int, Prompts]
) -> list[Row]:
    rows = []
    with patched_server(settings, ctx, "disk-tier") as (server, shm):
        logs = settings.log_dir
        with _proxy(server, shm, settings, logs / "proxy-ram.log", ()) as url:
            for n in sizes:
                p = sets[n]
                ask(url, p.first)
                ask(url, *p.fillers)
                (r,) = ask(url, p.again)
                rows.append(_row(n, "ram", r))
                _say(
                    f"ram     {n:6d} tokens: TTFT {r.ttft_s or 0:.3f} s (route {r.route}, reused {r.cache_n})"
                )
        with tempfile.TemporaryDirectory(prefix="radix-bench-disk-", dir=logs) as tmp:
            tier = Path(tmp) / "tier"
            flags = ("--cache-disk", str(tier))
            for n in sizes:
                p = sets[n]
                with _proxy(server, shm, settings, logs / f"proxy-disk-{n}-a.log", flags) as url:
                    ask(url, p.first)
                dropped = drop_page_cache(tier)
                with _proxy(server, shm, settings, logs / f"proxy-disk-{n}-b.log", flags) as url:
                    (r,) = ask(url, p.again)
                    metrics = _promotions(url)
                rows.append(_row(n, "disk", r))
                _say(
                    f"disk    {n:6d} tokens: TTFT {r.ttft_s or 0:.3f} s (route {r.route}, reused {r.cache_n}, "
                    f"promotions {metrics}, {dropped} files out of the page cache)"
                )
                shutil.rmtree(tier, ignore_errors=True)  # the next size starts from an empty tier
    return rows


def _promotions(url: str) -> int:
    """radix_disk_promotions_total, from the proxy's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("radix_disk_promotions_total "):
                return int(float(line.split()[1]))
    return 0


def run_disk_restore(
    settings: ArmSettings,
    sizes: tuple[int, ...],
    out_dir: Path,
    arms: tuple[str, ...] = ARMS,
    max_tokens: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    n_fillers = settings.n_parallel
    ctx = max(settings.ctx_size, 2 * max(sizes) + 1024)
    settings = replace(settings, ctx_size=ctx)
    sets = {n: prompts(n, n_fillers, max_tokens, seed) for n in sizes}
    started = time.time()
    rows: list[Row] = []
    if "disk" in arms or "ram" in arms:
        rows += [r for r in _proxy_rows(sizes, settings, ctx, sets) if r.arm in arms]
    for arm in ("legacy", "prefill"):
        if arm in arms:
            rows += _stock_rows(arm, sizes, settings, sets)
    report = {
        "bench": "restore --tier disk",
        "sizes": list(sizes),
        "ctx_size": ctx,
        "n_parallel": settings.n_parallel,
        "threads": settings.threads,
        **settings.cpus_setting(),
        "seconds": round(time.time() - started, 1),
        "rows": [asdict(r) for r in rows],
        "ratios": ratios(rows),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "disk-restore.json").write_text(json.dumps(report, indent=2))
    click.echo(format_report(report))
    return report


def ratios(rows: list[Row]) -> dict[str, dict[str, float | None]]:
    """Per size: each arm's TTFT as a fraction of the full prefill's (lower is better)."""
    out: dict[str, dict[str, float | None]] = {}
    for n in sorted({r.tokens for r in rows}):
        by = {r.arm: r.ttft_s for r in rows if r.tokens == n}
        base = by.get("prefill")
        out[str(n)] = {a: (t / base if t is not None and base else None) for a, t in by.items()}
    return out


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"{'tokens':>7}  {'arm':8} {'TTFT s':>8} {'x prefill':>9} {'route':>6} {'computed':>8} {'reused':>7}"
    ]
    for row in report["rows"]:
        ratio = report["ratios"].get(str(row["tokens"]), {}).get(row["arm"])
        lines.append(
            f"{row['tokens']:>7}  {row['arm']:8} {row['ttft_s'] or 0:>8.3f} "
            f"{'' if ratio is None else f'{ratio:.3f}':>9} {row['route'] or '-':>6} "
            f"{row['prompt_n'] if row['prompt_n'] is not None else '-':>8} "
            f"{row['cache_n'] if row['cache_n'] is not None else '-':>7}"
        )
    return "\n".join(lines)


def _say(message: str) -> None:
    click.echo(f"[bench] {message}", err=True)
