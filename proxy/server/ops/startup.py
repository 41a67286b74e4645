"""Startup: connect to the servers, check them, build the coordinator, pick the tokenizer."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client import CollectorRegistry

from proxy.config import BackendSpec, Config, parse_backend
from proxy.core.infill import InfillParams
from proxy.core.payload import KvLayout
from proxy.core.radix import RadixTree
from proxy.core.resident import ResidentIndex
from proxy.errors import ConfigError, FallbackCause, KvMoveError, PayloadError, RadixError
from proxy.server.coordinator import Coordinator, KvPlace, ServerState, SlotState
from proxy.server.dataplane.arena import Arena, is_shared_memory
from proxy.server.dataplane.backend import ServerClient
from proxy.server.dataplane.kvctl import Caps, KvctlReplyError, SeqInfo
from proxy.server.dataplane.layoutcheck import LayoutCheckDeferred, LayoutChecks
from proxy.server.dataplane.mover import KvMover
from proxy.server.dataplane.netlocal import is_local_host
from proxy.server.dataplane.paydir import check_private_dir, private_dir_fd
from proxy.server.dataplane.sharing import Sharing
from proxy.server.http.recorder import Recorder
from proxy.server.metrics import Metrics
from proxy.server.ops.models import ModelEntry, compat_ns
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


def _payload_path(mover: KvMover, shm: Path | None) -> str:
    if shm is None:
        return "inline"
    if mover.arena is not None and mover.layout is not None:
        return f"through the arena in {shm} (blocks of {mover.chunk_tokens} tokens)"
    return f"via files in {shm}"


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
    for server in servers:
        entry = models.get(server.model)
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


async def _listing(backend: ServerClient) -> dict[str, Any]:
    """The server's own /v1/models entry (listed under the operator's name)."""
    reply = await backend.get_json("/v1/models")
    data = reply.get("data") or [{}]
    return dict(data[0]) if isinstance(data[0], dict) else {}


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
        if entry is None and coordinator.disk is not None:
            # The disk tier holds one model's KV layout (the one checked at startup).
            log.error(
                "%s (%s) serves another model %r; kept out: --cache-disk serves one", name, url, server.model
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


class _Unreachable(ConfigError):
    """The server does not answer (yet): not a configuration error."""


async def _n_vocab(backend: ServerClient) -> int:
    """The vocabulary size (token ids in prompts are checked against it)."""
    models = await backend.get_json("/v1/models")
    for entry in models.get("data") or []:
        n = (entry.get("meta") or {}).get("n_vocab")
        if isinstance(n, int) and n > 0:
            return n
    raise ConfigError(
        "llama-server's /v1/models does not report n_vocab", fix="run the pinned llama-server build"
    )


async def _connect(
    config: Config,
    name: str,
    spec_text: str,
    session: aiohttp.ClientSession,
    metrics: Metrics,
    checks: LayoutChecks,
    arena: Arena | None,
) -> ServerState:
    spec = parse_backend(spec_text)
    url = spec.url
    backend = ServerClient(
        url,
        session,
        config.kvctl_key,
        read_timeout_s=config.backend_read_timeout_s,
        api_key=config.server_api_key,
    )
    try:
        caps = await backend.caps()
    except aiohttp.ClientError as exc:
        raise _Unreachable(
            f"cannot reach llama-server at {url}: {exc}", fix="start it, or fix --backend-url"
        ) from exc
    except RadixError as exc:
        if (
            isinstance(exc, KvMoveError)
            and not isinstance(exc, KvctlReplyError)
            and exc.cause in (FallbackCause.TRANSPORT, FallbackCause.TIMEOUT)
        ):
            raise _Unreachable(
                f"cannot reach llama-server at {url}: {exc.message}", fix="start it, or fix --backend-url"
            ) from exc
        raise ConfigError(
            f"{url} has no usable /kvctl API ({exc.message})",
            fix="run the patched llama-server (`radixctl build`) with --kvctl -kvu --cache-ram 0 "
            "-sps 0, and pass --kvctl-key if it has one",
        ) from exc
    compat = dict(caps.compat)
    layout, moves_off = _layout_or_why_not(caps)
    shm = await _payload_dir(config.shm_dir, caps.dir, spec, caps.dir_id)
    if arena is not None and shm is not None and not caps.export_chunks:
        log.warning("%s: no chunked exports (a patch before 0020): KV moves through payload files", name)
        arena = None
    mover = KvMover(
        backend,
        layout,
        compat,
        shm,
        metrics,
        arena=arena,
        chunk_tokens=config.kv_arena_chunk,
        n_ctx_slot=caps.n_ctx_slot,
    )
    instance = caps.instance or ""
    if caps.sharing:
        # Owners left by an earlier proxy hold cells nobody accounts for (and the check's cells).
        await _release_owners(backend, caps)
    if not moves_off:
        # Before the slots are read (it fills and erases one); its moves are not counted.
        check_mover = KvMover(
            backend,
            layout,
            compat,
            shm,
            Metrics(CollectorRegistry(), (name,)),
            arena=arena,
            chunk_tokens=config.kv_arena_chunk,
            n_ctx_slot=caps.n_ctx_slot,
        )
        try:
            moves_off = await checks.verdict(instance, backend, check_mover)
        except LayoutCheckDeferred as exc:
            # No verdict yet (every slot busy, the server restarting): not routed to until it has one.
            raise _Unreachable(
                f"{url}: the KV layout check waits: {exc.message}", fix="it is retried on each health check"
            ) from exc
        finally:
            check_mover.close()
    if moves_off:
        mover.layout = None
    slots_info = await backend.slots(tokens=True)
    model_ns = compat_ns(compat)
    isolating = bool(config.cache_isolation)
    slots = [_slot_found(s, isolating, model_ns, moves=not moves_off) for s in slots_info.slots]
    n_ctx_slot = caps.n_ctx_slot
    metrics.server_moves.labels(name).set(0 if moves_off else 1)
    checkpoints = bool(moves_off) and caps.checkpoints and bool(caps.compat_id)
    metrics.server_checkpoints.labels(name).set(1 if checkpoints else 0)
    sharing = await _sharing(config, name, backend, caps) if config.kv_share and not moves_off else None
    model = spec.model or await _server_model_name(backend)
    log.info(
        "%s: %s, model %r, %d slots, %d cells, KV on %s (%s), payloads %s%s",
        name,
        url,
        model,
        len(slots),
        caps.n_cells,
        ",".join(caps.kv_devices) or "an unknown device",
        ",".join(caps.kv_backends) or "unknown backend",
        _payload_path(mover, shm),
        ", resident sharing on" if sharing else "",
    )
    if moves_off and checkpoints:
        log.warning(
            "%s: KV moves are off for model %r (%s): %s; served with routes A, prefill, and H from "
            "whole-state checkpoints taken where the server takes its own (no A+H, sharing or disk tier)",
            name,
            model,
            caps.memory_kind,
            "; ".join(moves_off),
        )
    elif moves_off:
        log.warning(
            "%s: KV moves are off for model %r (%s): %s; served with routes A and prefill only "
            "(the server's own prefix reuse; no host restore, save or sharing)%s",
            name,
            model,
            caps.memory_kind,
            "; ".join(moves_off),
            _checkpoints_off(caps),
        )
    state = ServerState(name, backend, mover, slots, n_ctx_slot, sharing, rates=mover.rates)
    state.kv = KvPlace.from_caps(caps)
    metrics.set_kv_place(name, state.kv.pairs)
    metrics.set_move_rates(name, state.rates.export_bytes_per_s, state.rates.import_bytes_per_s)
    state.model, state.model_ns, state.named = model, model_ns, bool(spec.model)
    state.n_cells = caps.n_cells
    state.moves_off = moves_off
    state.checkpoints = checkpoints
    state.compat_id = caps.compat_id
    state.infill = InfillParams.from_caps({"infill": caps.infill}, n_ctx_slot)
    state.embeddings = caps.embedding is not None and caps.embedding.on
    state.pooling = caps.embedding.pooling if caps.embedding is not None else -1
    state.instance = instance or None
    return state


def _checkpoints_off(caps: Caps) -> str:
    """Why a recurrent or hybrid model gets no whole-state checkpoints, for the log line."""
    if caps.memory_kind not in ("recurrent", "hybrid"):
        return ""
    return "; whole-state checkpoints are off: " + "; ".join(caps.checkpoints_off)


def _layout_or_why_not(caps: Caps) -> tuple[KvLayout | None, tuple[str, ...]]:
    """The payload layout, or why KV moves are off: the server says so (`moves`, `moves_off`:
    a sliding window, a recurrent state, a layout its probe does not know), its caps cannot say
    where its KV lives (`memory.buffers`), or they do not describe a layout the proxy can read.
    Never guessed from the architecture's name."""
    if not caps.moves:
        return None, caps.moves_off or ("the server turned KV moves off",)
    unknown = caps.kv_where_unknown()
    if unknown is not None:  # a move's cost and exactness depend on where the KV lives
        return None, (unknown,)
    try:
        return KvLayout.from_caps(dict(caps.compat)), ()
    except (PayloadError, KeyError, TypeError, ValueError) as exc:
        message = exc.message if isinstance(exc, PayloadError) else str(exc)
        return None, (f"the server's KV layout cannot be read: {message}",)


async def _server_model_name(backend: ServerClient) -> str:
    """The name the server reports (its --alias, else its model file's)."""
    entry = await _listing(backend)
    return str(entry.get("id") or "default")


def _slot_found(entry: SeqInfo, isolating: bool, model_ns: str, moves: bool = True) -> SlotState:
    """A slot as the proxy finds it at startup. Its KV is reused as the shared namespace's only
    without isolation keys: with them, whose KV it is cannot be known, so it is erased first.
    With moves off its KV may start past position 0 (a sliding window forgot it): only the
    server reuses it, so it still steers requests to the slot."""
    tokens = entry.held_tokens()
    consistent = entry.pos_max + 1 == len(tokens)
    consistent = consistent and (entry.pos_min <= 0 or not moves)
    if not len(tokens):
        return SlotState(entry.id, ns=model_ns)
    if consistent and not isolating:
        return SlotState(entry.id, tokens, ns=model_ns)
    return SlotState(entry.id, np.zeros(0, np.int32), ns=None)


async def _sharing(config: Config, name: str, backend: ServerClient, caps: Caps) -> Sharing:
    if not caps.sharing:
        reasons = "; ".join(caps.reasons or ["the server does not offer owner sequences"])
        raise ConfigError(
            f"{name} cannot share resident KV: {reasons}",
            fix="start llama-server with --kvctl-owners N (N > 0), or use --cache-kv-share off",
        )
    n_cells = caps.n_cells
    props = await backend.get_json("/props")
    n_ubatch = int(
        props.get("n_ubatch") or (props.get("default_generation_settings") or {}).get("n_ubatch") or 512
    )
    first, end = caps.owner_ids
    index = ResidentIndex(range(first, end), config.kv_share_max_entries)
    budget = config.kv_share_cells or n_cells // 2
    headroom = config.kv_share_headroom or min(n_ubatch, max(1, n_cells // 8))
    log.info(
        "%s: resident sharing: %d entries, budget %d cells, headroom %d cells",
        name,
        index.max_entries,
        budget,
        headroom,
    )
    return Sharing(
        backend, index, budget_cells=budget, headroom=headroom, min_tokens=config.kv_share_min_tokens
    )


async def _release_owners(backend: ServerClient, caps: Caps) -> None:
    first, end = caps.owner_ids
    for owner in range(first, end):
        await backend.release(owner)


async def _payload_dir(
    mine: Path | None, theirs: str | None, spec: BackendSpec, their_id: object = None
) -> Path | None:
    """The directory payload files go through, or None (inline: KV in the HTTP bodies).
    ``inline``: never files; ``shared``: files, and the server must name our directory;
    ``auto``: files when the server names our directory and runs on this host. Our directory
    is the one our mover holds open; a server that reports the device and inode of the one it
    holds (``dir_id``) must hold the same."""
    if spec.payloads == "inline":
        return None
    if mine is not None:
        check_private_dir(mine)  # before any payload file is made in it
    same_dir = bool(mine and theirs and Path(theirs).resolve() == mine.resolve())
    if same_dir and mine is not None and isinstance(their_id, str) and their_id:
        st = os.fstat(private_dir_fd(mine))
        if their_id != f"{st.st_dev}:{st.st_ino}":
            log.warning(
                "%s holds another directory than %s under its name (device:inode %s, ours %d:%d)",
                spec.url,
                mine,
                their_id,
                st.st_dev,
                st.st_ino,
            )
            same_dir = False
    if spec.payloads == "shared":
        if not same_dir or mine is None or not os.access(mine, os.W_OK):
            raise ConfigError(
                f"{spec.url} was declared #shared but its payload dir ({theirs}) is not the "
                f"proxy's writable --shm-dir ({mine})",
                fix="give both the same directory, or use #inline / #auto",
            )
        return mine
    if not mine or not theirs:
        return None
    if not same_dir:
        log.warning("server payload dir %s differs from --shm-dir %s: using inline payloads", theirs, mine)
        return None
    if not await is_local_host(spec.url):
        log.warning("%s is not on this host: inline payloads (declare #shared if it is)", spec.url)
        return None
    return mine if os.access(mine, os.W_OK) else None


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
