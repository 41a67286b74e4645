"""A tiny round-robin HTTP balancer: the stock baseline for ``radixctl bench --servers N``.

Each request goes to the next server in turn, whatever it asks; the answer (streamed or
not) is passed back unchanged. It is what an operator gets from nginx's default upstream
policy in front of N stock llama-servers. Run: ``python -m proxy.bench.balancer --port P URL...``.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)
HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}


def make_app(urls: list[str]) -> web.Application:
    turn = itertools.cycle(urls)
    app = web.Application(client_max_size=64 << 20)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), auto_decompress=False
        )
        yield
        await app[SESSION].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        url = next(turn) + request.path_qs
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        body = await request.read()
        async with app[SESSION].request(request.method, url, data=body, headers=headers) as up:
            out = web.StreamResponse(
                status=up.status, headers={k: v for k, v in up.headers.items() if k.lower() not in HOP}
            )
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("urls", nargs="+")
    args = parser.parse_args()
    web.run_app(make_app([u.rstrip("/") for u in args.urls]), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
