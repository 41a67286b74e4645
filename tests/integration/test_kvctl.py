"""The /kvctl/* control API of the patched llama-server (docs/kvctl.md), on real servers.

Default model, greedy, one request at a time. Invariant 5 of the architecture: a KV move is
lossless (re-export byte-identical, continuation bitwise identical to the one computed from
the same KV left in place, when the imported cells land at the same cell indices); against a
full prefill on the stock build, answers may part only at a near-tie (NEAR_TIE_NATS).

Servers, all module scoped except the session stock reference: one patched server with
--kvctl that these tests may erase and overwrite (not the shared session ``patched_server``),
one with a known key, one fault-injection build, one patched without --kvctl. Every kvctl
server has a /kvctl key (conftest gives a random one); ``call`` sends it on /kvctl requests.
"""

from __future__ import annotations

import base64
import http.client
import json
import struct
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest

from proxy.core.payload import tokens_sha256
from proxy.native.launch import PROXY_SERVER_ARGS, ServerProcess, free_port
from proxy.server.dataplane.kvctl import Caps
from tests.helpers import NEAR_TIE_NATS, Reply, ServerFactory, chat_body, request

# Story text: greedy continuations of N_PREDICT tokens without an early end of text, and no
# near-tie at the first tokens (measured), so that comparisons see every generated token.
PROMPT = (
    "The following is a short story for children, written in simple words. "
    "Bob was a small orange cat who lived in a little blue house by the sea with an old fisherman "
    "named Tom. Every day Tom went out in his boat, and every evening Bob waited for him on the steps, "
    "watching the waves. The neighbours said Bob was the smartest cat in the village, because he always "
    "knew when a storm was coming. He liked warm bread, the smell of rope and salt, and the sound of the "
    "gulls over the harbour. One morning, after a long night of wind and rain, Bob walked down to the "
    "beach alone. The sand was cold and wet, and"
)
SUFFIX = " there, half buried in the sand, Bob found"
CANARY = "The capital of France is"
N_PREDICT = 12
KEY = "kvctl-test-key"
MAGIC = 0xAF143CD8


# --- HTTP -------------------------------------------------------------------------------------

# Seconds per request (test_vulkan.py raises it: a software Vulkan device is far slower).
CALL_TIMEOUT = 180.0

# The /kvctl key of each server these tests talk to, by URL.
KEYS: dict[str, str] = {}


def keyed(server: ServerProcess) -> ServerProcess:
    if server.spec.kvctl_key:
        KEYS[server.url] = server.spec.kvctl_key
    return server


def auth(url: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[url]}"} if url in KEYS else {}


def call(
    url: str,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float | None = None,
) -> Reply:
    """One request; on /kvctl without explicit ``headers``, with the server's key."""
    if headers is None and path.startswith("/kvctl"):
        headers = auth(url)
    return request(
        url + path, method, body, headers=headers, timeout=CALL_TIMEOUT if timeout is None else timeout
    )


def ok(url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
    reply = call(url, method, path, body, headers)
    assert reply.status == 200, f"{method} {path} -> {reply.status}: {str(reply.body)[:400]}"
    return reply.body


def assert_error(reply: Reply, status: int, etype: str, *needles: str) -> str:
    """llama-server's error shape, the given status and type, and a message naming the cause."""
    assert reply.status == status, f"expected {status}, got {reply.status}: {str(reply.body)[:400]}"
    assert isinstance(reply.body, dict) and isinstance(reply.body.get("error"), dict), reply.body
    err = reply.body["error"]
    assert err.get("code") == status, err
    assert err.get("type") == etype, err
    message = err.get("message")
    assert isinstance(message, str) and message, err
    for needle in needles:
        assert needle.lower() in message.lower(), f"{needle!r} not in error message {message!r}"
    return message


# --- kvctl helpers ----------------------------------------------------------------------------


def caps(url: str) -> dict[str, Any]:
    return dict(ok(url, "GET", "/kvctl/caps"))


def slot_info(url: str, slot: int) -> dict[str, Any]:
    return dict(ok(url, "GET", "/kvctl/slots?tokens=1")["slots"][slot])


def cells(url: str) -> dict[str, Any]:
    return dict(ok(url, "GET", "/kvctl/cells"))


def erase(url: str, slot: int) -> None:
    ok(url, "POST", "/kvctl/erase", {"slot": slot})


def reset(url: str) -> None:
    """Every slot erased, every owner released: an empty pool."""
    c = caps(url)
    for slot in range(c["n_parallel"]):
        erase(url, slot)
    for owner in range(*c["owner_ids"]):
        ok(url, "POST", "/kvctl/release", {"owner": owner})
    assert cells(url)["used"] == 0


def held(url: str, slot: int | None = 0, owner: int | None = None) -> list[int]:
    """The tokens a slot or owner holds now."""
    listing = ok(url, "GET", "/kvctl/slots?tokens=1")
    if owner is not None:
        return next((list(o["tokens"]) for o in listing["owners"] if o["id"] == owner), [])
    return list(listing["slots"][slot]["tokens"])


def export_body(
    url: str,
    p0: int,
    p1: int,
    slot: int | None = 0,
    owner: int | None = None,
    tokens: list[int] | None = None,
) -> dict[str, Any]:
    """An export bound to ``tokens`` (default: what the sequence holds now)."""
    body: dict[str, Any] = {"p0": p0, "p1": p1}
    body.update({"owner": owner} if owner is not None else {"slot": slot})
    expect = tokens if tokens is not None else held(url, slot, owner)[:p1]
    body["expect_sha256"] = tokens_sha256(expect)
    return body


def publish(url: str, slot: int, owner: int, n: int) -> Any:
    return ok(
        url,
        "POST",
        "/kvctl/publish",
        {"slot": slot, "owner": owner, "n": n, "expect_sha256": tokens_sha256(held(url, slot)[:n])},
    )


def attach(url: str, owner: int, slot: int, m: int | None = None) -> Any:
    tokens = held(url, owner=owner)
    body: dict[str, Any] = {"owner": owner, "slot": slot, "expect_sha256": tokens_sha256(tokens[:m])}
    if m is not None:
        body["m"] = m
    return ok(url, "POST", "/kvctl/attach", body)


def export(url: str, p0: int, p1: int, slot: int | None = 0, owner: int | None = None) -> bytes:
    res = ok(url, "POST", "/kvctl/export", export_body(url, p0, p1, slot, owner))
    blob = base64.b64decode(res["data"])
    assert res["size"] == len(blob) and res["n_cells"] == p1 - p0
    return blob


def b64(blob: bytes) -> str:
    return base64.b64encode(blob).decode()


def import_body(
    compat: Any, slot: int, p0: int, p1: int, tokens: list[int], blobs: list[bytes], **extra: Any
) -> dict[str, Any]:
    return {
        "slot": slot,
        "p0": p0,
        "p1": p1,
        "tokens": tokens,
        "compat": compat,
        "segments": [{"data": b64(b)} for b in blobs],
        **extra,
    }


def import_(
    url: str, compat: Any, slot: int, p0: int, p1: int, tokens: list[int], blobs: list[bytes]
) -> dict[str, Any]:
    return dict(ok(url, "POST", "/kvctl/import", import_body(compat, slot, p0, p1, tokens, blobs)))


def parse_payload(blob: bytes, n_meta: int) -> tuple[int, list[int]]:
    """(cell count, positions) of a payload, per the documented format (version 1)."""
    magic, _seq, n_stream, n_cells = struct.unpack_from("<IiII", blob, 0)
    assert magic == MAGIC and n_stream == 1
    positions = [struct.unpack_from("<i", blob, 16 + i * n_meta)[0] for i in range(n_cells)]
    return n_cells, positions


# --- completions ------------------------------------------------------------------------------


@dataclass
class Completion:
    tokens: list[int]
    # per generated token: (id, logprob, [(id, logprob) of the top candidates])
    probs: list[tuple[int, float, list[tuple[int, float]]]]
    cache_n: int
    prompt_n: int
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    def margin(self, i: int) -> float:
        tops = sorted((lp for _, lp in self.probs[i][2]), reverse=True)
        return tops[0] - tops[1] if len(tops) > 1 else float("inf")


def complete(
    url: str, prompt: Any, slot: int | None = 0, cache: bool = True, n: int = N_PREDICT, **extra: Any
) -> Completion:
    body = {
        "prompt": prompt,
        "cache_prompt": cache,
        "temperature": 0,
        "n_predict": n,
        "n_probs": 3,
        "return_tokens": True,
        **extra,
    }
    if slot is not None:
        body["id_slot"] = slot
    res = ok(url, "POST", "/completion", body)
    probs = [
        (p["id"], p["logprob"], [(t["id"], t["logprob"]) for t in p["top_logprobs"]])
        for p in res["completion_probabilities"]
    ]
    return Completion(res["tokens"], probs, res["timings"]["cache_n"], res["timings"]["prompt_n"], res)


def assert_bitwise(got: Completion, ref: Completion) -> None:
    """Same tokens, same log-probabilities of every token and every top candidate, bit for bit."""
    assert got.tokens == ref.tokens
    assert got.probs == ref.probs


def assert_same_or_near_tie(got: Completion, ref: Completion, tol: float = NEAR_TIE_NATS) -> None:
    """Invariant 5 against a full prefill: equal tokens, or parting only where ``ref`` is near a tie."""
    assert got.tokens and ref.tokens
    for i, (x, y) in enumerate(zip(got.tokens, ref.tokens, strict=False)):
        if x != y:
            assert ref.margin(i) < tol, (
                f"answers part at token {i} ({x} vs {y}) where the reference's "
                f"top-two margin is {ref.margin(i):.3f} >= {tol}"
            )
            return
    assert len(got.tokens) == len(ref.tokens)


# --- servers ----------------------------------------------------------------------------------

# One thread each: up to four of these servers are up at once on a shared 2-core machine, and
# several threads per server spin against each other when the cores are oversubscribed.
ONE = 1


@pytest.fixture(scope="module")
def kv_server(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    """Patched, --kvctl, with a --kvctl-dir: these tests own its slots."""
    return keyed(start_server(patched_bin, threads=ONE))


@pytest.fixture(scope="module")
def keyed_server(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    return start_server(patched_bin, kvctl_key=KEY, n_parallel=2, ctx_size=2048, threads=ONE)


@pytest.fixture(scope="module")
def fault_server(start_server: ServerFactory, fault_bin: Path) -> ServerProcess:
    return keyed(start_server(fault_bin, n_parallel=2, ctx_size=2048, threads=ONE))


@pytest.fixture(scope="module")
def off_server(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    return start_server(patched_bin, kvctl=False, threads=ONE)


@dataclass
class Moved:
    """Slot 0 of ``kv_server`` after one completion, its KV exported, and the reference continuation."""

    url: str
    dir: Path
    caps: dict[str, Any]
    tokens: list[int]  # what slot 0 recorded: n tokens
    blob: bytes  # export of [0, n)
    request: list[int]  # tokens + a suffix: reuses the whole slot
    ref: Completion  # the continuation from the KV left in place

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def compat(self) -> dict[str, Any]:
        return dict(self.caps["compat"])

    @property
    def cell_bytes(self) -> int:
        return int(self.caps["payload"]["cell_bytes"])

    @property
    def header_bytes(self) -> int:
        return int(self.caps["payload"]["header_bytes"])


@pytest.fixture(scope="module")
def moved(kv_server: ServerProcess) -> Moved:
    url = kv_server.url
    assert kv_server.spec.kvctl_dir is not None
    c = caps(url)
    assert c["sharing"] and not c["fault_injection"] and c["n_parallel"] == 4
    reset(url)
    first = complete(url, PROMPT, slot=0)
    assert first.cache_n == 0 and len(first.tokens) == N_PREDICT
    info = slot_info(url, 0)
    tokens, n = info["tokens"], info["n_tokens"]
    assert n == first.prompt_n + len(first.tokens) - 1  # the last sampled token is not decoded yet
    assert (info["pos_min"], info["pos_max"], info["n_cells"]) == (0, n - 1, n)
    blob = export(url, 0, n)
    suffix = ok(url, "POST", "/tokenize", {"content": SUFFIX})["tokens"]
    request = tokens + [int(t) for t in suffix]
    ref = complete(url, request, slot=0)
    assert ref.cache_n == n and ref.prompt_n == len(suffix) and len(ref.tokens) == N_PREDICT
    return Moved(url, kv_server.spec.kvctl_dir, c, tokens, blob, request, ref)


# --- 1. move a slot out and back --------------------------------------------------------------


def test_export_erase_import_is_lossless(moved: Moved, stock_server: ServerProcess) -> None:
    url, n = moved.url, moved.n
    meta_bytes = moved.compat["cell_meta_bytes"]
    assert len(moved.blob) == moved.header_bytes + n * moved.cell_bytes
    assert parse_payload(moved.blob, meta_bytes) == (n, list(range(n)))
    # the reference completion extended the slot; its [0, n) is the same KV
    assert export(url, 0, n) == moved.blob

    assert ok(url, "POST", "/kvctl/erase", {"slot": 0})["n_erased"] > n
    info = slot_info(url, 0)
    assert (info["n_tokens"], info["n_cells"], info["pos_max"]) == (0, 0, -1)
    assert_error(
        call(
            url,
            "POST",
            "/kvctl/export",
            {"slot": 0, "p0": 0, "p1": n, "expect_sha256": tokens_sha256(moved.tokens)},
        ),
        400,
        "invalid_request_error",
        "does not hold",
    )

    res = import_(url, moved.compat, 0, 0, n, moved.tokens, [moved.blob])
    assert (res["slot"], res["n_tokens"], res["n_cells"], res["bytes"]) == (0, n, n, len(moved.blob))
    info = slot_info(url, 0)
    assert info["tokens"] == moved.tokens
    assert (info["pos_min"], info["pos_max"], info["n_cells"]) == (0, n - 1, n)
    assert cells(url)["seq"] == {"0": n}
    assert export(url, 0, n) == moved.blob

    out = complete(url, moved.request, slot=0)
    assert out.cache_n == n and out.prompt_n == len(moved.request) - n
    assert_bitwise(out, moved.ref)

    # against a full prefill of the same tokens on the stock build: equal, or parting at a near-tie
    full = complete(stock_server.url, moved.request, slot=None, cache=False)
    assert full.cache_n == 0 and full.prompt_n == len(moved.request)
    assert_same_or_near_tie(out, full)


# --- 2. segments ------------------------------------------------------------------------------


def test_two_segments_and_import_on_top(moved: Moved) -> None:
    url, n = moved.url, moved.n
    a = n // 2
    reset(url)
    import_(url, moved.compat, 0, 0, n, moved.tokens, [moved.blob])
    s1, s2 = export(url, 0, a), export(url, a, n)
    assert len(s1) == moved.header_bytes + a * moved.cell_bytes
    assert parse_payload(s2, moved.compat["cell_meta_bytes"]) == (n - a, list(range(a, n)))

    # [0,a) + [a,n) in one import, compat given as compat_id
    erase(url, 0)
    import_(url, moved.caps["compat_id"], 0, 0, n, moved.tokens, [s1, s2])
    assert export(url, 0, n) == moved.blob
    out = complete(url, moved.request, slot=0)
    assert out.cache_n == n
    assert_bitwise(out, moved.ref)

    # [a,n) on top of a slot that holds [0,a)
    erase(url, 0)
    import_(url, moved.compat, 0, 0, a, moved.tokens[:a], [s1])
    assert slot_info(url, 0)["n_tokens"] == a
    res = import_(url, moved.compat, 0, a, n, moved.tokens, [s2])
    assert res["n_tokens"] == n and res["n_cells"] == n
    assert slot_info(url, 0)["tokens"] == moved.tokens
    assert export(url, 0, n) == moved.blob
    out = complete(url, moved.request, slot=0)
    assert out.cache_n == n
    assert_bitwise(out, moved.ref)

    # the same two segments through payload files, both from one file at offsets
    res = ok(url, "POST", "/kvctl/export", {**export_body(url, 0, a), "file": "seg1.kv"})
    assert res["file"] == "seg1.kv" and "data" not in res
    assert (moved.dir / "seg1.kv").read_bytes() == s1
    (moved.dir / "both.kv").write_bytes(b"xyz" + s1 + s2)
    erase(url, 0)
    ok(
        url,
        "POST",
        "/kvctl/import",
        {
            "slot": 0,
            "p0": 0,
            "p1": n,
            "tokens": moved.tokens,
            "compat": moved.compat,
            "segments": [
                {"file": "both.kv", "offset": 3, "size": len(s1)},
                {"file": "both.kv", "offset": 3 + len(s1), "size": len(s2)},
            ],
        },
    )
    assert export(url, 0, n) == moved.blob


# --- 3. owners: publish, attach, release -----------------------------------------------------


def test_publish_attach_share_cells(moved: Moved) -> None:
    url, n = moved.url, moved.n
    reset(url)
    owner = moved.caps["owner_ids"][0]
    import_(url, moved.compat, 0, 0, n, moved.tokens, [moved.blob])
    res = publish(url, 0, owner, n)
    assert (res["id"], res["n_tokens"], res["n_cells"]) == (owner, n, n)
    assert export(url, 0, n, slot=None, owner=owner) == moved.blob
    for slot in (1, 2):
        res = attach(url, owner, slot)
        assert (res["id"], res["owner"], res["n_tokens"], res["n_cells"]) == (slot, owner, n, n)
        assert slot_info(url, slot)["tokens"] == moved.tokens

    c = cells(url)
    assert c["seq"] == {"0": n, "1": n, "2": n, str(owner): n}
    assert c["logical"] == 4 * n
    assert c["used"] == n < c["logical"]  # the shared prefix is held once
    assert (c["slot"], c["owner"], c["owner_only"]) == (n, n, 0)
    assert c["free"] == c["n_cells"] - n

    # slot 0 moves on: the owner and the two slots still hold the cells
    erase(url, 0)
    c = cells(url)
    assert (c["used"], c["owner_only"]) == (n, 0)

    # each attached slot continues exactly like the slot the KV came from (same cells, suffix at the
    # same cell indices: the other slot is erased first)
    out1 = complete(url, moved.request, slot=1)
    assert out1.cache_n == n
    assert_bitwise(out1, moved.ref)
    erase(url, 1)
    out2 = complete(url, moved.request, slot=2)
    assert out2.cache_n == n
    assert_bitwise(out2, moved.ref)
    c = cells(url)
    assert c["owner_only"] == 0 and c["used"] == c["seq"]["2"] > n

    # slot 2 is overwritten by an unrelated prompt: only the owner still holds the prefix
    complete(url, CANARY, slot=2, cache=False)
    c = cells(url)
    held = c["seq"]["2"]
    assert c["owner_only"] == n and c["used"] == n + held
    res = ok(url, "POST", "/kvctl/release", {"owner": owner})
    assert res.pop("instance") == moved.caps["instance"] and res == {"owner": owner, "n_released": n}
    c = cells(url)
    assert c["seq"] == {"2": held}
    assert (c["used"], c["owner"], c["owner_only"], c["logical"]) == (held, 0, 0, held)
    assert ok(url, "GET", "/kvctl/slots")["owners"] == []


# --- 4. bad input -----------------------------------------------------------------------------


@dataclass
class BadCtx:
    m: Moved
    canary: Completion  # the answer before any bad request

    def imp(self, **over: Any) -> dict[str, Any]:
        body = import_body(self.m.compat, 0, 0, self.m.n, self.m.tokens, [self.m.blob])
        body.update(over)
        return body


@pytest.fixture(scope="module")
def bad(moved: Moved) -> BadCtx:
    url = moved.url
    reset(url)
    import_(url, moved.compat, 0, 0, moved.n, moved.tokens, [moved.blob])
    canary = complete(url, CANARY, slot=1, cache=False)
    # a valid payload outside the directory, reachable by traversal or through a symlink inside it
    outside = moved.dir.parent / f"outside-{moved.dir.name}.kv"
    outside.write_bytes(moved.blob)
    (moved.dir.parent / "x").write_bytes(moved.blob)
    (moved.dir / "whole.kv").write_bytes(moved.blob)
    link = moved.dir / "link.kv"
    if link.is_symlink():
        link.unlink()
    link.symlink_to(outside)
    return BadCtx(moved, canary)


Case = tuple[str, str, Any, int, str, tuple[str, ...]]  # method, path, body, status, type, message parts


def _bad_magic(b: BadCtx) -> Case:
    blob = b.m.blob
    return (
        "POST",
        "/kvctl/import",
        b.imp(segments=[{"data": b64(b"\0\0\0\0" + blob[4:])}]),
        400,
        "invalid_request_error",
        ("magic",),
    )


BAD_CASES: dict[str, Callable[[BadCtx], Case]] = {
    # the server loaded no adapter: a move may not name one
    "import-lora-unknown": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(lora=[{"id": 0, "scale": 1.0}]),
        400,
        "invalid_request_error",
        ("lora", "at most 0 adapters"),
    ),
    "import-lora-not-a-list": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(lora={"id": 0}),
        400,
        "invalid_request_error",
        ("lora",),
    ),
    "import-slot-negative": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(slot=-1),
        400,
        "invalid_request_error",
        ("slot -1 does not exist",),
    ),
    "import-slot-n_parallel": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(slot=4),
        400,
        "invalid_request_error",
        ("slot 4 does not exist",),
    ),
    "export-slot-n_parallel": lambda b: (
        "POST",
        "/kvctl/export",
        {"slot": 4, "p0": 0, "p1": 1},
        400,
        "invalid_request_error",
        ("slot 4",),
    ),
    "erase-slot-n_parallel": lambda b: (
        "POST",
        "/kvctl/erase",
        {"slot": 4},
        400,
        "invalid_request_error",
        ("slot 4",),
    ),
    "erase-slot-negative": lambda b: (
        "POST",
        "/kvctl/erase",
        {"slot": -4},
        400,
        "invalid_request_error",
        ("slot -4",),
    ),
    "publish-slot-n_parallel": lambda b: (
        "POST",
        "/kvctl/publish",
        {"slot": 4, "owner": 4, "n": 1},
        400,
        "invalid_request_error",
        ("slot 4",),
    ),
    "attach-owner-is-a-slot": lambda b: (
        "POST",
        "/kvctl/attach",
        {"owner": 0, "slot": 1},
        400,
        "invalid_request_error",
        ("owner 0 does not exist",),
    ),
    "export-range-beyond-sequence": lambda b: (
        "POST",
        "/kvctl/export",
        {"slot": 0, "p0": 0, "p1": b.m.n + 5, "expect_sha256": "0" * 64},
        400,
        "invalid_request_error",
        ("does not hold",),
    ),
    # Checked before the payload file is sized from it (it was made and fallocated first).
    "export-p1-beyond-slot-context": lambda b: (
        "POST",
        "/kvctl/export",
        {"slot": 0, "p0": 0, "p1": 10**9, "file": "huge.kv", "expect_sha256": "0" * 64},
        400,
        "invalid_request_error",
        ("invalid range [0, 1000000000)",),
    ),
    "import-p1-beyond-slot-context": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(p1=10**6),
        400,
        "invalid_request_error",
        ("invalid range",),
    ),
    "import-segments-short-of-p1": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(p1=b.m.n + 1, tokens=b.m.tokens + [1]),
        400,
        "invalid_request_error",
        ("segments cover",),
    ),
    "import-on-top-of-missing-prefix": lambda b: (
        "POST",
        "/kvctl/import",
        import_body(b.m.compat, 2, 4, b.m.n, b.m.tokens, [export(b.m.url, 4, b.m.n)]),
        409,
        "unavailable_error",
        ("does not hold tokens[0, 4)",),
    ),
    "import-incompatible-k-types": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(compat=dict(b.m.compat, k_types=[0] * len(b.m.compat["k_types"]))),
        400,
        "invalid_request_error",
        ("incompatible",),
    ),
    "import-incompatible-fingerprint": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(compat=dict(b.m.compat, fingerprint="0" * 64)),
        400,
        "invalid_request_error",
        ("incompatible",),
    ),
    "import-wrong-compat-id": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(compat="0" * 64),
        400,
        "invalid_request_error",
        ("incompatible",),
    ),
    "import-unknown-format-version": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(compat=dict(b.m.compat, format_version=99)),
        400,
        "invalid_request_error",
        ("format version",),
    ),
    "import-no-compat": lambda b: (
        "POST",
        "/kvctl/import",
        {k: v for k, v in b.imp().items() if k != "compat"},
        400,
        "invalid_request_error",
        ("compat",),
    ),
    "import-truncated-payload": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(segments=[{"data": b64(b.m.blob[:-1])}]),
        400,
        "invalid_request_error",
        ("truncated",),
    ),
    "import-bad-magic": _bad_magic,
    "import-tokens-wrong-length": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(tokens=b.m.tokens[:-1]),
        400,
        "invalid_request_error",
        ("tokens",),
    ),
    "import-fault-in-normal-build": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(fault="after_first_segment"),
        400,
        "invalid_request_error",
        ("fault",),
    ),
    "import-fault-not-a-string": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(fault=1),
        400,
        "invalid_request_error",
        ("fault",),
    ),
    "import-file-dotdot": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(segments=[{"file": "../x", "size": len(b.m.blob)}]),
        400,
        "invalid_request_error",
        ("invalid file name",),
    ),
    "import-file-etc-passwd": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(segments=[{"file": "/etc/passwd", "size": 10}]),
        400,
        "invalid_request_error",
        ("invalid file name",),
    ),
    "import-file-absolute-valid-payload": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(segments=[{"file": str(b.m.dir.parent / f"outside-{b.m.dir.name}.kv"), "size": len(b.m.blob)}]),
        400,
        "invalid_request_error",
        ("invalid file name",),
    ),
    "import-file-symlink-out": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(segments=[{"file": "link.kv", "size": len(b.m.blob)}]),
        400,
        "invalid_request_error",
        ("link.kv",),
    ),
    "import-file-beyond-its-size": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(segments=[{"file": "whole.kv", "offset": 8, "size": len(b.m.blob)}]),
        400,
        "invalid_request_error",
        ("outside file",),
    ),
    "export-file-dotdot": lambda b: (
        "POST",
        "/kvctl/export",
        {"slot": 0, "p0": 0, "p1": 1, "file": "../y.kv"},
        400,
        "invalid_request_error",
        ("invalid file name",),
    ),
    "export-file-with-slash": lambda b: (
        "POST",
        "/kvctl/export",
        {"slot": 0, "p0": 0, "p1": 1, "file": "a/b"},
        400,
        "invalid_request_error",
        ("invalid file name",),
    ),
    "export-empty-range": lambda b: (
        "POST",
        "/kvctl/export",
        {"slot": 0, "p0": 3, "p1": 3},
        400,
        "invalid_request_error",
        ("invalid range [3, 3)",),
    ),
    "export-slot-and-owner": lambda b: (
        "POST",
        "/kvctl/export",
        {"slot": 0, "owner": b.m.caps["owner_ids"][0], "p0": 0, "p1": 1},
        400,
        "invalid_request_error",
        ("exactly one",),
    ),
    "export-owner-is-the-scratch": lambda b: (
        "POST",
        "/kvctl/export",
        {"owner": b.m.caps["owner_ids"][1], "p0": 0, "p1": 1},
        400,
        "invalid_request_error",
        ("does not exist",),
    ),
    "export-p0-not-an-integer": lambda b: (
        "POST",
        "/kvctl/export",
        {"slot": 0, "p0": "0", "p1": 1},
        400,
        "invalid_request_error",
        ("'p0' must be an integer",),
    ),
    "import-random-bytes": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(segments=[{"data": b64(bytes(range(256)) * 4)}]),
        400,
        "invalid_request_error",
        ("segment 0",),
    ),
    "import-invalid-base64": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(segments=[{"data": "!!!"}]),
        400,
        "invalid_request_error",
        ("segment 0",),
    ),
    "import-segment-at-wrong-position": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(p0=1),
        400,
        "invalid_request_error",
        ("segment 0",),
    ),
    "import-invalid-token-id": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(tokens=[-5] + b.m.tokens[1:]),
        400,
        "invalid_request_error",
        ("invalid token id",),
    ),
    "import-no-segments": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(segments=[]),
        400,
        "invalid_request_error",
        ("'segments' must be a non-empty array",),
    ),
    "import-segment-without-data": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(segments=[{}]),
        400,
        "invalid_request_error",
        ("segment 0 has no data",),
    ),
    "import-missing-file": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(segments=[{"file": "no-such.kv", "size": 10}]),
        400,
        "invalid_request_error",
        ("no-such.kv",),
    ),
    "import-file-without-size": lambda b: (
        "POST",
        "/kvctl/import",
        b.imp(segments=[{"file": "whole.kv"}]),
        400,
        "invalid_request_error",
        ("'size'",),
    ),
    "publish-n-beyond-slot": lambda b: (
        "POST",
        "/kvctl/publish",
        {"slot": 0, "owner": b.m.caps["owner_ids"][0], "n": b.m.n + 1, "expect_sha256": "0" * 64},
        400,
        "invalid_request_error",
        (f"invalid n = {b.m.n + 1}",),
    ),
    "attach-empty-owner": lambda b: (
        "POST",
        "/kvctl/attach",
        {"owner": b.m.caps["owner_ids"][0], "slot": 1, "expect_sha256": "0" * 64},
        400,
        "invalid_request_error",
        ("holds 0 tokens",),
    ),
    "release-owner-is-a-slot": lambda b: (
        "POST",
        "/kvctl/release",
        {"owner": 0},
        400,
        "invalid_request_error",
        ("owner 0 does not exist",),
    ),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_is_refused_and_changes_nothing(bad: BadCtx, case: str) -> None:
    m = bad.m
    url = m.url
    if slot_info(url, 0)["tokens"] != m.tokens:  # a previous case broke it: start from a known state
        reset(url)
        import_(url, m.compat, 0, 0, m.n, m.tokens, [m.blob])
    erase(url, 2)
    method, path, body, status, etype, needles = BAD_CASES[case](bad)

    assert_error(call(url, method, path, body), status, etype, *needles)

    info = slot_info(url, 0)
    assert info["tokens"] == m.tokens and info["n_cells"] == m.n and info["pos_max"] == m.n - 1
    assert slot_info(url, 2)["n_tokens"] == 0
    assert export(url, 0, m.n) == m.blob
    assert_same_or_near_tie(complete(url, CANARY, slot=1, cache=False), bad.canary)
    # nothing was written outside the directory, and no file appeared for a refused export
    assert (m.dir.parent / f"outside-{m.dir.name}.kv").read_bytes() == m.blob
    assert not (m.dir.parent / "y.kv").exists()
    assert not (m.dir / "huge.kv").exists()


def test_busy_slot_is_409(bad: BadCtx) -> None:
    m = bad.m
    url = m.url
    busy = 3
    erase(url, busy)
    body = json.dumps(
        {
            "prompt": PROMPT,
            "id_slot": busy,
            "cache_prompt": True,
            "temperature": 0,
            "n_predict": 2000,
            "ignore_eos": True,
            "stream": True,
        }
    )
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    try:
        assert resp.status == 200
        resp.readline()  # the first streamed chunk: the slot is generating
        assert slot_info(url, busy)["busy"]
        valid = import_body(m.compat, busy, 0, m.n, m.tokens, [m.blob])
        assert_error(
            call(url, "POST", "/kvctl/import", valid), 409, "unavailable_error", f"slot {busy} is busy"
        )
        assert_error(
            call(url, "POST", "/kvctl/export", {"slot": busy, "p0": 0, "p1": 1, "expect_sha256": "0" * 64}),
            409,
            "unavailable_error",
            "busy",
        )
        assert_error(call(url, "POST", "/kvctl/erase", {"slot": busy}), 409, "unavailable_error", "busy")
        assert slot_info(url, busy)["busy"]
    finally:
        conn.close()  # the server cancels the generation
    deadline = time.monotonic() + 60
    while slot_info(url, busy)["busy"]:
        assert time.monotonic() < deadline, "the cancelled generation did not stop"
        time.sleep(0.1)
    info = slot_info(url, 0)
    assert info["tokens"] == m.tokens and info["n_cells"] == m.n
    assert_same_or_near_tie(complete(url, CANARY, slot=1, cache=False), bad.canary)
    erase(url, busy)


KEY_CASES = {
    "no-key": {},
    "wrong-key": {"Authorization": "Bearer wrong-" + KEY},
    "key-without-bearer": {"Authorization": KEY},
}


@pytest.mark.parametrize("case", list(KEY_CASES))
def test_kvctl_key_is_required(keyed_server: ServerProcess, case: str) -> None:
    url = keyed_server.url
    good = {"Authorization": "Bearer " + KEY}
    ok(url, "POST", "/kvctl/erase", {"slot": 0}, headers=good)
    before = complete(url, PROMPT, slot=0)
    assert before.cache_n == 0
    n = ok(url, "GET", "/kvctl/slots", headers=good)["slots"][0]["n_tokens"]
    assert n > 0

    headers = KEY_CASES[case]
    for method, path, body in (
        ("GET", "/kvctl/caps", None),
        ("GET", "/kvctl/slots", None),
        ("POST", "/kvctl/erase", {"slot": 0}),
    ):
        assert_error(call(url, method, path, body, headers), 401, "authentication_error", "key")

    # nothing changed, the key opens the API, and the server answers as before
    assert ok(url, "GET", "/kvctl/slots", headers=good)["slots"][0]["n_tokens"] == n
    assert ok(url, "GET", "/kvctl/caps", headers=good)["n_parallel"] == 2
    assert ok(url, "POST", "/kvctl/erase", {"slot": 0}, headers=good)["n_erased"] == n
    assert_bitwise(complete(url, PROMPT, slot=0), before)


# --- 5. fault injection: a failed import leaves the slot empty ---------------------------------


def test_failed_import_clears_the_slot(fault_server: ServerProcess, stock_server: ServerProcess) -> None:
    url = fault_server.url
    c = caps(url)
    assert c["fault_injection"] is True
    reset(url)
    complete(url, PROMPT, slot=0)
    info = slot_info(url, 0)
    tokens, n = info["tokens"], info["n_tokens"]
    a = n // 2
    s1, s2 = export(url, 0, a), export(url, a, n)
    request = tokens + [int(t) for t in ok(url, "POST", "/tokenize", {"content": SUFFIX})["tokens"]]

    # the slot holds all of [0, n) when the import fails after writing its first segment
    body = import_body(c["compat"], 0, 0, n, tokens, [s1, s2], fault="after_first_segment")
    msg = assert_error(call(url, "POST", "/kvctl/import", body), 500, "server_error", "slot was cleared")
    assert "fault" in msg
    info = slot_info(url, 0)
    assert (info["n_tokens"], info["pos_min"], info["pos_max"], info["n_cells"]) == (0, -1, -1, 0)
    assert info["tokens"] == []
    cl = cells(url)
    assert "0" not in cl["seq"] and cl["used"] == 0 and cl["logical"] == 0

    # the same on top of [0, a): the slot's own prefix goes too
    import_(url, c["compat"], 0, 0, a, tokens[:a], [s1])
    body = import_body(c["compat"], 0, a, n, tokens, [s2], fault="after_first_segment")
    assert_error(call(url, "POST", "/kvctl/import", body), 500, "server_error", "slot was cleared")
    info = slot_info(url, 0)
    assert (info["n_tokens"], info["pos_max"], info["n_cells"]) == (0, -1, 0)
    assert cells(url)["used"] == 0

    # an unknown fault is refused before anything is written
    import_(url, c["compat"], 0, 0, a, tokens[:a], [s1])
    body = import_body(c["compat"], 0, a, n, tokens, [s2], fault="later")
    assert_error(call(url, "POST", "/kvctl/import", body), 400, "invalid_request_error", "fault")
    assert slot_info(url, 0)["n_tokens"] == a
    erase(url, 0)

    # the next request on that slot is a full prefill with the right answer
    out = complete(url, request, slot=0)
    assert out.cache_n == 0 and out.prompt_n == len(request)
    full = complete(stock_server.url, request, slot=None, cache=False)
    assert_same_or_near_tie(out, full)


# --- 6. flag off: no API, stock behaviour ------------------------------------------------------


def test_flag_off_is_stock(off_server: ServerProcess, stock_server: ServerProcess) -> None:
    url = off_server.url
    for path in ("/kvctl/caps", "/kvctl/slots", "/kvctl/cells"):
        assert call(url, "GET", path).status == 404, path
    for path in (
        "/kvctl/export",
        "/kvctl/import",
        "/kvctl/publish",
        "/kvctl/attach",
        "/kvctl/release",
        "/kvctl/erase",
    ):
        assert call(url, "POST", path, {"slot": 0}).status == 404, path
    # n_cache_reuse is refused only with --kvctl
    assert (
        call(url, "POST", "/completion", {"prompt": CANARY, "n_predict": 2, "n_cache_reuse": 8}).status == 200
    )

    messages = [{"role": "user", "content": "Write one sentence about rivers."}]
    got = ok(url, "POST", "/v1/chat/completions", chat_body(messages, 16, cache_prompt=False))
    ref = ok(stock_server.url, "POST", "/v1/chat/completions", chat_body(messages, 16, cache_prompt=False))
    content = got["choices"][0]["message"]["content"]
    assert content and content == ref["choices"][0]["message"]["content"]


# --- 7. startup refusal -----------------------------------------------------------------------


def test_startup_refusal_names_every_reason(patched_bin: Path, model_path: Path, shm_root: Path) -> None:
    argv = [
        str(patched_bin),
        "-m",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "-np",
        "4",
        "-c",
        "2048",
        "-t",
        "1",
        "--no-webui",
        "--kvctl",
        "--context-shift",
    ]
    assert not set(PROXY_SERVER_ARGS) & set(argv)
    t0 = time.monotonic()
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the server did not refuse to start:\n{exc.stdout!r}\n{exc.stderr!r}") from exc
    elapsed = time.monotonic() - t0
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-2000:]
    assert elapsed < 60
    lines = [line for line in text.splitlines() if "--kvctl cannot be enabled" in line]
    assert len(lines) == 1, text[-2000:]
    line = lines[0]
    for reason in ("--kv-unified", "--cache-ram 0", "context shift", "-sps 0"):
        assert reason in line, line
    assert "server is listening" not in text


# --- 8. requests refused while kvctl is on -----------------------------------------------------

REFUSED = {  # the request, and what the 400 names
    "completion-n_cache_reuse": (
        "/completion",
        {"prompt": CANARY, "n_predict": 2, "n_cache_reuse": 8},
        ("n_cache_reuse", "--kvctl"),
    ),
    # per-request adapters are served (patch 0023), but only ones the server loaded (it has none)
    "completion-lora-unknown": (
        "/completion",
        {"prompt": CANARY, "n_predict": 2, "lora": [{"id": 0, "scale": 1.0}]},
        ("lora", "adapter 0 does not exist"),
    ),
    "chat-n_cache_reuse": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": CANARY}], "max_tokens": 2, "n_cache_reuse": 8},
        ("n_cache_reuse", "--kvctl"),
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_cache_reuse_and_unknown_adapters_are_refused(moved: Moved, case: str) -> None:
    path, body, needles = REFUSED[case]
    assert_error(call(moved.url, "POST", path, body), 400, "invalid_request_error", *needles)
    plain = {k: v for k, v in body.items() if k not in ("n_cache_reuse", "lora")}
    assert call(moved.url, "POST", path, plain).status == 200


def test_lora_adapter_change_is_refused(moved: Moved, off_server: ServerProcess) -> None:
    assert_error(
        call(moved.url, "POST", "/lora-adapters", []), 400, "invalid_request_error", "lora", "--kvctl"
    )
    assert call(off_server.url, "POST", "/lora-adapters", []).status == 200


# --- 9. transports, owner parts, moves next to a generating slot --------------------------------


def call_raw(url: str, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, Any, bytes]:
    """POST with a raw body: (status, headers, raw body), for binary replies."""
    headers = {**auth(url), **headers}
    req = urllib.request.Request(url + path, data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=180) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def fnv1a64(tokens: list[int]) -> str:
    """The documented token hash: FNV-1a 64 over the little-endian int32 token ids."""
    h = 0xCBF29CE484222325
    for t in tokens:
        for byte in (t & 0xFFFFFFFF).to_bytes(4, "little"):
            h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def test_msgpack_and_octet_stream(moved: Moved) -> None:
    url, n = moved.url, moved.n
    a = n // 2
    reset(url)
    import_(url, moved.compat, 0, 0, n, moved.tokens, [moved.blob])
    s1, s2 = export(url, 0, a), export(url, a, n)
    as_json = {"Content-Type": "application/json"}
    as_msgpack = {"Content-Type": "application/msgpack"}

    # a msgpack request gets a msgpack reply, the payload as binary
    status, headers, data = call_raw(url, "/kvctl/export", msgpack.packb(export_body(url, 0, a)), as_msgpack)
    assert status == 200 and headers["Content-Type"].startswith("application/msgpack")
    reply = msgpack.unpackb(data, raw=False)
    assert reply["data"] == s1 and (reply["size"], reply["p0"], reply["p1"]) == (len(s1), 0, a)

    # so does a JSON request that accepts msgpack
    status, headers, data = call_raw(
        url,
        "/kvctl/export",
        json.dumps(export_body(url, a, n)).encode(),
        {**as_json, "Accept": "application/msgpack"},
    )
    assert status == 200 and msgpack.unpackb(data, raw=False)["data"] == s2

    # the raw payload, its description in a header
    status, headers, data = call_raw(
        url,
        "/kvctl/export",
        json.dumps(export_body(url, a, n)).encode(),
        {**as_json, "Accept": "application/octet-stream"},
    )
    assert status == 200 and headers["Content-Type"] == "application/octet-stream" and data == s2
    meta = json.loads(headers["X-Kvctl-Meta"])
    assert (meta["p0"], meta["p1"], meta["size"], meta["compat_id"]) == (
        a,
        n,
        len(s2),
        moved.caps["compat_id"],
    )

    # a msgpack import of two binary segments, compat given as compat_id
    erase(url, 0)
    body = {
        "slot": 0,
        "p0": 0,
        "p1": n,
        "tokens": moved.tokens,
        "compat": moved.caps["compat_id"],
        "segments": [{"data": s1}, {"data": s2}],
    }
    status, headers, data = call_raw(url, "/kvctl/import", msgpack.packb(body, use_bin_type=True), as_msgpack)
    assert status == 200 and headers["Content-Type"].startswith("application/msgpack")
    assert msgpack.unpackb(data, raw=False)["n_tokens"] == n
    assert export(url, 0, n) == moved.blob

    # [a, n) on top of a slot that holds more than [0, a): its tail is replaced
    assert import_(url, moved.compat, 0, a, n, moved.tokens, [s2])["n_cells"] == n
    assert slot_info(url, 0)["tokens"] == moved.tokens
    assert export(url, 0, n) == moved.blob

    # a msgpack error keeps llama-server's JSON error shape
    status, _, data = call_raw(
        url, "/kvctl/import", msgpack.packb({**body, "slot": 9}, use_bin_type=True), as_msgpack
    )
    assert status == 400 and json.loads(data)["error"]["code"] == 400


def test_malformed_requests(moved: Moved) -> None:
    url = moved.url
    as_json = {"Content-Type": "application/json"}
    status, _, data = call_raw(url, "/kvctl/import", b"{not json", as_json)
    assert status == 400 and "invalid request" in json.loads(data)["error"]["message"]
    assert_error(
        call(url, "POST", "/kvctl/import", [1, 2]), 400, "invalid_request_error", "must be an object"
    )
    assert call(url, "GET", "/kvctl/nothing").status == 404


def test_attach_part_then_import_on_top(moved: Moved) -> None:
    url, n = moved.url, moved.n
    a = n // 2
    reset(url)
    owner = moved.caps["owner_ids"][0]
    import_(url, moved.compat, 0, 0, n, moved.tokens, [moved.blob])
    s2 = export(url, a, n)
    publish(url, 0, owner, n)
    erase(url, 0)

    # the first m tokens of the owner
    res = attach(url, owner, 1, a)
    assert (res["id"], res["owner"], res["n_tokens"], res["n_cells"]) == (1, owner, a, a)
    info = slot_info(url, 1)
    assert info["tokens"] == moved.tokens[:a] and (info["pos_min"], info["pos_max"]) == (0, a - 1)

    # then [a, n) imported on top: the attached part stays shared with the owner
    res = import_(url, moved.compat, 1, a, n, moved.tokens, [s2])
    assert (res["n_tokens"], res["n_cells"]) == (n, n)
    assert export(url, 0, n, slot=1) == moved.blob
    c = cells(url)
    assert c["seq"] == {"1": n, str(owner): n}
    assert (c["used"], c["owner_only"]) == (n + (n - a), n - a)
    assert ok(url, "GET", "/kvctl/slots")["slots"][1]["tokens_hash"] == fnv1a64(moved.tokens)

    # the imported cells sit elsewhere than in the slot the KV came from: same tokens up to a near-tie
    out = complete(url, moved.request, slot=1)
    assert out.cache_n == n
    assert_same_or_near_tie(out, moved.ref)

    ok(url, "POST", "/kvctl/release", {"owner": owner})
    erase(url, 1)
    c = cells(url)
    assert (c["used"], c["owner"], c["logical"]) == (0, 0, 0)
    assert ok(url, "GET", "/kvctl/slots")["owners"] == []


def holding_the_moved_kv(m: Moved) -> None:
    """Slot 0 back to the moved KV, after tests that erase it."""
    if slot_info(m.url, 0)["tokens"] != m.tokens:
        reset(m.url)
        import_(m.url, m.compat, 0, 0, m.n, m.tokens, [m.blob])


def test_export_replaces_a_symlink(bad: BadCtx) -> None:
    m = bad.m
    holding_the_moved_kv(m)
    link = m.dir / "link.kv"
    target = link.resolve()
    assert link.is_symlink()
    try:
        res = ok(m.url, "POST", "/kvctl/export", {**export_body(m.url, 0, 1), "file": "link.kv"})
        assert res["file"] == "link.kv"
        assert not link.is_symlink() and link.read_bytes() == export(m.url, 0, 1)
        assert target.read_bytes() == m.blob  # not written through the link
    finally:
        link.unlink()
        link.symlink_to(target)


def test_import_next_to_a_generating_slot(bad: BadCtx) -> None:
    m = bad.m
    url = m.url
    holding_the_moved_kv(m)
    busy = 3
    erase(url, busy)
    body = json.dumps(
        {
            "prompt": PROMPT,
            "id_slot": busy,
            "cache_prompt": True,
            "temperature": 0,
            "n_predict": 2000,
            "ignore_eos": True,
            "stream": True,
        }
    )
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    try:
        assert resp.status == 200
        resp.readline()  # the first streamed chunk: the slot is generating
        # the other slots move between two decodes
        erase(url, 0)
        import_(url, m.compat, 0, 0, m.n, m.tokens, [m.blob])
        assert export(url, 0, m.n) == m.blob
        assert slot_info(url, busy)["busy"]
    finally:
        conn.close()  # the server cancels the generation
    deadline = time.monotonic() + 60
    while slot_info(url, busy)["busy"]:
        assert time.monotonic() < deadline, "the cancelled generation did not stop"
        time.sleep(0.1)
    erase(url, busy)
    # the imported cells may sit elsewhere: the slot is reused, the answer equal up to a near-tie
    out = complete(url, m.request, slot=0)
    assert out.cache_n == m.n
    assert_same_or_near_tie(out, m.ref)


# --- 10. trust boundary: moves bound to tokens, instance id, keys, browsers ---------------------


def test_moves_are_bound_to_tokens(moved: Moved) -> None:
    url, n = moved.url, moved.n
    owner = moved.caps["owner_ids"][0]
    reset(url)
    import_(url, moved.compat, 0, 0, n, moved.tokens, [moved.blob])
    other = moved.tokens[:-1] + [moved.tokens[-1] ^ 1]

    # export, publish and attach naming other tokens: 409, nothing changed
    for body in (
        {"slot": 0, "p0": 0, "p1": n, "expect_sha256": tokens_sha256(other)},
        {"slot": 0, "p0": n // 2, "p1": n, "expect_sha256": tokens_sha256(moved.tokens[1:])},
    ):
        assert_error(call(url, "POST", "/kvctl/export", body), 409, "invalid_request_error", "expect_sha256")
    assert_error(
        call(
            url,
            "POST",
            "/kvctl/publish",
            {"slot": 0, "owner": owner, "n": n, "expect_sha256": tokens_sha256(other)},
        ),
        409,
        "invalid_request_error",
        "expect_sha256",
    )
    assert ok(url, "GET", "/kvctl/slots")["owners"] == []
    publish(url, 0, owner, n)
    for body in (
        {"owner": owner, "slot": 1, "expect_sha256": tokens_sha256(other)},
        {"owner": owner, "slot": 1, "m": 4, "expect_sha256": tokens_sha256(moved.tokens[:5])},
    ):
        assert_error(call(url, "POST", "/kvctl/attach", body), 409, "invalid_request_error", "expect_sha256")
    assert slot_info(url, 1)["n_tokens"] == 0
    assert_error(
        call(
            url,
            "POST",
            "/kvctl/export",
            {"owner": owner, "p0": 0, "p1": n, "expect_sha256": tokens_sha256(other)},
        ),
        409,
        "invalid_request_error",
    )
    assert export(url, 0, n) == moved.blob
    assert export(url, 0, n, slot=None, owner=owner) == moved.blob

    # missing or malformed: 400
    for expect in (None, "", tokens_sha256(moved.tokens).upper(), 5, "0" * 63):
        body = (
            {"slot": 0, "p0": 0, "p1": n}
            if expect is None
            else {"slot": 0, "p0": 0, "p1": n, "expect_sha256": expect}
        )
        assert_error(call(url, "POST", "/kvctl/export", body), 400, "invalid_request_error", "expect_sha256")
    assert_error(
        call(url, "POST", "/kvctl/publish", {"slot": 0, "owner": owner, "n": n}),
        400,
        "invalid_request_error",
        "expect_sha256",
    )
    assert_error(
        call(url, "POST", "/kvctl/attach", {"owner": owner, "slot": 1}),
        400,
        "invalid_request_error",
        "expect_sha256",
    )
    ok(url, "POST", "/kvctl/release", {"owner": owner})
    assert export(url, 0, n) == moved.blob


def test_caps_say_where_the_kv_lives(kv_server: ServerProcess) -> None:
    """Patch 0019: caps name the buffers the KV lives in, read from them (not from -ngl): on the
    cpu build, the CPU device and backend, in host memory, the size of the whole pool; the proxy's
    parser reads it."""
    reply = caps(kv_server.url)
    buffers = reply["memory"]["buffers"]
    assert [(b["name"], b["device"], b["backend"], b["type"], b["host"]) for b in buffers] == [
        ("CPU", "CPU", "CPU", "cpu", True)
    ], buffers
    assert isinstance(buffers[0]["description"], str)
    # Every cell's K and V rows of every layer: the whole pool, in that one buffer.
    compat = reply["compat"]
    per_cell = sum(compat["k_row_bytes"]) + sum(compat["v_row_bytes"])
    assert buffers[0]["bytes"] == reply["n_cells"] * per_cell, (buffers, reply["n_cells"], per_cell)
    parsed = Caps.parse(reply)
    assert (
        parsed.kv_devices == ("CPU",) and parsed.kv_backends == ("CPU",) and parsed.kv_where_unknown() is None
    )
    # Patch 0024: nothing to pin for KV in host memory.
    assert reply["memory"]["pinned_payloads"] is False and parsed.pinned_payloads is False


def test_instance_id(start_server: ServerFactory, patched_bin: Path, moved: Moved) -> None:
    url = moved.url
    first = caps(url)["instance"]
    assert isinstance(first, str) and len(first) == 32 and int(first, 16) >= 0
    assert ok(url, "GET", "/kvctl/slots")["instance"] == first
    assert ok(url, "GET", "/kvctl/cells")["instance"] == first
    status, _, data = call_raw(
        url, "/kvctl/erase", msgpack.packb({"slot": 3}), {"Content-Type": "application/msgpack"}
    )
    assert status == 200 and msgpack.unpackb(data, raw=False)["instance"] == first
    err = call(url, "POST", "/kvctl/erase", {"slot": 99})
    assert err.status == 400 and err.body["instance"] == first
    assert caps(url)["instance"] == first

    server = keyed(start_server(patched_bin, n_parallel=1, ctx_size=1024, threads=ONE))
    before = caps(server.url)["instance"]
    assert before != first
    server.stop()
    server.start(timeout=180)
    after = caps(server.url)["instance"]
    assert len(after) == 32 and after != before
    server.stop()


def run_refused(argv: list[str], timeout: float = 90) -> str:
    """A server command line that must exit with an error: its output."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the server did not refuse to start:\n{exc.stdout!r}\n{exc.stderr!r}") from exc
    assert out.returncode != 0, (out.stdout + out.stderr)[-2000:]
    assert "server is listening" not in out.stdout + out.stderr
    return out.stdout + out.stderr


def base_argv(patched_bin: Path, model_path: Path) -> list[str]:
    return [
        str(patched_bin),
        "-m",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "-np",
        "1",
        "-c",
        "1024",
        "-t",
        "1",
        "--no-webui",
        *PROXY_SERVER_ARGS,
        "--kvctl",
    ]


def test_keys(start_server: ServerFactory, patched_bin: Path, model_path: Path, tmp_path: Path) -> None:
    # no key: refused, saying so
    text = run_refused(base_argv(patched_bin, model_path))
    assert "requires a key" in text and "--kvctl-insecure" in text
    # an empty or unreadable key file: refused at once
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    assert "empty key" in run_refused([*base_argv(patched_bin, model_path), "--kvctl-key-file", str(empty)])
    assert "--kvctl-key-file" in run_refused(
        [*base_argv(patched_bin, model_path), "--kvctl-key-file", str(tmp_path / "missing")]
    )
    # --kvctl-insecure: starts, /kvctl answers without a key
    open_server = start_server(
        patched_bin, kvctl_key=None, insecure=True, n_parallel=1, ctx_size=1024, threads=ONE
    )
    assert "--kvctl-insecure" in open_server.spec.argv()
    assert call(open_server.url, "GET", "/kvctl/caps", headers={}).status == 200
    open_server.stop()
    # the key travels in a file (ServerSpec), not on the command line; trailing whitespace is stripped
    server = start_server(patched_bin, kvctl_key="file-key", n_parallel=1, ctx_size=1024, threads=ONE)
    assert "file-key" not in " ".join(server.spec.argv()) and "--kvctl-key-file" in server.spec.argv()
    assert call(server.url, "GET", "/kvctl/caps", headers={}).status == 401
    assert call(server.url, "GET", "/kvctl/caps", headers={"Authorization": "Bearer file-key"}).status == 200
    server.stop()


def test_no_browser_access(moved: Moved) -> None:
    url = moved.url
    for method, path, body in (
        ("GET", "/kvctl/caps", None),
        ("POST", "/kvctl/erase", {"slot": 3}),
        ("OPTIONS", "/kvctl/erase", None),
        ("GET", "/kvctl/nothing", None),
    ):
        reply = call(url, method, path, body, headers={**auth(url), "Origin": "http://localhost:3000"})
        assert_error(reply, 403, "permission_error", "browser")
        assert not [h for h in reply.headers if h.lower().startswith("access-control-")], reply.headers
    req = urllib.request.Request(url + "/kvctl/caps", headers=auth(url))
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        assert not [h for h in resp.headers if h.lower().startswith("access-control-")]
    # the rest of the server keeps upstream's CORS
    with urllib.request.urlopen(
        urllib.request.Request(url + "/health", headers={"Origin": "http://x"})
    ) as resp:
        assert resp.headers.get("Access-Control-Allow-Origin")


# --- 11. bad input refused before it costs anything ---------------------------------------------


def _nan_blob(m: Moved, at: int = 0, value: int = 0x7E00) -> bytes:
    """The moved payload with one f16 value set to ``value`` (NaN by default): the ``at``-th
    element of K of layer 0, or with a negative ``at`` the element that far from the end of
    the payload (V of the last layer). The check reads several elements per word: each lane
    of a word counts."""
    assert m.compat["k_types"][0] == 1 and m.compat["v_types"][-1] == 1  # f16
    off = 16 + m.n * m.compat["cell_meta_bytes"] + 8 + 12 + 2 * at if at >= 0 else len(m.blob) + 2 * at
    blob = bytearray(m.blob)
    blob[off : off + 2] = struct.pack("<H", value)
    return bytes(blob)


HARD_CASES: dict[str, Callable[[BadCtx], tuple[bytes, dict[str, str], str]]] = {
    "msgpack-nested-1mb": lambda b: (b"\x91" * (1 << 20), {"Content-Type": "application/msgpack"}, "nested"),
    "msgpack-nested-map": lambda b: (
        b"\x81\xa1a" * 4096 + b"\xc0",
        {"Content-Type": "application/msgpack"},
        "nested",
    ),
    "json-nested-tokens": lambda b: (
        json.dumps({**b.imp(), "tokens": None}).replace("null", "[" * 200000 + "]" * 200000).encode(),
        {"Content-Type": "application/json"},
        "nested",
    ),
    "msgpack-count-beyond-body": lambda b: (
        b"\xdd\xff\xff\xff\xff\x01",
        {"Content-Type": "application/msgpack"},
        "claims more",
    ),
    "range-beyond-n_ctx_slot": lambda b: (
        json.dumps(b.imp(p1=10**9, segments=[{"file": "whole.kv", "size": 10**12}])).encode(),
        {"Content-Type": "application/json"},
        "invalid range",
    ),
    "too-many-segments": lambda b: (
        json.dumps(b.imp(p1=2, tokens=b.m.tokens[:2], segments=[{"data": "AAAA"}] * 3)).encode(),
        {"Content-Type": "application/json"},
        "3 segments",
    ),
    "too-many-bytes": lambda b: (
        json.dumps(
            b.imp(
                p1=2,
                tokens=b.m.tokens[:2],
                segments=[{"file": "whole.kv", "size": b.m.header_bytes + 2 * b.m.cell_bytes}] * 2,
            )
        ).encode(),
        {"Content-Type": "application/json"},
        "exceed",
    ),
    "inline-beyond-64mib": lambda b: (
        msgpack.packb(
            {**b.imp(p1=4000, tokens=[1] * 4000), "segments": [{"data": bytes(65 << 20)}]}, use_bin_type=True
        ),
        {"Content-Type": "application/msgpack"},
        "inline limit",
    ),
    "nan-in-f16-kv": lambda b: (
        json.dumps(b.imp(slot=2, segments=[{"data": b64(_nan_blob(b.m))}])).encode(),
        {"Content-Type": "application/json"},
        "NaN",
    ),
    "inf-in-third-lane-of-k": lambda b: (
        json.dumps(b.imp(slot=2, segments=[{"data": b64(_nan_blob(b.m, 2, 0x7C00))}])).encode(),
        {"Content-Type": "application/json"},
        "K of layer 0 holds NaN or Inf",
    ),
    "neg-inf-in-last-v-element": lambda b: (
        json.dumps(b.imp(slot=2, segments=[{"data": b64(_nan_blob(b.m, -1, 0xFC00))}])).encode(),
        {"Content-Type": "application/json"},
        f"V of layer {b.m.compat['n_layer'] - 1} holds NaN or Inf",
    ),
}


@pytest.mark.parametrize("case", list(HARD_CASES))
def test_hostile_input_is_refused(bad: BadCtx, case: str) -> None:
    m = bad.m
    holding_the_moved_kv(m)
    erase(m.url, 2)
    data, headers, needle = HARD_CASES[case](bad)
    status, _, raw = call_raw(m.url, "/kvctl/import", data, headers)
    assert 400 <= status < 500, (status, raw[:300])
    err = json.loads(raw)["error"]
    assert err["code"] == status and needle.lower() in err["message"].lower(), err
    assert slot_info(m.url, 2)["n_tokens"] == 0
    assert export(m.url, 0, m.n) == m.blob
    assert_same_or_near_tie(complete(m.url, CANARY, slot=1, cache=False), bad.canary)


def test_kvctl_dir_must_be_private(patched_bin: Path, model_path: Path, shm_root: Path) -> None:
    loose = shm_root / f"loose-{free_port()}"
    loose.mkdir()
    loose.chmod(0o777)
    text = run_refused([*base_argv(patched_bin, model_path), "--kvctl-insecure", "--kvctl-dir", str(loose)])
    assert "writable by group or others" in text
    owners = run_refused([*base_argv(patched_bin, model_path), "--kvctl-insecure", "--kvctl-owners", "65"])
    assert "--kvctl-owners must be in [0, 64]" in owners


# --- 12. fuzz: random bodies on every route -----------------------------------------------------

FUZZ_SECONDS = 30.0
FIELDS = [
    "slot",
    "owner",
    "p0",
    "p1",
    "n",
    "m",
    "tokens",
    "compat",
    "segments",
    "file",
    "offset",
    "size",
    "data",
    "expect_sha256",
    "fault",
    "tokens_hash",
]
ROUTES = [
    ("GET", "caps"),
    ("GET", "slots"),
    ("GET", "cells"),
    ("POST", "export"),
    ("POST", "import"),
    ("POST", "publish"),
    ("POST", "attach"),
    ("POST", "release"),
    ("POST", "erase"),
]


@pytest.fixture(scope="module")
def fuzz_server(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    return keyed(start_server(patched_bin, n_parallel=2, ctx_size=1024, threads=ONE))


def test_fuzz_routes(fuzz_server: ServerProcess) -> None:
    from hypothesis import HealthCheck, given, seed, settings
    from hypothesis import strategies as st

    url = fuzz_server.url
    ref = complete(url, CANARY, slot=0, cache=False)
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**40), 2**40),
        st.integers(-3, 70),
        st.floats(allow_nan=False),
        st.text(max_size=20),
        st.binary(max_size=64),
        st.sampled_from(["whole.kv", "../x", "0" * 64, "after_first_segment"]),
    )
    values = st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4)
        ),
        max_leaves=12,
    )
    bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)
    deadline = time.monotonic() + FUZZ_SECONDS
    seen: dict[int, int] = {}

    @seed(20261129)
    @settings(
        max_examples=2000,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(route=st.sampled_from(ROUTES), body=bodies, as_msgpack=st.booleans())
    def post_random(route: tuple[str, str], body: dict[str, Any], as_msgpack: bool) -> None:
        if time.monotonic() > deadline:
            return
        method, op = route
        if as_msgpack:
            data, ctype = msgpack.packb(body, use_bin_type=True), "application/msgpack"
        else:
            data, ctype = (
                json.dumps(body, default=lambda b: base64.b64encode(b).decode()).encode(),
                "application/json",
            )
        req = urllib.request.Request(
            f"{url}/kvctl/{op}",
            data=data if method == "POST" else None,
            method=method,
            headers={**auth(url), "Content-Type": ctype},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status = resp.status
        except urllib.error.HTTPError as err:
            status = err.code
        seen[status] = seen.get(status, 0) + 1
        # 503 (no free cells) is documented; no body here can make a valid payload, so no 500
        assert status < 500 or status == 503, (op, status, body)

    post_random()
    assert sum(seen.values()) > 50, seen
    assert_same_or_near_tie(complete(url, CANARY, slot=0, cache=False), ref)
    assert caps(url)["n_parallel"] == 2
