"""Connecting one server: its caps, KV layout and the layout's check, payload directory,
mover, slots and resident sharing (``startup`` connects them all and builds the runtime)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client import CollectorRegistry

from proxy.config import BackendSpec, Config, parse_backend
from proxy.core.infill import InfillParams
from proxy.core.payload import KvLayout
from proxy.core.resident import ResidentIndex
from proxy.errors import ConfigError, FallbackCause, KvMoveError, PayloadError, RadixError
from proxy.server.coordinator import KvPlace, ServerState, SlotState
from proxy.server.dataplane.arena import Arena
from proxy.server.dataplane.backend import ServerClient
from proxy.server.dataplane.kvctl import Caps, KvctlReplyError, SeqInfo
from proxy.server.dataplane.layoutcheck import LayoutCheckDeferred, LayoutChecks
from proxy.server.dataplane.mover import KvMover
from proxy.server.dataplane.netlocal import is_local_host
from proxy.server.dataplane.paydir import check_private_dir, private_dir_fd
from proxy.server.dataplane.sharing import Sharing
from proxy.server.metrics import Metrics
from proxy.server.ops.health import log_media
from proxy.server.ops.models import compat_ns

log = logging.getLogger("radix")


def _payload_path(mover: KvMover, shm: Path | None) -> str:
    if shm is None:
        return "inline"
    if mover.arena is not None and mover.layout is not None:
        return f"through the arena in {shm} (blocks of {mover.chunk_tokens} tokens)"
    return f"via files in {shm}"


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
        "%s: %s, model %r, %d slots, %d cells, KV on %s (%s), payloads %s%s%s",
        name,
        url,
        model,
        len(slots),
        caps.n_cells,
        ",".join(caps.kv_devices) or "an unknown device",
        ",".join(caps.kv_backends) or "unknown backend",
        _payload_path(mover, shm),
        " (pinned for the device)" if caps.pinned_payloads else "",
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
    if caps.multimodal:
        log_media(name, caps)
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
    state.take_media_caps(caps)
    state.instance = instance or None
    return state


def _checkpoints_off(caps: Caps) -> str:
    """Why a recurrent, hybrid or window-sized SWA model gets no whole-state checkpoints, for the log line."""
    if caps.memory_kind not in ("recurrent", "hybrid", "kv_swa"):
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


async def _listing(backend: ServerClient) -> dict[str, Any]:
    """The server's own /v1/models entry (listed under the operator's name)."""
    reply = await backend.get_json("/v1/models")
    data = reply.get("data") or [{}]
    return dict(data[0]) if isinstance(data[0], dict) else {}
