"""Wiring: connect to the servers, check them, build the coordinator, run the app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.config import Config
from proxy.core.payload import KvLayout
from proxy.core.radix import RadixTree
from proxy.core.resident import ResidentIndex
from proxy.errors import ConfigError, RadixError
from proxy.server.admin import summary_loop
from proxy.server.backend import Backend
from proxy.server.coordinator import Coordinator, ServerState, SlotState
from proxy.server.metrics import Metrics
from proxy.server.mover import KvMover
from proxy.server.recorder import Recorder
from proxy.server.sharing import Sharing
from proxy.tokenizer import CORPUS, PromptTokenizer, UnsupportedTokenizerError, check_parity, load_tokenizer

log = logging.getLogger("radix")


class Runtime:
    def __init__(self, config: Config, session: aiohttp.ClientSession, coordinator: Coordinator,
                 metrics: Metrics) -> None:
        self.config = config
        self.session = session
        self.coordinator = coordinator
        self.metrics = metrics
        self.primary = coordinator.servers[0].backend
        self.local_tokenizer: PromptTokenizer | None = None
        self.tokenizer_note = "server"
        self._tasks: set[asyncio.Task[Any]] = set()
        self.recorder = Recorder(config.record_path) if config.record_path else None

    async def tokenize(self, prompt: str) -> np.ndarray:
        """The prompt's tokens exactly as the server's chat path makes them."""
        if self.local_tokenizer is not None:
            ids = await asyncio.to_thread(self.local_tokenizer.encode, prompt)
        else:
            ids = await self.primary.tokenize(prompt, add_special=True, parse_special=True)
        return np.asarray(ids, dtype=np.int32)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Background work (saving KV after an answer) that must not be garbage-collected."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        await self.drain()
        await self.session.close()
        if self.recorder is not None:
            self.recorder.close()


async def create_runtime(config: Config, registry: CollectorRegistry | None = None) -> Runtime:
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0))
    try:
        names = tuple(f"s{i}" for i in range(len(config.backends)))
        metrics = Metrics(registry or CollectorRegistry(), names)
        servers = [await _connect(config, name, url, session, metrics) for name, url in zip(names, config.backends,
                                                                                             strict=True)]
        prints = {s.mover.compat.get("fingerprint") for s in servers}
        if len(prints) != 1:
            raise ConfigError("the servers run different models or KV layouts",
                              fix="put one model (and one KV type) behind one proxy")
        tree = RadixTree(config.cache_bytes)
        runtime = Runtime(config, session, Coordinator(config, servers, tree, metrics), metrics)
        await _setup_tokenizer(runtime)
        return runtime
    except BaseException:
        await session.close()
        raise


async def _connect(config: Config, name: str, url: str, session: aiohttp.ClientSession,
                   metrics: Metrics) -> ServerState:
    backend = Backend(url, session, config.kvctl_key)
    try:
        caps = await backend.caps()
    except aiohttp.ClientError as exc:
        raise ConfigError(f"cannot reach llama-server at {url}: {exc}", fix="start it, or fix --backend-url") from exc
    except RadixError as exc:
        raise ConfigError(f"{url} has no usable /kvctl API ({exc.message})",
                          fix="run the patched llama-server (`radixctl build`) with --kvctl -kvu --cache-ram 0 "
                          "-sps 0, and pass --kvctl-key if it has one") from exc
    compat = dict(caps["compat"])
    layout = KvLayout.from_caps(compat)
    shm = _usable_shm(config.shm_dir, caps.get("dir"))
    slots_info = await backend.slots(tokens=True)
    slots = [SlotState(int(s["id"]), np.asarray(s.get("tokens", []), dtype=np.int32)
                       if int(s.get("pos_max", -1)) + 1 == len(s.get("tokens", [])) else np.zeros(0, np.int32))
             for s in slots_info["slots"]]
    n_ctx_slot = int(caps.get("n_ctx_slot") or caps.get("n_ctx") or 0)
    mover = KvMover(backend, layout, compat, shm, metrics)
    sharing = await _sharing(config, name, backend, caps) if config.kv_share else None
    log.info("%s: %s, %d slots, %d cells, payloads %s%s", name, url, len(slots), int(caps.get("n_cells", 0)),
             f"via {shm}" if shm else "inline", ", resident sharing on" if sharing else "")
    return ServerState(name, backend, mover, slots, n_ctx_slot, sharing)


async def _sharing(config: Config, name: str, backend: Backend, caps: dict[str, Any]) -> Sharing:
    if not caps.get("sharing"):
        reasons = "; ".join(caps.get("reasons") or ["the server does not offer owner sequences"])
        raise ConfigError(f"{name} cannot share resident KV: {reasons}",
                          fix="start llama-server with --kvctl-owners N (N > 0), or use --cache-kv-share off")
    n_cells = int(caps["n_cells"])
    props = await backend.get_json("/props")
    n_ubatch = int(props.get("n_ubatch") or (props.get("default_generation_settings") or {}).get("n_ubatch") or 512)
    first, end = caps["owner_ids"]
    index = ResidentIndex(range(int(first), int(end)), config.kv_share_max_entries)
    budget = config.kv_share_cells or n_cells // 2
    headroom = config.kv_share_headroom or min(n_ubatch, max(1, n_cells // 8))
    # Owners left by an earlier proxy would hold cells nobody accounts for.
    for owner in range(int(first), int(end)):
        await backend.kv_post("release", {"owner": owner}, cause="release")
    log.info("%s: resident sharing: %d entries, budget %d cells, headroom %d cells", name, index.max_entries,
             budget, headroom)
    return Sharing(backend, index, budget_cells=budget, headroom=headroom, min_tokens=config.kv_share_min_tokens)


def _usable_shm(mine: Path | None, theirs: str | None) -> Path | None:
    """Files only when proxy and server name the same directory and the proxy can write it."""
    if not mine or not theirs:
        return None
    if Path(theirs).resolve() != mine.resolve():
        log.warning("server payload dir %s differs from --shm-dir %s: using inline payloads", theirs, mine)
        return None
    return mine if os.access(mine, os.W_OK) else None


async def _setup_tokenizer(runtime: Runtime) -> None:
    """Use the local tokenizer only if it matches the server's on the built-in corpus."""
    props = await runtime.primary.get_json("/props")
    model_path = Path(str(props.get("model_path", "")))
    cache = runtime.config.tokenizer_cache or Path(tempfile.gettempdir()) / "radix-tokenizers"
    try:
        tokenizer = PromptTokenizer(await asyncio.to_thread(load_tokenizer, model_path, cache))
    except (OSError, ValueError, UnsupportedTokenizerError, RadixError) as exc:
        runtime.tokenizer_note = f"server (local tokenizer unavailable: {exc})"
        runtime.metrics.tokenizer_fallback.set(1)
        log.warning("tokenizer: using the server's /tokenize: %s", exc)
        return

    async def remote(text: str) -> list[int]:
        return await runtime.primary.tokenize(text, add_special=True, parse_special=True)

    result = await check_parity(tokenizer, remote, CORPUS)
    if result.ok:
        runtime.local_tokenizer = tokenizer
        runtime.tokenizer_note = "local"
        runtime.metrics.tokenizer_fallback.set(0)
        log.info("tokenizer: local tokenizer matches the server on %d corpus texts", len(CORPUS))
    else:
        runtime.tokenizer_note = f"server ({len(result.mismatches)} corpus mismatches)"
        runtime.metrics.tokenizer_fallback.set(1)
        log.warning("tokenizer: local tokenizer differs from the server on %d texts; using the server's",
                    len(result.mismatches))


async def start_site(runtime: Runtime) -> web.AppRunner:
    from proxy.server.app import build_app

    runner = web.AppRunner(build_app(runtime), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, runtime.config.host, runtime.config.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"cannot listen on {runtime.config.host}:{runtime.config.port}: {exc.strerror}",
                          fix="choose another --port, or stop what listens there") from exc
    return runner


async def serve_forever(config: Config, on_ready: Any = None) -> None:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runtime = await create_runtime(config)
    runner = await start_site(runtime)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    summary = loop.create_task(summary_loop(runtime))
    try:
        if on_ready is not None:
            on_ready(runtime)
        await stop.wait()
    finally:
        summary.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await summary
        await runner.cleanup()
        await runtime.close()


def up_forever(*, model_arg: str | None, server_port: int, n_parallel: int, ctx_size: int, threads: int | None,
               build_backend: str, server_args: tuple[str, ...], proxy_kw: dict[str, Any]) -> None:
    from proxy.native.build import BuildSpec, build_server
    from proxy.native.fetch import cache_root, say
    from proxy.native.launch import ServerProcess, ServerSpec, check_port_free, free_port
    from proxy.native.model import resolve_model

    host, port = proxy_kw["host"], proxy_kw["port"]
    check_port_free(host, port, "proxy")
    model = resolve_model(model_arg)
    binary = build_server(BuildSpec(variant="patched", backend=build_backend))
    shm_dir = proxy_kw.pop("shm_dir", None) or _default_shm_dir(port)
    spec = ServerSpec(binary=binary, model=model, port=server_port or free_port(), n_parallel=n_parallel,
                      ctx_size=ctx_size, threads=threads, kvctl_dir=shm_dir, kvctl_key=proxy_kw.get("kvctl_key"),
                      extra_args=server_args)
    server = ServerProcess(spec, cache_root() / "logs" / f"llama-server-{spec.port}.log")
    say(f"starting llama-server on {spec.url} (log: {server.log_path})")
    server.start()
    config = Config(backends=(spec.url,), shm_dir=shm_dir, tokenizer_cache=cache_root() / "tokenizers", **proxy_kw)

    def ready(runtime: Runtime) -> None:
        base = f"http://{config.host}:{config.port}/v1"
        say(f"proxy ready. OpenAI base URL: {base}   (tokenizer: {runtime.tokenizer_note})")
        say("try:\n  curl " + base + "/chat/completions -H 'Content-Type: application/json' \\\n"
            "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Say hello\"}], \"max_tokens\": 32}'")

    try:
        asyncio.run(serve_forever(config, on_ready=ready))
    except KeyboardInterrupt:
        pass
    finally:
        say("stopping llama-server")
        server.stop()
        with contextlib.suppress(OSError):
            for leftover in shm_dir.glob("radix-*.kv"):
                leftover.unlink()
            shm_dir.rmdir()


def _default_shm_dir(port: int) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"radix-{os.getuid()}-{port}"


__all__ = ["Runtime", "create_runtime", "serve_forever", "start_site", "up_forever"]
