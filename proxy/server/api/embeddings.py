"""``POST /v1/embeddings``, ``/embeddings``, ``/embedding`` and ``/v1/rerank`` (``/rerank``,
``/reranking``, ``/v1/reranking``): leased like completions.

llama-server runs each input of an embeddings request (each document of a rerank) on a slot, which replaces that slot's
KV. So the proxy leases a slot for the request (queueing, admission and the model's servers
as for a completion), pins every input to it (``id_slot``, honoured with ``--kvctl`` by patch
0014; the inputs run one after another), and afterwards records the slot's content as
unknown, to be erased before anyone's prefix is reused from it. The server's answer is passed
on as it is. An embeddings server (``--embeddings``) serves with KV moves off: its slots
hold pooled inputs, not prefixes worth moving.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from proxy.errors import BackendError, BadRequest, NotSupported, Unavailable
from proxy.server.api.routes import SESSION_HEADER, _read_json, _request_id
from proxy.server.coordinator import RestoreAbandoned
from proxy.server.dataplane.backend import ServerClient
from proxy.server.http.forward import forward_headers, radix_headers, read_capped
from proxy.server.http.front import cache_namespace, prompt_token_ids
from proxy.server.ops.models import ModelEntry, pick_model, with_model
from proxy.server.ops.runtime import RUNTIME, Runtime

log = logging.getLogger("radix")
EMBEDDING_PATHS = ("/v1/embeddings", "/embeddings", "/embedding")
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking")
NOT_SERVED = "This server does not support embeddings. Start it with `--embeddings`"
NOT_RERANKING = "This server does not support reranking. Start it with `--reranking`"
POOLING_RANK = 4  # LLAMA_POOLING_TYPE_RANK: what --reranking sets
MAX_INPUTS = 2048  # inputs (documents) per request, as OpenAI's embeddings API: bounded work
RERANK_TOKENS = 4  # BOS, EOS, SEP, EOS around the query and a document (an estimate: sizing only)


def add_embedding_routes(app: web.Application) -> None:
    for path in EMBEDDING_PATHS:
        app.router.add_post(path, embeddings)
    for path in RERANK_PATHS:
        app.router.add_post(path, rerank)


async def embeddings(request: web.Request) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    body = await _read_json(request)
    model = pick_model(runtime.models, body)
    n_ctx = serving(runtime, model, rank=False)
    longest = await _longest_input(runtime, model, _inputs(body), n_ctx)
    return await _leased(request, body, model, longest, "embeddings")


async def rerank(request: web.Request) -> web.StreamResponse:
    """Each document is ranked against the query on a slot: the prompt is the server's
    (its rerank template, or the query and the document between BOS/EOS/SEP)."""
    runtime = request.app[RUNTIME]
    body = await _read_json(request)
    model = pick_model(runtime.models, body)
    serving(runtime, model, rank=True)
    query = body.get("query")
    if not isinstance(query, str):
        raise BadRequest('"query" must be a string' if "query" in body else '"query" must be provided')
    documents = body.get("documents", body.get("texts"))
    if not isinstance(documents, list) or not documents or not all(isinstance(d, str) for d in documents):
        raise BadRequest('"documents" must be a non-empty string array')
    if len(documents) > MAX_INPUTS:
        raise BadRequest(f'"documents" has {len(documents)} entries; at most {MAX_INPUTS} are accepted')
    q = await runtime.tokenize(query, model)
    longest = np.zeros(0, dtype=np.int32)
    for doc in documents:
        await asyncio.sleep(0)  # as for embeddings inputs
        tokens = await runtime.tokenize(doc, model)
        longest = tokens if len(tokens) > len(longest) else longest
    tokens = np.concatenate([q, longest, np.zeros(RERANK_TOKENS, dtype=np.int32)])
    return await _leased(request, body, model, tokens, "rerank")


async def _leased(
    request: web.Request, body: dict[str, Any], model: ModelEntry, longest: np.ndarray, api: str
) -> web.StreamResponse:
    """Lease a slot big enough for ``longest``, run the request pinned to it, then record the
    slot as unknown."""
    runtime = request.app[RUNTIME]
    runtime.metrics.api_requests.labels(api).inc()
    coord, config = runtime.coordinator, runtime.config
    ns = with_model(model.ns, cache_namespace(config, body, request.headers))
    lease = await coord.acquire(
        _request_id(), longest, ns, model=model.name, session=request.headers.get(SESSION_HEADER, "")
    )
    status = 0
    try:
        await coord.restore(lease, 0)  # erases another namespace's KV first (isolation)
        body["id_slot"] = lease.slot.slot_id
        raw, status = await _forward(lease.server.client, request, body, config.max_answer_bytes)
    except RestoreAbandoned as exc:  # taken out of routing before anything was sent
        raise BackendError(f"llama-server went out of routing before the request ran: {exc}") from exc
    finally:
        coord.release_unknown(lease)
        log.info(
            "request %s api=%s server=%s slot=%d longest=%d queued_ms=%.0f status=%s",
            lease.request_id,
            api,
            lease.server.name,
            lease.slot.slot_id,
            len(longest),
            lease.queued_s * 1000,
            status or "failed",
        )
    return web.Response(
        body=raw,
        status=status,
        content_type="application/json",
        headers=radix_headers(lease, config.cache_info),
    )


async def _forward(
    backend: ServerClient, request: web.Request, body: dict[str, Any], limit: int
) -> tuple[bytes, int]:
    """The server's answer, at most ``limit`` bytes (--max-answer: thousands of vectors add up)."""
    headers = {**forward_headers(request), "Content-Type": "application/json"}
    try:
        async with backend.request(
            "POST", request.path, data=orjson.dumps(body), headers=headers, timeout=backend.completion_timeout
        ) as up:
            return await read_capped(up, limit), up.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BackendError(
            f"llama-server failed to answer the {request.path} request: {exc or 'timeout'}"
        ) from exc


def serving(runtime: Runtime, model: ModelEntry, rank: bool) -> int:
    """The smallest slot context of the model's servers, which must all serve embeddings (or,
    with ``rank``, reranking; the lease may pick any of them); a clear refusal otherwise."""
    servers = [s for s in runtime.coordinator.servers if s.model == model.name and s.healthy]
    if not servers:
        raise Unavailable("no llama-server of this model is serving")
    able = [s.embeddings and (s.pooling == POOLING_RANK) == rank for s in servers]
    if not any(able):
        raise NotSupported(NOT_RERANKING if rank else NOT_SERVED)
    if not all(able):
        flag = "--reranking" if rank else "--embeddings"
        raise NotSupported(f"only some of this model's servers were started with `{flag}`; start them alike")
    return min(s.n_ctx_slot for s in servers)


def _inputs(body: dict[str, Any]) -> list[Any]:
    """The request's inputs, split as the server splits them (``input``, or ``content``)."""
    key = "input" if "input" in body else "content" if "content" in body else None
    if key is None:
        raise BadRequest('"input" or "content" must be provided')
    value = body[key]
    if isinstance(value, list) and value and not any(isinstance(v, int) for v in value):
        if len(value) > MAX_INPUTS:
            raise BadRequest(f'"input" has {len(value)} inputs; at most {MAX_INPUTS} are accepted')
        return value  # several inputs
    if isinstance(value, list) and not value:
        raise BadRequest('"input" must not be empty')
    return [value]


async def _longest_input(runtime: Runtime, model: ModelEntry, inputs: list[Any], n_ctx: int) -> np.ndarray:
    """The tokens of the longest input: what the slot must hold (the lease checks it against
    the slot context and reserves its cells)."""
    longest = np.zeros(0, dtype=np.int32)
    for item in inputs:
        await asyncio.sleep(0)  # a short input is tokenized inline: let the loop run between them
        tokens = await _tokens(runtime, model, item, n_ctx)
        if len(tokens) == 0:
            raise BadRequest("Input content cannot be empty")
        if len(tokens) > len(longest):
            longest = tokens
    return longest


async def _tokens(runtime: Runtime, model: ModelEntry, item: Any, n_ctx: int) -> np.ndarray:
    if isinstance(item, str):
        return await runtime.tokenize(item, model)
    if isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        return prompt_token_ids(item, model.n_vocab, n_ctx)
    if isinstance(item, list) and all(isinstance(t, str | int) and not isinstance(t, bool) for t in item):
        ids = await runtime.on_any_server(
            lambda b: b.tokenize(item, add_special=True, parse_special=True), model.name
        )
        return prompt_token_ids(ids, model.n_vocab, n_ctx)
    raise BadRequest(
        "each embeddings input must be a string, an array of token ids, or strings and token ids "
        "mixed (multimodal inputs are not served through the proxy)"
    )
