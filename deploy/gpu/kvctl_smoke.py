"""A patched llama-server's KV moves where its KV lives, with Python's standard library only
(for a GPU machine that has no project environment):
`python3 kvctl_smoke.py URL OUT.json [DEVICE [RATE_TOKENS]]`.

Where its KV lives is read from caps (`memory.buffers`, patch 0019); with DEVICE (e.g. CUDA0,
or CPU for a server with --no-kv-offload) every buffer must be on it. With RATE_TOKENS a
prompt that long is computed and its KV exported and imported three times: the server's own
copy times (`t_ms`) give its device-to-host (export) and host-to-device (import) rates.

With moves on: a prompt computed on slot 0, its KV exported, imported into slot 1 and exported
again (the two payloads must be byte-identical), and the continuation from the moved KV
compared with the continuation from the KV in place (same last-token recompute). With
whole-state checkpoints on (recurrent and hybrid models): the newest checkpoint of slot 0
restored into slot 1, and its continuation compared with a computation from scratch.
Writes what it measured to OUT.json and exits 1 when a check fails.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import struct
import sys
import time
import urllib.error
import urllib.request
from typing import Any


def call(url: str, body: Any = None, accept: str = "") -> tuple[int, Any, dict[str, str]]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Accept": accept} if accept else {})}
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            raw, status, hdrs = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, hdrs = e.read(), e.code, dict(e.headers)
    if hdrs.get("Content-Type", "").startswith("application/octet-stream"):
        return status, raw, hdrs
    return status, json.loads(raw or b"{}"), hdrs


def sha(tokens: list[int]) -> str:
    return hashlib.sha256(b"".join(struct.pack("<i", t) for t in tokens)).hexdigest()


def complete(
    base: str, prompt: list[int], slot: int, cache: bool = True, n: int = 8
) -> list[tuple[int, float]]:
    body = {
        "prompt": prompt,
        "n_predict": n,
        "id_slot": slot,
        "cache_prompt": cache,
        "temperature": 0,
        "n_probs": 2,
    }
    status, reply, _ = call(f"{base}/completion", body)
    assert status == 200, reply
    return [(p["id"], p["logprob"]) for p in reply["completion_probabilities"]]


def parts(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> dict[str, Any]:
    same = [x[0] for x in a] == [y[0] for y in b]
    return {
        "same_tokens": same,
        "max_logprob_diff": max(abs(x[1] - y[1]) for x, y in zip(a, b, strict=False)),
    }


def moves(base: str, caps: dict[str, Any], rnd: random.Random) -> dict[str, Any]:
    prompt = [rnd.randrange(10, 1000) for _ in range(400)]
    complete(base, prompt, 0)
    in_place = complete(base, prompt, 0)  # the last prompt token recomputed on the KV in place
    tokens = call(f"{base}/kvctl/slots?tokens=1")[1]["slots"][0]["tokens"]
    exp = {"slot": 0, "p0": 0, "p1": len(tokens), "expect_sha256": sha(tokens)}
    t0 = time.perf_counter()
    status, payload, hdrs = call(f"{base}/kvctl/export", exp, accept="application/octet-stream")
    export_s = time.perf_counter() - t0
    assert status == 200 and isinstance(payload, bytes), payload
    meta = json.loads(hdrs["X-Kvctl-Meta"])
    imp = import_body(caps, tokens, payload)
    t0 = time.perf_counter()
    status, reply, _ = call(f"{base}/kvctl/import", imp)
    import_s = time.perf_counter() - t0
    assert status == 200, reply
    again = call(f"{base}/kvctl/export", {**exp, "slot": 1}, accept="application/octet-stream")[1]
    call(f"{base}/kvctl/erase", {"slot": 0})
    moved = complete(base, prompt, 1)
    return {
        "bytes": len(payload),
        "byte_identical_after_import": again == payload,
        "export_t_ms": meta.get("t_ms"),
        "import_t_ms": reply.get("t_ms"),
        "export_http_s": export_s,
        "import_http_s": import_s,
        "moved_vs_in_place": parts(moved, in_place),
    }


def import_body(caps: dict[str, Any], tokens: list[int], payload: bytes) -> dict[str, Any]:
    """/kvctl/import of an exported octet-stream ``payload`` of ``tokens`` into slot 1, inline."""
    return {
        "slot": 1,
        "p0": 0,
        "p1": len(tokens),
        "tokens": tokens,
        "compat": caps["compat_id"],
        "segments": [{"data": base64.b64encode(payload).decode()}],
    }


def rates(base: str, caps: dict[str, Any], rnd: random.Random, n: int) -> dict[str, Any]:
    """The server's copy rates, from its ``t_ms``: the median of three exports and imports of
    ``n`` tokens' KV (slot 0 to the host, the host to slot 1)."""
    prompt = [rnd.randrange(10, 1000) for _ in range(n)]
    complete(base, prompt, 0, n=1)
    tokens = call(f"{base}/kvctl/slots?tokens=1")[1]["slots"][0]["tokens"]
    exp = {"slot": 0, "p0": 0, "p1": len(tokens), "expect_sha256": sha(tokens)}
    out_ms, in_ms, payload = [], [], b""
    for _ in range(3):
        status, payload, hdrs = call(f"{base}/kvctl/export", exp, accept="application/octet-stream")
        assert status == 200 and isinstance(payload, bytes), payload
        out_ms.append(float(json.loads(hdrs["X-Kvctl-Meta"])["t_ms"]))
    imp = import_body(caps, tokens, payload)
    for _ in range(3):
        call(f"{base}/kvctl/erase", {"slot": 1})
        status, reply, _ = call(f"{base}/kvctl/import", imp)
        assert status == 200, reply
        in_ms.append(float(reply["t_ms"]))
    call(f"{base}/kvctl/erase", {"slot": 0})
    call(f"{base}/kvctl/erase", {"slot": 1})
    export_ms, import_ms = sorted(out_ms)[1], sorted(in_ms)[1]
    return {
        "tokens": len(tokens),
        "bytes": len(payload),
        "export_t_ms": out_ms,
        "import_t_ms": in_ms,
        "device_to_host_mb_s": len(payload) / export_ms / 1e3 if export_ms > 0 else None,
        "host_to_device_mb_s": len(payload) / import_ms / 1e3 if import_ms > 0 else None,
    }


def checkpoints(base: str, rnd: random.Random) -> dict[str, Any]:
    prompt = [rnd.randrange(10, 1000) for _ in range(400)]
    complete(base, prompt, 0, n=1)
    slot0 = call(f"{base}/kvctl/slots?tokens=1")[1]["slots"][0]
    n = max(slot0["checkpoints"])
    tokens = slot0["tokens"][:n]
    status, cp, _ = call(f"{base}/kvctl/checkpoint", {"slot": 0, "n": n, "expect_sha256": sha(tokens)})
    assert status == 200, cp
    status, reply, _ = call(
        f"{base}/kvctl/restore", {"slot": 1, "tokens": tokens, "segments": [{"data": cp["data"]}]}
    )
    assert status == 200, reply
    follow = tokens + [rnd.randrange(10, 1000) for _ in range(10)]
    restored, scratch = complete(base, follow, 1), complete(base, follow, 0, cache=False)
    return {"n": n, "bytes": cp["size"], "restored_vs_scratch": parts(restored, scratch)}


def main() -> int:
    base, out = sys.argv[1].rstrip("/"), sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 else ""
    rate_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    for _ in range(240):
        try:
            if call(f"{base}/health")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.5)
    caps = call(f"{base}/kvctl/caps")[1]
    result: dict[str, Any] = {
        "moves": caps["moves"],
        "memory": caps["memory"],
        "checkpoints": caps.get("checkpoints"),
    }
    rnd = random.Random(7)
    buffers = caps["memory"].get("buffers")
    result["kv_devices"] = sorted({b["device"] for b in buffers or []})
    ok = bool(buffers) and (not device or result["kv_devices"] == [device])
    if caps["moves"]:
        result["round_trip"] = moves(base, caps, rnd)
        ok = (
            ok
            and result["round_trip"]["byte_identical_after_import"]
            and result["round_trip"]["moved_vs_in_place"]["same_tokens"]
        )
        if rate_tokens:
            result["rates"] = rates(base, caps, rnd, rate_tokens)
    if (caps.get("checkpoints") or {}).get("on"):
        result["checkpoint"] = checkpoints(base, rnd)
        ok = ok and result["checkpoint"]["restored_vs_scratch"]["same_tokens"]
    result["ok"] = ok
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
