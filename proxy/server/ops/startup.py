"""Startup: connect to the servers, check them, build the coordinator, pick the tokenizer."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry

from proxy.config import Config
from proxy.core.radix import RadixTree
from proxy.errors import ConfigError, RadixError
from proxy.server.coordinator import Coordinator, ServerState
from proxy.server.dataplane.arena import Arena, is_shared_memory
from proxy.server.dataplane.backend import ServerClient
from proxy.server.dataplane.layoutcheck import LayoutChecks
from proxy.server.dataplane.paydir import check_private_dir
from proxy.server.http.recorder import Recorder
from proxy.server.metrics import Metrics
from proxy.server.ops.connect import _connect, _listing, _n_vocab, _Unreachable
from proxy.server.ops.models import ModelEntry
from proxy.server.ops.remote_tier import open_remote_tier
from proxy.server.ops.runtime import Runtime
from proxy.server.tiers.disk import DiskTier, compat_key
from proxy.tokenizer import CORPUS, probe
from proxy.tokenizer.template import TemplateProbe, probe_template

log = logging.getLogger("radix")


async def create_runtime(
    config: Config,
    session: aiohttp.ClientSession,
    registry: CollectorRegistry,
    recorder: Recorder | None = None,
) -> Runtime:
    """Connect to the servers, check them, and build the coordinator and tokenizer. Servers
    that do not answer yet are picked up later (``connect_pending``); startup waits up to
    ``startup_timeout_s`` for the first one."""
    try:
        config.backend_specs  # noqa: B018 (parsed here so a typo stops startup with a clear line)
    except ValueError as exc:
        raise ConfigError(str(exc), fix="--backend-url [MODEL=]URL[#auto|#shared|#inline]") from exc
    names = tuple(f"s{i}" for i in range(len(config.backends)))
    metrics = Metrics(registry, names)
    checks = LayoutChecks()
    arena = make_arena(config)
    try:
        return await _build_runtime(config, session, metrics, names, checks, arena, recorder)
    except BaseException:
        if arena is not None:
            arena.close()
        raise


async def _build_runtime(
    config: Config,
    session: aiohttp.ClientSession,
    metrics: Metrics,
    names: tuple[str, ...],
    checks: LayoutChecks,
    arena: Arena | None,
    recorder: Recorder | None,
) -> Runtime:
    servers, pending = await _connect_answering(config, session, metrics, names, checks, arena)
    for server in servers:
        checks.forget(server.instance or "")
    models = await _models(servers)
    tree = RadixTree(config.cache_bytes)
    if arena is not None:
        arena.make_room = tree.evict_lru_leaf
        tree.copier = arena.copy
    coordinator = Coordinator(config, servers, tree, metrics)
    if config.cache_disk is not None:
        if len({json.dumps(s.mover.compat, sort_keys=True) for s in servers}) > 1:
            # One tier directory holds one compatibility key's layout (checked on every read).
            raise ConfigError(
                "--cache-disk serves one model (one KV layout); the servers run several",
                fix="run one proxy per model with a disk tier, or leave --cache-disk unset",
            )
        coordinator.disk = await _disk_tier(config, servers[0], tree, metrics, arena)
    if config.cache_remote is not None:
        coordinator.remote = await open_remote_tier(config, servers, metrics, arena)
    runtime = Runtime(config, session, coordinator, metrics, recorder)
    runtime.arena = arena
    runtime.pending = pending
    runtime.layout_checks = checks
    runtime.models = models
    for entry in models.values():
        backend = next(s.client for s in servers if s.model == entry.name)
        await _setup_tokenizer(runtime, entry, backend)
        await _setup_template(runtime, entry, backend)
        entry.n_vocab = await _n_vocab(backend)
    first = next(iter(models.values()))
    runtime.local_tokenizer, runtime.tokenizer_note = first.local_tokenizer, first.tokenizer_note
    runtime.template, runtime.template_note = first.template, first.template_note
    runtime.n_vocab = first.n_vocab
    return runtime


def make_arena(config: Config) -> Arena | None:
    """The KV arena in --shm-dir, sized by ``arena_bytes`` (None: --kv-arena off, no --shm-dir, or
    a directory not in shared memory, said in a warning)."""
    if not config.kv_arena or config.shm_dir is None:
        return None
    check_private_dir(config.shm_dir)
    if not is_shared_memory(config.shm_dir):
        log.warning(
            "--shm-dir %s is not shared memory (tmpfs): no KV arena, payload files per move", config.shm_dir
        )
        return None
    arena = Arena.create(config.shm_dir, arena_bytes(config))
    log.info("KV arena: %d MiB in %s (%s)", arena.capacity >> 20, config.shm_dir, arena.note)
    return arena


def arena_bytes(config: Config) -> int:
    """--cache-ram, plus with --cache-disk its demotion queue (cache_disk_queue_mib): an edge
    the tree evicted waits there in its block until the tier wrote it, so evictions make room
    for new KV at once instead of when the disk is done."""
    queue = config.cache_disk_queue_mib << 20 if config.cache_disk is not None else 0
    return config.cache_bytes + queue


async def _models(servers: list[ServerState]) -> dict[str, ModelEntry]:
    """The served models by name; servers under one name must share a compatibility key."""
    models: dict[str, ModelEntry] = {}
    media_keys: dict[str, str] = {}
    for server in servers:
        entry = models.get(server.model)
        if (
            server.media_marker
            and media_keys.setdefault(server.model, server.media_keys) != server.media_keys
        ):
            log.warning(
                "%s keys media unlike another server of model %r (another projector, image token "
                "limits or draft model): a request with media goes only to servers keying it as "
                "the one that tokenized it",
                server.name,
                server.model,
            )
        if entry is None:
            listing = await _listing(server.client)
            models[server.model] = ModelEntry(
                server.model, server.model_ns, server.mover.compat, server.named, listing
            )
        elif entry.compat != server.mover.compat:
            raise ConfigError(
                f"the servers named {server.model!r} run different models or KV layouts",
                fix="give each model (and KV type) its own name: --backend-url NAME=URL",
            )
    return models


async def _disk_tier(
    config: Config, server: ServerState, tree: RadixTree, metrics: Metrics, arena: Arena | None
) -> DiskTier:
    """Open the disk tier (entries of other compatibility keys are skipped) and have the tree
    demote what it evicts to it; what it reads back goes into the arena's blocks."""
    assert config.cache_disk is not None
    if server.mover.layout is None:
        raise ConfigError(
            f"--cache-disk needs KV moves, which are off for {server.name}: {'; '.join(server.moves_off)}",
            fix="leave --cache-disk unset for this model",
        )
    tier = DiskTier(
        config.cache_disk,
        config.cache_disk_bytes,
        compat_key(server.mover.compat),
        server.mover.layout,
        metrics.disk,
        min_tokens=config.min_restore_tokens,
        queue_bytes=config.cache_disk_queue_mib * 1024 * 1024,
        timeout_s=config.cache_disk_timeout_s,
        key_file=config.cache_disk_key_file,
        arena=arena,
        chunk_tokens=server.mover.chunk_tokens,
        on_arena_full=metrics.arena_full.labels("promote").inc,
    )
    await tier.open()
    tree.on_evict = tier.demote
    return tier


async def _connect_answering(
    config: Config,
    session: aiohttp.ClientSession,
    metrics: Metrics,
    names: tuple[str, ...],
    checks: LayoutChecks,
    arena: Arena | None,
) -> tuple[list[ServerState], list[tuple[str, str]]]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.startup_timeout_s
    reason = ""
    while True:
        servers, pending = [], []
        for name, url in zip(names, config.backends, strict=True):
            try:
                servers.append(await _connect(config, name, url, session, metrics, checks, arena))
            except _Unreachable as exc:
                pending.append((name, url))  # url: the --backend-url value, spec and all
                reason = exc.message
        if servers or loop.time() > deadline:
            break
        log.warning("no llama-server answers yet (%s); waiting", reason)
        await asyncio.sleep(1.0)
    if not servers:
        raise ConfigError(
            f"no llama-server answered within {config.startup_timeout_s:g} s: {reason}",
            fix="start them, or fix --backend-url",
        )
    for name, url in pending:
        log.warning("%s (%s) does not answer yet; it is taken into routing when it does", name, url)
    return servers, pending


async def connect_pending(runtime: Runtime) -> None:
    """Take servers that did not answer at startup into routing once they do (health loop)."""
    coordinator = runtime.coordinator
    for name, url in list(runtime.pending):
        try:
            server = await _connect(
                runtime.config,
                name,
                url,
                runtime.session,
                runtime.metrics,
                runtime.layout_checks,
                runtime.arena,
            )
        except _Unreachable:
            continue
        except RadixError as exc:
            log.error("%s (%s) answers but cannot serve: %s", name, url, exc.message)
            continue
        entry = runtime.models.get(server.model)
        if entry is not None and server.mover.compat != entry.compat:
            log.error("%s (%s) runs another model or KV layout than %r; kept out", name, url, server.model)
            continue
        if entry is None and (coordinator.disk is not None or coordinator.remote is not None):
            # The disk tier holds one model's KV layout (the one checked at startup).
            log.error(
                "%s (%s) serves another model %r; kept out: a disk or remote tier serves one",
                name,
                url,
                server.model,
            )
            continue
        if entry is None:  # the first server of its model to answer: the model is served from now on
            try:
                await _add_model(runtime, server)
            except (RadixError, aiohttp.ClientError) as exc:
                log.error("%s (%s): model %r not served yet: %s", name, url, server.model, exc)
                continue
        runtime.pending.remove((name, url))
        runtime.layout_checks.forget(server.instance or "")
        coordinator.add_server(server)


async def _add_model(runtime: Runtime, server: ServerState) -> None:
    listing = await _listing(server.client)
    entry = ModelEntry(server.model, server.model_ns, server.mover.compat, server.named, listing)
    await _setup_tokenizer(runtime, entry, server.client)
    entry.n_vocab = await _n_vocab(server.client)
    runtime.models[server.model] = entry
    log.warning("model %r is served from now on (%s answers)", server.model, server.name)


async def _setup_tokenizer(runtime: Runtime, entry: ModelEntry, backend: ServerClient) -> None:
    """Use the local tokenizer only if it matches the server's on the built-in corpus."""
    props = await backend.get_json("/props")
    model_path = Path(str(props.get("model_path", "")))
    cache = runtime.config.tokenizer_cache or Path(tempfile.gettempdir()) / "radix-tokenizers"

    async def remote(text: str) -> list[int]:
        return await backend.tokenize(text, add_special=True, parse_special=True)

    result = await probe(model_path, cache, remote)
    entry.tokenizer_note = result.note
    if result.tokenizer is None or not runtime.models or entry is next(iter(runtime.models.values())):
        runtime.metrics.tokenizer_fallback.set(0 if result.tokenizer is not None else 1)
    if result.tokenizer is not None:
        entry.local_tokenizer = result.tokenizer
        log.info("tokenizer: local tokenizer matches the server on %d corpus texts", len(CORPUS))
    elif result.parity is None:
        log.warning("tokenizer: using the server's /tokenize: %s", result.error)
    else:
        log.warning(
            "tokenizer: local tokenizer differs from the server on %d texts; using the server's",
            result.mismatches,
        )


async def _setup_template(runtime: Runtime, entry: ModelEntry, backend: ServerClient) -> None:
    """Render chat templates locally only if the template renders as the server's does on the
    parity conversations (tokenizer/template.py); else every request asks /apply-template."""
    result = await probe_chat_template(backend)
    entry.template, entry.template_note = result.template, result.note
    if result.template is None or entry is next(iter(runtime.models.values())):
        runtime.metrics.template_fallback.set(0 if result.template is not None else 1)
    if result.template is not None:
        checked = result.parity.checked if result.parity else 0
        log.info("chat template: rendered locally (matches the server on %d conversations)", checked)
    else:
        log.warning("chat template: using the server's /apply-template: %s", result.reason)
        for line in result.parity.mismatches if result.parity else []:
            log.warning("chat template parity: %s", line)


async def probe_chat_template(backend: ServerClient) -> TemplateProbe:
    """The proxy's startup probe of the chat template (also run by `radixctl doctor`)."""
    props = await backend.get_json("/props")
    bos, eos = str(props.get("bos_token") or ""), str(props.get("eos_token") or "")
    # Whether the vocab adds BOS / EOS itself (the server then strips them from the rendering):
    # what the server's tokenizer adds to an empty text.
    added = await backend.tokenize("", add_special=True)
    bos_ids = await backend.tokenize(bos, add_special=False) if bos else []
    eos_ids = await backend.tokenize(eos, add_special=False) if eos else []
    add_bos = bool(added and bos_ids == added[:1])
    add_eos = bool(added and eos_ids == added[-1:] and (len(added) > 1 or not add_bos))

    async def remote(messages: list[dict[str, str]]) -> str:
        return await backend.apply_template({"messages": messages}, {})

    return await probe_template(str(props.get("chat_template") or ""), bos, eos, add_bos, add_eos, remote)
