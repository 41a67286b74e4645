"""Read-only admin API under /radix/ (optional bearer key), read by `radixctl`."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy.errors import Unauthorized

if TYPE_CHECKING:
    from proxy.runtime import Runtime


def add_admin_routes(app: web.Application, runtime: Runtime) -> None:
    def guarded(fn: Any) -> Any:
        async def handler(request: web.Request) -> web.Response:
            key = runtime.config.admin_key
            if key and request.headers.get("Authorization") != f"Bearer {key}":
                raise Unauthorized("missing or wrong admin key")
            return web.json_response(await fn(request, runtime))

        return handler

    app.router.add_get("/radix/routes", guarded(_routes))
    app.router.add_get("/radix/tree", guarded(_tree))
    app.router.add_get("/radix/slots", guarded(_slots))
    app.router.add_get("/radix/stats", guarded(_stats))


async def _routes(request: web.Request, runtime: Runtime) -> dict[str, Any]:
    limit = int(request.query.get("limit", "50"))
    after = float(request.query.get("after", "0"))
    items = [d for d in runtime.coordinator.decisions if d["time"] > after]
    return {"decisions": items[-limit:]}


async def _tree(request: web.Request, runtime: Runtime) -> dict[str, Any]:
    tree = runtime.coordinator.tree
    top = int(request.query.get("top", "10"))
    return {"stats": asdict(tree.stats()), "top": [asdict(p) for p in tree.top_prefixes(top)]}


async def _slots(request: web.Request, runtime: Runtime) -> dict[str, Any]:
    out = []
    for server in runtime.coordinator.servers:
        out.append({"server": server.name, "url": server.backend.url,
                    "slots": [{"id": s.slot_id, "busy": s.busy, "n_tokens": int(len(s.tokens)),
                               "last_used": s.last_used} for s in server.slots]})
    return {"servers": out}


async def _stats(request: web.Request, runtime: Runtime) -> dict[str, Any]:
    coord = runtime.coordinator
    decisions = list(coord.decisions)
    by_route: dict[str, int] = {}
    for d in decisions:
        by_route[d["route"]] = by_route.get(d["route"], 0) + 1
    prompt = sum(d["prompt_tokens"] for d in decisions)
    cached = sum(d["cached"] or 0 for d in decisions)
    return {"requests": len(decisions), "by_route": by_route, "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_ratio": cached / prompt if prompt else 0.0, "tree": asdict(coord.tree.stats()),
            "tokenizer": runtime.tokenizer_note}
