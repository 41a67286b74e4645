"""``POST /infill`` (editor completion), steered like a completion.

llama-server builds the FIM prompt itself, from its vocab's FIM tokens, its ``n_batch``,
``n_predict``, ``--spm-infill`` and the slot context, and then runs it as a completion of
those token ids. The proxy builds the same ids (``proxy/core/infill.py``; the pieces tokenized
by the server, the parameters from ``/kvctl/caps``), leases and restores like any completion,
and sends ``/completion`` the ids pinned to the leased slot: the server's infill route would
not take ``id_slot`` for a prompt it builds, and its answer is a completion's either way.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from proxy.core.infill import (
    DEFAULT_FILENAME,
    FILE_TEXT,
    NO_TOKEN,
    REPO_TEXT,
    SNIPPET_TEXT,
    ExtraChunk,
    InfillParams,
    InfillPieces,
    PieceCache,
    infill_prompt,
)
from proxy.errors import BadRequest, NotSupported, Unavailable
from proxy.server.api.routes import _read_json, _steered
from proxy.server.http.front import cache_namespace
from proxy.server.ops.models import ModelEntry, pick_model
from proxy.server.ops.runtime import RUNTIME, Runtime

INFILL_FIELDS = ("input_prefix", "input_suffix", "input_extra")
COMPLETION_PATH = "/completion"
TOKENIZE_AT_ONCE = 8  # /tokenize calls in flight for one request
MAX_EXTRA_CHUNKS = 1024
Mixed = str | list[str | int]  # a string, or strings and token ids (the server's tokenize_mixed)


def add_infill_routes(app: web.Application) -> None:
    app.router.add_post("/infill", infill)


async def infill(request: web.Request) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    body = await _read_json(request)
    model = pick_model(runtime.models, body)
    params = model_params(runtime, model)
    missing = params.missing()
    if missing:
        raise NotSupported(f"Infill is not supported by this model: {missing}")
    prefix, suffix = _mixed(body, "input_prefix", model), _mixed(body, "input_suffix", model)
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise BadRequest('"prompt" must be a string')
    extra = _extra(body.get("input_extra", []))
    ns = cache_namespace(runtime.config, dict(body), request.headers)  # a copy: _steered pops the salt
    pieces = await _tokenized(runtime, model, ns, prefix, suffix, prompt, extra, params.fim_sep != NO_TOKEN)
    tokens = np.asarray(infill_prompt(params, pieces), dtype=np.int32)
    forward = {k: v for k, v in body.items() if k not in INFILL_FIELDS}
    forward["prompt"] = tokens.tolist()
    return await _steered(request, forward, tokens, model, path=COMPLETION_PATH, api="infill")


def model_params(runtime: Runtime, model: ModelEntry) -> InfillParams:
    """The servers' infill parameters: one set for the model, or a clear refusal (the prompt is
    built before the server is picked, so the model's servers must build the same one)."""
    found = {s.infill for s in runtime.coordinator.servers if s.model == model.name and s.healthy}
    if not found:
        raise Unavailable("no llama-server of this model is serving")
    if None in found:
        raise NotSupported(
            "/infill needs a llama-server whose patch series reports its infill parameters "
            "(/kvctl/caps 'infill', patch 0013): rebuild it with `radixctl build`"
        )
    if len(found) > 1:
        raise NotSupported(
            "/infill: the servers of this model build different infill prompts (their n_batch, "
            "n_predict, --spm-infill or per-slot context differ); start them alike"
        )
    params = found.pop()
    assert params is not None
    return params


def _mixed(body: dict[str, Any], key: str, model: ModelEntry) -> Mixed:
    if key not in body:
        raise BadRequest(f'"{key}" is required')
    value = body[key]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(_piece(v, model.n_vocab) for v in value):
        return value
    raise BadRequest(f'"{key}" must be a string or an array of strings and token ids')


def _piece(value: Any, n_vocab: int) -> bool:
    if isinstance(value, str):
        return True
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n_vocab


def _extra(value: Any) -> list[tuple[str, str]]:
    """(filename, text) of each ``input_extra`` chunk, checked as the server checks them."""
    if not isinstance(value, list):
        raise BadRequest('"input_extra" must be an array of {"filename": string, "text": string}')
    if len(value) > MAX_EXTRA_CHUNKS:
        # Each chunk is two /tokenize calls: bounded work per request (the server keeps only the
        # extra context's last tokens that fit the slot anyway).
        raise BadRequest(f'"input_extra" has {len(value)} chunks; at most {MAX_EXTRA_CHUNKS} are accepted')
    out = []
    for chunk in value:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise BadRequest('extra_context chunk must contain a "text" field with a string value')
        filename = chunk.get("filename", DEFAULT_FILENAME)
        if not isinstance(filename, str):
            raise BadRequest('extra_context chunk\'s "filename" field must be a string')
        out.append((filename, chunk["text"]))
    return out


async def _tokenized(
    runtime: Runtime,
    model: ModelEntry,
    ns: str,
    prefix: Mixed,
    suffix: Mixed,
    prompt: str,
    extra: list[tuple[str, str]],
    filenames: bool,
) -> InfillPieces:
    """Every piece tokenized by the server with the flags its infill route uses: the prompt
    with special tokens parsed, the rest as plain text, none with BOS."""
    cache = _cache(runtime, model)
    limit = asyncio.Semaphore(TOKENIZE_AT_ONCE)

    async def tok(content: Mixed, parse_special: bool = False) -> list[int]:
        # The kind is part of the key: the text "[1, 2]" is not the token ids [1, 2].
        text = "s" + content if isinstance(content, str) else "m" + orjson.dumps(content).decode()
        key = (ns, parse_special, text)
        found = cache.get(key)
        if found is not None:
            return found
        async with limit:
            ids = await runtime.on_any_server(
                lambda b: b.tokenize(content, add_special=False, parse_special=parse_special), model.name
            )
        cache.put(key, ids)
        return ids

    fixed = await asyncio.gather(tok(REPO_TEXT), tok(FILE_TEXT), tok(SNIPPET_TEXT))
    main = await asyncio.gather(tok(prefix), tok(suffix), tok(prompt, parse_special=True))
    texts = await asyncio.gather(*(tok(t) for _, t in extra))
    # A chunk's file name is used only with FIM_SEP: not tokenized otherwise.
    names = await asyncio.gather(*(tok(f + "\n") for f, _ in extra)) if filenames else [[] for _ in extra]
    return InfillPieces(
        prefix=main[0],
        suffix=main[1],
        prompt=main[2],
        extra=[ExtraChunk(filename=f, text=t) for f, t in zip(names, texts, strict=True)],
        repo=fixed[0],
        file=fixed[1],
        snippet=fixed[2],
    )


def _cache(runtime: Runtime, model: ModelEntry) -> PieceCache:
    return runtime.infill_pieces.setdefault(model.ns, PieceCache())
