"""What the workbench page accepts from a browser: requests for this host by a name it knows,
and bodies a web page elsewhere cannot send without asking first.

- ``Host``: a page whose DNS name was rebound to 127.0.0.1 reaches the workbench as a local
  client but still names its own host; only loopback names and ``--allowed-host`` pass.
- ``Content-Type``: a cross-site form or ``fetch`` may post ``text/plain`` without a CORS
  preflight, so JSON is only read as ``application/json`` and a replay manifest only as
  ``application/x-ndjson`` (types a page elsewhere must ask for, and is never granted).
- Replay targets: a manifest entry's path must be one of the proxy's completion paths; a path
  like ``@evil.example/x`` would have sent the request (and its key) to another host.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

JSON_TYPE = "application/json"
MANIFEST_TYPE = "application/x-ndjson"
REPLAY_PATHS = frozenset(
    {"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/completion"}
)


def refusal(status: int, message: str) -> web.Response:
    body = {"error": {"code": status, "message": message, "type": "invalid_request_error"}}
    return web.json_response(body, status=status)


def loopback_host(host: str) -> bool:
    """Whether a Host header (with or without its port) names this host by a loopback name."""
    name = host.rsplit("]", 1)[0].lstrip("[") if host.startswith("[") else host.rsplit(":", 1)[0]
    if name.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_guard(allowed: Iterable[str]) -> Middleware:
    names = {a.lower() for a in allowed}

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.host
        if (
            not loopback_host(host)
            and host.lower() not in names
            and host.lower().rsplit(":", 1)[0] not in names
        ):
            return refusal(403, f"the workbench is not served for Host {host!r} (add it with --allowed-host)")
        return await handler(request)

    return guard


def check_content_type(request: web.Request, expected: str) -> None:
    if request.content_type != expected:
        body = {
            "error": {
                "code": 415,
                "message": f"the body must be sent as {expected}, not {request.content_type or 'nothing'}",
                "type": "invalid_request_error",
            }
        }
        raise web.HTTPUnsupportedMediaType(text=json.dumps(body), content_type=JSON_TYPE)
