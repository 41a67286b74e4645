"""Read-only admin API under /radix/ (optional bearer key), read by `radixctl`, and the
metric refresh done when /metrics is scraped.

Routes (JSON; with ``--admin-key`` each needs ``Authorization: Bearer KEY``):

- ``GET /radix/routes?limit=N&since=T`` the last routing decisions (``since``: time.time()
  of the last one seen, inclusive; ``after``: exclusive), each with where the longest
  known prefix stopped matching, as text;
- ``GET /radix/tree?top=N`` host radix tree totals and the most-hit prefixes, with a preview;
- ``GET /radix/slots`` every server's slots (the proxy's view and the server's), resident
  entries and KV pool counts;
- ``GET /radix/stats`` the key figures since start, from the Prometheus metrics.

Nothing here changes state: the handlers read the coordinator between its mutations (one
event loop) and ask the servers read-only /kvctl questions.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import Any

import aiohttp
from aiohttp import web

from proxy.errors import BadRequest, Forbidden, RadixError, Unauthorized
from proxy.server.coordinator import Decision
from proxy.server.metrics import DEMOTE_FAILURES, DIRECTIONS, DROP_CAUSES, FALLBACK_CAUSES, ROUTES
from proxy.server.metrics.remote import REMOTE_FALLBACKS, WRITE_DROPS
from proxy.server.ops.observe import refresh_pool_gauges, server_json, set_resident
from proxy.server.ops.runtime import RUNTIME, Runtime

log = logging.getLogger("radix")

# Tokens of text shown on each side of a divergence, and at each end of a preview.
PREVIEW_TOKENS = 16

Handler = Callable[[web.Request, Runtime], Awaitable[dict[str, Any]]]


def add_admin_routes(app: web.Application) -> None:
    def guarded(fn: Handler) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            runtime = request.app[RUNTIME]
            # Answered here, not raised: an admin poll is not a failed completion request.
            refused = refuse_admin(request, runtime.config.admin_key)
            if refused is not None:
                return web.json_response(refused.to_body(), status=refused.status)
            try:
                return web.json_response(await fn(request, runtime))
            except RadixError as exc:  # also answered here: admin errors are not request errors
                return web.json_response(exc.to_body(), status=exc.status)

        return handler

    app.router.add_get("/radix/routes", guarded(_routes))
    app.router.add_get("/radix/tree", guarded(_tree))
    app.router.add_get("/radix/slots", guarded(_slots))
    app.router.add_get("/radix/stats", guarded(_stats))


def refuse_admin(request: web.Request, key: str | None) -> RadixError | None:
    """With --admin-key, the key; without, only clients on this host (loopback) that name it by a
    loopback name in ``Host``."""
    if key:
        sent = request.headers.get("Authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {key}".encode()):
            return Unauthorized("missing or wrong admin key (send Authorization: Bearer KEY)")
        return None
    try:
        local = ipaddress.ip_address(request.remote or "").is_loopback
    except ValueError:
        local = False
    if not local:
        return Forbidden(
            "the admin API answers only clients on this host; start the proxy with --admin-key "
            "to reach it from elsewhere"
        )
    if not loopback_host(request.host):
        # DNS rebinding: a page whose name now resolves to 127.0.0.1 is "local" by address, but
        # the browser still names the page's host.
        return Forbidden(
            "the admin API answers only requests for this host by a loopback name (Host: "
            "localhost or a loopback address); start the proxy with --admin-key to use another name"
        )
    return None


def loopback_host(host: str) -> bool:
    """Whether a Host header (with or without its port) names this host by a loopback name."""
    name = host.rsplit("]", 1)[0].lstrip("[") if host.startswith("[") else host.rsplit(":", 1)[0]
    if name.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _query_number(request: web.Request, name: str, default: float, lo: float, hi: float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise BadRequest(f"'{name}' must be a number, got {raw!r}") from exc
    if not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be between {lo:g} and {hi:g}, got {raw!r}")
    return value


# ---- text of token ids -------------------------------------------------------------------


async def detokenize(runtime: Runtime, ids: Sequence[int]) -> str:
    """Text of ``ids``: the local tokenizer when the proxy uses one, else the server's /detokenize;
    a run of media cells (tokens below 0, api/media.py) as ``<media: N cells>``."""
    ids = [int(t) for t in ids]
    out: list[str] = []
    start = 0
    while start < len(ids):
        media = ids[start] < 0
        end = start
        while end < len(ids) and (ids[end] < 0) == media:
            end += 1
        out.append(f"<media: {end - start} cells>" if media else await _text(runtime, ids[start:end]))
        start = end
    return "".join(out)


async def _text(runtime: Runtime, ids: list[int]) -> str:
    if not ids:
        return ""
    local = runtime.local_tokenizer
    if local is not None:
        return local.decode(ids)
    try:
        data = await runtime.on_any_server(lambda backend: backend.post_json("/detokenize", {"tokens": ids}))
    except (RadixError, aiohttp.ClientError) as exc:
        return f"<{len(ids)} tokens: /detokenize failed: {exc}>"
    return str(data.get("content", ""))


async def preview(runtime: Runtime, ids: Sequence[int], n: int = PREVIEW_TOKENS) -> dict[str, str] | None:
    """The first and last ``n`` tokens of a sequence as text (one piece when it is short);
    None unless the operator opted in to prompt text (--admin-show-text)."""
    if not runtime.config.admin_show_text:
        return None
    if len(ids) <= 2 * n:
        return {"head": await detokenize(runtime, ids), "tail": ""}
    return {"head": await detokenize(runtime, ids[:n]), "tail": await detokenize(runtime, ids[-n:])}


# ---- /radix/routes -----------------------------------------------------------------------


async def _routes(request: web.Request, runtime: Runtime) -> dict[str, Any]:
    limit = int(_query_number(request, "limit", 50, 1, 1000))
    since = _query_number(request, "since", 0, 0, float("inf"))
    after = _query_number(request, "after", -1, -1, float("inf"))
    items = runtime.coordinator.log.since(since, after)
    return {"decisions": [await describe_decision(runtime, d) for d in items[-limit:]]}


async def describe_decision(runtime: Runtime, decision: Decision) -> dict[str, Any]:
    """A decision for the API: its flat fields, and the divergence as text.

    ``diverge``: where the longest prefix any slot, resident owner or the host tree held
    stopped matching this prompt (``at``, a token position), the text just ``before`` it,
    how the ``request`` goes on and how the best cached sequence went on (``cached``; None
    when the host tree was longer or nothing was cached).
    """
    why = decision.why
    diverge: dict[str, Any] = {
        "at": why.at,
        "source": why.source,
        "complete": why.at >= decision.prompt_tokens,
    }
    if runtime.config.admin_show_text:
        cut = why.at - why.ctx_from
        diverge["before"] = await detokenize(runtime, why.request_ctx[:cut])
        diverge["request"] = await detokenize(runtime, why.request_ctx[cut:])
        diverge["cached"] = (
            await detokenize(runtime, why.cached_ctx[cut:]) if why.cached_ctx is not None else None
        )
    return {**decision.summary(), "diverge": diverge}


# ---- /radix/tree -------------------------------------------------------------------------


async def _tree(request: web.Request, runtime: Runtime) -> dict[str, Any]:
    tree = runtime.coordinator.tree
    top = int(_query_number(request, "top", 10, 0, 1000))
    stats = tree.stats()
    prefixes = []
    # Whole prefixes (head_tokens unbounded) so the preview can show where each one ends.
    for p in tree.top_prefixes(top, head_tokens=1 << 30):
        prefixes.append(
            {
                "length": p.length,
                "hits": p.hits,
                "bytes": p.bytes,
                "head": list(p.head[:PREVIEW_TOKENS]) if runtime.config.admin_show_text else None,
                "preview": await preview(runtime, p.head),
            }
        )
    dedup = stats.logical_tokens / stats.unique_tokens if stats.unique_tokens else 0.0
    return {"stats": asdict(stats), "dedup_ratio": dedup, "top": prefixes, "tiers": tiers(runtime)}


def tiers(runtime: Runtime) -> dict[str, Any]:
    """Each tier of the host cache: RAM (the tree), with --cache-disk the disk, with
    --cache-remote the shared store (``remote``, absent without it)."""
    t, disk, m = runtime.coordinator.tree.stats(), runtime.coordinator.disk, runtime.metrics
    out: dict[str, Any] = {
        "ram": {
            "entries": t.nodes,
            "tokens": t.unique_tokens,
            "bytes": t.bytes,
            "budget_bytes": t.budget_bytes,
        },
        "disk": None,
    }
    if disk is not None:
        d = disk.index.stats()
        out["disk"] = {
            "dir": str(disk.directory),
            "usable": disk.usable,
            **asdict(d),
            "promotions": int(m.value("radix_disk_promotions_total")),
            "promoted_tokens": int(m.value("radix_disk_promoted_tokens_total")),
            "demotions": int(m.value("radix_disk_demotions_total")),
            "evictions": int(m.value("radix_disk_evictions_total")),
            "demotion_failures": {
                c: int(n)
                for c in DEMOTE_FAILURES
                if (n := m.value("radix_disk_demotion_failures_total", cause=c))
            },
            "dropped": {
                c: int(n) for c in DROP_CAUSES if (n := m.value("radix_disk_dropped_total", cause=c))
            },
        }
    remote = runtime.coordinator.remote
    if remote is not None:
        out["remote"] = {
            "where": remote.where,
            "up": not remote.down,
            "lookups": int(m.value("radix_remote_lookups_total")),
            "promotions": int(m.value("radix_remote_promotions_total")),
            "promoted_tokens": int(m.value("radix_remote_promoted_tokens_total")),
            "writes": int(m.value("radix_remote_writes_total")),
            "fallbacks": {
                c: int(n) for c in REMOTE_FALLBACKS if (n := m.value("radix_remote_fallbacks_total", cause=c))
            },
            "write_dropped": {
                c: int(n) for c in WRITE_DROPS if (n := m.value("radix_remote_write_dropped_total", cause=c))
            },
        }
    return out


# ---- /radix/slots ------------------------------------------------------------------------


async def _slots(request: web.Request, runtime: Runtime) -> dict[str, Any]:
    now = time.monotonic()
    out = []
    for server in runtime.coordinator.servers:
        info, err1 = await server_json(server, "/kvctl/slots", server.backend.slots(tokens=True))
        cells, err2 = await server_json(server, "/kvctl/cells", server.backend.cells())
        theirs = {e.id: e for e in info.slots} if info is not None else {}
        slots = []
        for s in server.slots:
            entry = theirs.get(s.slot_id)
            slots.append(
                {
                    "id": s.slot_id,
                    "busy": s.busy,
                    "n_tokens": int(len(s.tokens)),
                    "server_n_tokens": entry.n_tokens if entry else None,
                    "n_cells": entry.n_cells if entry else None,
                    "idle_s": round(now - s.last_used, 3) if s.last_used else None,
                    "preview": await preview(runtime, s.tokens.tolist()),
                }
            )
        pool = cells.as_json() if cells is not None else None
        runtime.metrics.set_pool(server.name, pool)
        set_resident(runtime, server, cells)
        index = server.sharing.index.entries if server.sharing is not None else {}
        residents = []
        for o in info.owners if info is not None else ():
            indexed = index.get(o.id)
            residents.append(
                {
                    "owner": o.id,
                    "n_tokens": o.n_tokens,
                    "n_cells": o.n_cells,
                    "indexed": indexed is not None,
                    "hits": indexed.hits if indexed else None,
                    "pins": indexed.pins if indexed else None,
                    "sharers": dict(indexed.sharers) if indexed else None,
                    "preview": await preview(runtime, o.held_tokens().tolist()),
                }
            )
        out.append(
            {
                "server": server.name,
                "url": server.backend.url,
                "n_ctx_slot": server.n_ctx_slot,
                "kv": {
                    **server.kv.as_json(),
                    "kv_unknown": server.kv.unknown,
                    "moves": server.moves,
                    "export_mb_s": round(server.rates.export_bytes_per_s / 1e6, 1),
                    "import_mb_s": round(server.rates.import_bytes_per_s / 1e6, 1),
                    "moves_measured": server.rates.moves_seen,
                },
                "slots": slots,
                "residents": residents,
                "pool": pool,
                "errors": [e for e in (err1, err2) if e],
            }
        )
    return {"servers": out}


async def _stats(request: web.Request, runtime: Runtime) -> dict[str, Any]:
    return await stats(runtime)


async def stats(runtime: Runtime) -> dict[str, Any]:
    """One screen of key figures since the proxy started (from the Prometheus metrics)."""
    m = runtime.metrics
    tree_stats = runtime.coordinator.tree.stats()
    m.sync_tree(tree_stats)
    pool = await refresh_pool_gauges(runtime)
    by_route = m.total("radix_requests_total", "route", ROUTES)
    ttft_sum = m.total("radix_ttft_seconds_sum", "route", ROUTES)
    ttft_n = m.total("radix_ttft_seconds_count", "route", ROUTES)
    prompt = m.value("radix_prompt_tokens_total")
    cached = m.value("radix_cached_tokens_total")
    return {
        "uptime_s": round(time.time() - m.started, 1),
        "requests": int(sum(by_route.values())),
        "by_route": {r: int(n) for r, n in by_route.items() if n},
        "errors": {s: int(m.value("radix_request_errors_total", status=s)) for s in ("4xx", "5xx")},
        "prompt_tokens": int(prompt),
        "cached_tokens": int(cached),
        "prefilled_tokens": int(m.value("radix_prefilled_tokens_total")),
        "predicted_cached_tokens": int(m.value("radix_predicted_cached_tokens_total")),
        "hit_ratio": cached / prompt if prompt else 0.0,
        "cached_by_route": {
            r: int(n) for r, n in m.total("radix_route_tokens_total", "route", ROUTES).items() if n
        },
        "ttft_mean_s_by_route": {r: ttft_sum[r] / n for r, n in ttft_n.items() if n},
        "kv_moves": {
            d: {
                "bytes": int(m.value("radix_kv_move_bytes_total", direction=d)),
                "seconds": round(m.value("radix_kv_move_seconds_total", direction=d), 4),
            }
            for d in DIRECTIONS
        },
        "fallbacks": {c: int(m.value("radix_fallbacks_total", cause=c)) for c in FALLBACK_CAUSES},
        "tree": asdict(tree_stats),
        "dedup_ratio": tree_stats.logical_tokens / tree_stats.unique_tokens
        if tree_stats.unique_tokens
        else 0.0,
        "pool": pool,
        "resident": {
            s.name: asdict(s.sharing.index.stats()) if s.sharing is not None else None
            for s in runtime.coordinator.servers
        },
        "tiers": tiers(runtime),
        "tokenizer": runtime.tokenizer_note,
        "chat_template": runtime.template_note,
    }
