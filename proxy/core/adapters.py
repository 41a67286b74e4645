"""Per-request LoRA adapters (a request's ``lora`` field) as part of the cache key.

llama-server applies the adapters loaded with ``--lora`` at the scales a request names
(``"lora": [{"id": 0, "scale": 0.5}]``: every adapter it does not name gets scale 0) or, when
it names none, at the server's own scales. KV computed under one set of scales is never
reused under another: the effective scales are folded into the request's tree namespace (a
slot holding another namespace's KV is erased before use, so the server's own reuse never
crosses adapter sets either, which stock's does after a request with adapters is followed
by one without), and every move into a slot names the adapters, so the server records them
for the slot and the request that follows keeps the KV instead of clearing it as a change.

Scales are compared as the server stores them (float32): two requests whose scales round to
the same float32 share their KV, two that differ never do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from proxy.errors import BadRequest

LORA_FIELD = "lora"


@dataclass(frozen=True)
class Adapters:
    """The effective adapter scales of a request. ``ns`` is the namespace part ("" when they
    are the server's own, so requests without ``lora`` keep the model's namespace);
    ``kvctl`` the ``lora`` a move into the slot names (None: the server's own)."""

    ns: str = ""
    kvctl: tuple[tuple[int, float], ...] | None = None

    def as_json(self) -> list[dict[str, Any]] | None:
        return None if self.kvctl is None else [{"id": i, "scale": s} for i, s in self.kvctl]


NO_ADAPTERS = Adapters()


def server_scales(compat: Mapping[str, Any]) -> tuple[float, ...]:
    """The scales of the server's ``--lora`` adapters in id order, from its compatibility key
    (``adapters``: LoRA entries first, in the order of the flags, then control vectors)."""
    entries = compat.get("adapters")
    if not isinstance(entries, list):
        return ()
    return tuple(_f32(e.get("scale", 0.0)) for e in entries if isinstance(e, dict) and "lora" in e)


def request_adapters(body: Mapping[str, Any], base: Sequence[float]) -> Adapters:
    """The adapters of a request for a server whose ``--lora`` scales are ``base``; a
    ``lora`` field that the server would not apply as named is a BadRequest."""
    field = body.get(LORA_FIELD)
    if field is None:
        return NO_ADAPTERS
    if not isinstance(field, list):
        raise BadRequest(f"'{LORA_FIELD}' must be an array of objects with 'id' and 'scale' fields")
    named: dict[int, float] = {}
    for entry in field:
        if not isinstance(entry, dict):
            raise BadRequest(f"each '{LORA_FIELD}' entry must be an object with 'id' and 'scale' fields")
        ident, scale = entry.get("id"), entry.get("scale")
        if not isinstance(ident, int) or isinstance(ident, bool):
            raise BadRequest(f"'{LORA_FIELD}' entry 'id' must be an integer, not {ident!r}")
        if not isinstance(scale, int | float) or isinstance(scale, bool) or not math.isfinite(scale):
            raise BadRequest(f"'{LORA_FIELD}' entry 'scale' must be a finite number, not {scale!r}")
        if not 0 <= ident < len(base):
            have = f"ids 0 to {len(base) - 1}" if base else "none (start it with --lora FILE)"
            raise BadRequest(f"'{LORA_FIELD}': adapter {ident} does not exist: the server has {have}")
        named[ident] = _f32(scale)  # the last entry of an id wins, as on the server
    if not named:  # an empty list: the server's own scales
        return NO_ADAPTERS
    scales = tuple(named.get(i, 0.0) for i in range(len(base)))
    kvctl = tuple(sorted(named.items()))
    if scales == tuple(base):
        return Adapters("", kvctl)
    return Adapters("lora=" + ",".join(repr(s) for s in scales), kvctl)


def with_adapters(ns: str, adapters: Adapters) -> str:
    """The tree namespace of a request under ``adapters``."""
    return f"{ns}/{adapters.ns}" if adapters.ns else ns


def _f32(value: Any) -> float:
    return float(np.float32(value)) + 0.0  # + 0.0: -0.0 is 0.0, as the server compares them
