"""Several models behind one proxy: which model a request names, and ``GET /v1/models``.

Each ``--backend-url [MODEL=]URL`` serves one model under the operator's name (or, without
one, the name the server reports). Servers under one name must share a compatibility key;
different names may have different keys. A request goes only to servers of the model its
``model`` field names, and its KV lives in the host tree under that model's namespace (its
compatibility key), so no model ever sees another's KV.

Naming rule: with exactly one model and no name given by the operator, the ``model`` field is
ignored, as llama-server ignores it. Otherwise the field must name a served model: unknown
names get 404 ``model_not_found``, a missing field 400.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.errors import BadRequest, NotFound
from proxy.tokenizer import PromptTokenizer
from proxy.tokenizer.template import ChatTemplate


@dataclass
class ModelEntry:
    name: str
    ns: str  # the tree namespace of its KV: the compatibility key's hash
    compat: dict[str, Any]
    named: bool  # the operator chose the name (--backend-url NAME=URL)
    listing: dict[str, Any] = field(default_factory=dict)  # the server's /v1/models entry
    n_vocab: int = 1 << 31
    local_tokenizer: PromptTokenizer | None = None
    tokenizer_note: str = "server"
    template: ChatTemplate | None = None  # rendered locally: passed the startup parity check
    template_note: str = "server"


def compat_ns(compat: dict[str, Any]) -> str:
    """A short, stable name for a compatibility key (the model's tree namespace)."""
    return "m:" + hashlib.sha256(orjson.dumps(compat, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def with_model(model_ns: str, ns: str) -> str:
    """The tree namespace of a request: its model's, then its cache-isolation key if any."""
    return f"{model_ns}/{ns}" if ns else model_ns


def pick_model(models: dict[str, ModelEntry], body: dict[str, Any]) -> ModelEntry:
    """The model the request names (see the module's naming rule)."""
    name = body.get("model")
    if len(models) == 1:
        only = next(iter(models.values()))
        if not only.named or name == only.name:
            return only
    if name is None:
        raise BadRequest(f"'model' is required: this proxy serves {', '.join(sorted(models))}")
    if not isinstance(name, str):
        raise BadRequest("'model' must be a string")
    if name not in models:
        raise NotFound(f"The model `{name}` does not exist. Available: {', '.join(sorted(models))}")
    return models[name]


def models_listing(models: dict[str, ModelEntry]) -> dict[str, Any]:
    """``GET /v1/models``: every model the proxy can serve, under its operator-chosen name."""
    data = []
    for entry in models.values():
        item = {"object": "model", "owned_by": "llamacpp", "created": int(time.time()), **entry.listing}
        item["id"] = entry.name
        data.append(item)
    return {"object": "list", "data": data}
