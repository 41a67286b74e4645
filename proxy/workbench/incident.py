"""The simulated incident service: its own HTTP process that the ``edge_incident`` assistant reads.

Each service is ``healthy``, ``degraded`` or ``down`` (``checkout-api`` starts degraded).
Status and logs follow the state deterministically. Proposals are recorded as
``pending_review``; a person may approve or reject them, and nothing is ever executed: there
is no endpoint that restarts, rolls back or changes a service other than the simulation's
own state switch (``POST /services/NAME/state``, for demonstrations and tests).

Run it alone: ``python -m proxy.workbench.incident --port 8091``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time
from typing import Any

from aiohttp import web

from proxy.traffic import data

STATES = ("healthy", "degraded", "down")
LEVELS = {"error": 0, "warn": 1, "info": 2}
SEED = 0


class Incident:
    """The simulation's state: one synchronous method per change."""

    def __init__(self) -> None:
        self.state = {s: "healthy" for s in data.SERVICES}
        self.state["checkout-api"] = "degraded"
        self.proposals: dict[str, dict[str, Any]] = {}
        self._ids = itertools.count(301)

    def status(self, service: str) -> dict[str, Any]:
        base = data.service_status(service, SEED)
        state = self.state[service]
        out = {**base, "health": state}
        if state == "healthy":
            out.update(p99_ms=round(base["p99_ms"] / 8), error_rate_pct=0.2, replicas_ready=base["replicas"])
        elif state == "degraded":
            out.update(replicas_ready=max(1, base["replicas"] - 1))
        else:
            out.update(p99_ms=None, error_rate_pct=100.0, replicas_ready=0)
        return out

    def logs(self, service: str, level: str, limit: int) -> list[str]:
        status = self.status(service)
        upstream = data.SERVICES[(data.SERVICES.index(service) + 1) % len(data.SERVICES)]
        state = self.state[service]
        lines = [
            f"2024-05-10T09:5{k}:00Z INFO {service} GET /health 200 v{status['version']}" for k in range(4)
        ]
        if state == "degraded":
            lines += [
                f"2024-05-10T10:00:00Z WARN {service} deployed v{status['version']} (was v{status['previous_version']})"
            ]
            lines += data.error_logs(service, upstream, status["version"], 10, SEED)
        elif state == "down":
            lines += [
                f"2024-05-10T10:0{k}:00Z ERROR {service} 0/{status['replicas']} replicas ready: connection refused"
                for k in range(6)
            ]
        keep = [line for line in lines if LEVELS[line.split()[1].lower()] <= LEVELS[level]]
        return keep[-limit:]

    def set_state(self, service: str, state: str) -> None:
        self.state[service] = state

    def propose(self, action: str, target: str, reason: str) -> dict[str, Any]:
        pid = f"P-{next(self._ids)}"
        self.proposals[pid] = {
            "proposal_id": pid,
            "action": action,
            "target": target,
            "reason": reason,
            "status": "pending_review",
            "executed": False,
            "created": time.time(),
            "note": "Recorded for a person's review; this service never executes anything.",
        }
        return self.proposals[pid]

    def review(self, pid: str, decision: str, by: str) -> dict[str, Any]:
        proposal = self.proposals[pid]
        proposal.update(status=decision, reviewed_by=by, executed=False)
        return proposal


INCIDENT = web.AppKey("incident", Incident)


def _error(status: int, message: str) -> web.Response:
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return web.json_response({"error": {"code": status, "message": message, "type": kind}}, status=status)


def _service(request: web.Request) -> str | None:
    name = request.match_info["name"]
    return name if name in data.SERVICES else None


async def health(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def services(request: web.Request) -> web.Response:
    inc = request.app[INCIDENT]
    return web.json_response([{"service": s, "health": inc.state[s]} for s in data.SERVICES])


async def status(request: web.Request) -> web.Response:
    name = _service(request)
    if name is None:
        return _error(404, f"unknown service; known: {', '.join(data.SERVICES)}")
    return web.json_response(request.app[INCIDENT].status(name))


async def logs(request: web.Request) -> web.Response:
    name = _service(request)
    if name is None:
        return _error(404, f"unknown service; known: {', '.join(data.SERVICES)}")
    level = request.query.get("level", "info")
    if level not in LEVELS:
        return _error(400, "level must be error, warn or info")
    try:
        limit = max(1, min(200, int(request.query.get("limit", "20"))))
    except ValueError:
        return _error(400, "limit must be a whole number")
    return web.json_response({"service": name, "lines": request.app[INCIDENT].logs(name, level, limit)})


async def _json(request: web.Request) -> dict[str, Any] | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


async def set_state(request: web.Request) -> web.Response:
    name, body = _service(request), await _json(request)
    if name is None:
        return _error(404, "unknown service")
    if body is None or body.get("state") not in STATES:
        return _error(400, f'body must be {{"state": one of {", ".join(STATES)}}}')
    request.app[INCIDENT].set_state(name, body["state"])
    return web.json_response(request.app[INCIDENT].status(name))


async def propose(request: web.Request) -> web.Response:
    body = await _json(request)
    if body is None or body.get("target") not in data.SERVICES or not isinstance(body.get("action"), str):
        return _error(400, 'body must be {"action": ..., "target": a known service, "reason": ...}')
    proposal = request.app[INCIDENT].propose(
        body["action"][:40], body["target"], str(body.get("reason", ""))[:500]
    )
    return web.json_response(proposal, status=201)


async def proposals(request: web.Request) -> web.Response:
    return web.json_response(list(request.app[INCIDENT].proposals.values()))


async def review(request: web.Request) -> web.Response:
    inc, pid = request.app[INCIDENT], request.match_info["pid"]
    if pid not in inc.proposals:
        return _error(404, f"no proposal {pid}")
    body = await _json(request) or {}
    decision = "approved" if request.match_info["decision"] == "approve" else "rejected"
    return web.json_response(inc.review(pid, decision, str(body.get("by", "operator"))[:80]))


def build_incident_app() -> web.Application:
    app = web.Application()
    app[INCIDENT] = Incident()
    app.router.add_get("/health", health)
    app.router.add_get("/services", services)
    app.router.add_get("/services/{name}/status", status)
    app.router.add_get("/services/{name}/logs", logs)
    app.router.add_post("/services/{name}/state", set_state)
    app.router.add_get("/proposals", proposals)
    app.router.add_post("/proposals", propose)
    app.router.add_post("/proposals/{pid}/{decision:approve|reject}", review)
    return app


async def _exit_with(parent: int) -> None:
    """Started by the workbench: go when it goes, even if it was killed before it could stop us."""
    while os.getppid() == parent:
        await asyncio.sleep(1)
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The workbench's simulated incident service.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument(
        "--parent-pid", type=int, default=0, help="exit when this process is no longer the parent"
    )
    args = parser.parse_args(argv)
    app = build_incident_app()
    if args.parent_pid:
        tasks: list[asyncio.Task[None]] = []

        async def watch(_app: web.Application) -> None:
            tasks.append(asyncio.create_task(_exit_with(args.parent_pid)))

        app.on_startup.append(watch)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
