"""The agent APIs, steered like chat: Anthropic Messages and OpenAI Responses.

- ``POST /v1/messages``: converted to the chat body the server would make of it
  (``proxy/server/api/anthropic.py``), rendered, tokenized, leased and restored like chat, sent to
  the server's chat endpoint pinned to the leased slot, and answered in Anthropic's shape
  (body, event stream, errors).
- ``POST /v1/messages/count_tokens``: the server's own count (its conversion, its template,
  its tokenizer), touching no slot; errors in Anthropic's shape.
- ``POST /v1/responses``, ``/responses``: the client's body goes to the server's own endpoint
  pinned to the leased slot; its prompt tokens come from the server's conversion mirrored
  (``proxy/server/api/responses.py``).

docs/apis.md lists every endpoint and what the proxy does with it.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from proxy.errors import RadixError, TooLarge
from proxy.server.api import anthropic, responses
from proxy.server.api.media import chat_tokens
from proxy.server.api.routes import _read_json, _steered
from proxy.server.api.shapes import AnthropicShape, ResponsesShape
from proxy.server.dataplane.backend import ServerClient
from proxy.server.http.forward import forward_headers
from proxy.server.ops.models import pick_model
from proxy.server.ops.runtime import RUNTIME

COUNT_TOKENS = "/v1/messages/count_tokens"


def add_api_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post(COUNT_TOKENS, count_tokens)
    for path in ("/v1/responses", "/responses"):
        app.router.add_post(path, create_response)


def _anthropic_error(request: web.Request, exc: RadixError) -> web.Response:
    request.app[RUNTIME].metrics.request_errors.labels("4xx" if exc.status < 500 else "5xx").inc()
    headers = {"Retry-After": f"{exc.retry_after_s:.0f}"} if exc.retry_after_s is not None else None
    return web.Response(
        body=orjson.dumps(anthropic.error_of(exc)),
        status=exc.status,
        content_type="application/json",
        headers=headers,
    )


async def messages(request: web.Request) -> web.StreamResponse:
    try:
        return await _messages(request)
    except RadixError as exc:
        return _anthropic_error(request, exc)
    except web.HTTPRequestEntityTooLarge as exc:
        return _anthropic_error(request, TooLarge(f"request body too large: {exc.text}"))


async def _messages(request: web.Request) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    original = await _read_json(request)
    model = pick_model(runtime.models, original)
    chat = anthropic.to_chat(original)
    tokens, media = await chat_tokens(runtime, chat, forward_headers(request), model)
    shape = AnthropicShape(runtime.config.cache_info, len(tokens))
    body = anthropic.forward_body(chat, original)
    return await _steered(
        request, body, tokens, model, path=anthropic.CHAT_PATH, shape=shape, api="messages", media=media
    )


async def count_tokens(request: web.Request) -> web.Response:
    """The server counts (exact by construction); no slot is touched."""
    try:
        runtime = request.app[RUNTIME]
        body = await _read_json(request)
        model = pick_model(runtime.models, body)
        data, headers = orjson.dumps(body), {**forward_headers(request), "Content-Type": "application/json"}

        async def call(backend: ServerClient) -> web.Response:
            async with backend.request("POST", COUNT_TOKENS, data=data, headers=headers) as up:
                raw = await up.read()
                if up.status >= 400:
                    raw = anthropic.convert_error(raw, up.status)
                return web.Response(body=raw, status=up.status, content_type="application/json")

        return await runtime.on_any_server(call, model.name)
    except RadixError as exc:
        return _anthropic_error(request, exc)
    except web.HTTPRequestEntityTooLarge as exc:
        return _anthropic_error(request, TooLarge(f"request body too large: {exc.text}"))


async def create_response(request: web.Request) -> web.StreamResponse:
    """Errors stay in the OpenAI shape the proxy's error renderer writes."""
    runtime = request.app[RUNTIME]
    body = await _read_json(request)
    model = pick_model(runtime.models, body)
    chat = responses.to_chat(body)
    tokens, media = await chat_tokens(runtime, chat, forward_headers(request), model)
    shape = ResponsesShape(runtime.config.cache_info)
    return await _steered(request, body, tokens, model, shape=shape, api="responses", media=media)
