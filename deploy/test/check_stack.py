"""Checks a running compose stack from the host (deploy/test/run.sh): chat through the proxy
with cache reuse, a host-tree restore on the second server of KV the first exported (through
the shared payload volume), Prometheus scraping the proxy, and every query of the Grafana
dashboard returning series from that Prometheus.

Standard library only, so any python3 runs it. Exits non-zero with the reason on a failure.
With --summary it writes what it saw (routes, servers, token counts, query counts) as JSON.

    check_stack.py --proxy http://127.0.0.1:P --prometheus http://127.0.0.1:Q \
        --dashboard deploy/grafana/llama-radix-proxy.json --servers 2 --summary out.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

WORDS = [
    "cache",
    "prefix",
    "token",
    "slot",
    "server",
    "proxy",
    "tree",
    "memory",
    "restore",
    "save",
    "budget",
    "layer",
    "vector",
    "answer",
    "question",
    "report",
    "window",
    "batch",
    "queue",
    "route",
    "metric",
    "shard",
    "model",
    "prompt",
    "reuse",
]


def say(msg: str) -> None:
    print(f"[deploy-test] {msg}", file=sys.stderr, flush=True)


def fail(msg: str) -> None:
    say(f"FAIL: {msg}")
    sys.exit(1)


SUMMARY: dict[str, Any] = {"requests": []}


def http(
    url: str, body: dict[str, Any] | None = None, timeout: float = 300, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status, headers = resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        raw, status, headers = exc.read(), exc.code, dict(exc.headers)
    try:
        return status, headers, json.loads(raw)
    except ValueError:
        return status, headers, raw.decode(errors="replace")


def document(seed: int, n_words: int = 160) -> str:
    rng = random.Random(seed)
    sentences: list[str] = []
    while sum(len(s.split()) for s in sentences) < n_words:
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ".")
    return " ".join(sentences)


def chat_body(doc: str, question: str, max_tokens: int) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": f"You are a careful analyst. Reference document:\n{doc}"},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def note(what: str, headers: dict[str, str]) -> dict[str, str]:
    """Logs the X-Radix-* headers of an answer and keeps them for the summary."""
    entry = {
        "what": what,
        "route": headers.get("X-Radix-Route"),
        "server": headers.get("X-Radix-Server"),
        "slot": headers.get("X-Radix-Slot"),
        "prompt_tokens": int(headers.get("X-Radix-Prompt-Tokens", -1)),
        "cached_tokens": int(headers.get("X-Radix-Cached-Tokens", -1)),
    }
    SUMMARY["requests"].append(entry)
    say(
        f"{what}: route={entry['route']} server={entry['server']} slot={entry['slot']} "
        f"prompt={entry['prompt_tokens']} cached={entry['cached_tokens']}"
    )
    return headers


def chat(
    proxy: str, doc: str, question: str, max_tokens: int = 8, session: str | None = None, what: str = "chat"
) -> dict[str, str]:
    extra = {"X-Session-Id": session} if session else None
    status, headers, reply = http(
        f"{proxy}/v1/chat/completions", chat_body(doc, question, max_tokens), headers=extra
    )
    if status != 200:
        fail(f"chat through the proxy: HTTP {status}: {reply}")
    if not reply.get("choices"):
        fail(f"chat reply without choices: {reply}")
    return note(what, headers)


class Blocker:
    """A streamed answer that keeps one slot of a server computing while it is open (the
    routing cost model prices a server's busy slots): opened, its headers read (the proxy has
    leased the slot), then read to its end with finish()."""

    def __init__(self, proxy: str, session: str, max_tokens: int) -> None:
        body = {**chat_body(document(99), "Write a long report about the document.", max_tokens)}
        body.update(stream=True, ignore_eos=True)
        req = urllib.request.Request(
            f"{proxy}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Session-Id": session},
        )
        try:
            self.resp = urllib.request.urlopen(req, timeout=300)
        except urllib.error.HTTPError as exc:
            fail(f"streamed chat through the proxy: HTTP {exc.code}: {exc.read()[:300]!r}")
        # The first event: the server is generating (past its prefill) from here on.
        self.resp.readline()
        self.headers = note("blocker (streamed)", dict(self.resp.headers))

    def finish(self) -> None:
        events = sum(1 for line in self.resp if line.startswith(b"data: "))
        self.resp.close()
        say(f"blocker: stream read to its end ({events} more events)")


def check_traffic(proxy: str, n_servers: int, n_slots_total: int) -> None:
    doc = document(1)
    session = "deploy-test-doc"
    first = chat(proxy, doc, "Summarize the document in one line.", session=session, what="fresh prompt")
    if first.get("X-Radix-Route") != "prefill":
        fail(f"a fresh prompt should be a full prefill, got route {first.get('X-Radix-Route')}")
    exporter = first["X-Radix-Server"]
    again = chat(proxy, doc, "Which word appears most often?", session=session, what="same prefix")
    # Idle release (the default) erases the slot once the host tree holds its KV: H, else A.
    if again.get("X-Radix-Route") not in ("A", "A+H", "H", "S", "S+H"):
        fail(f"the shared prefix was not reused: route {again.get('X-Radix-Route')}")
    if int(again["X-Radix-Cached-Tokens"]) < 100:
        fail(f"too few cached tokens on reuse: {again['X-Radix-Cached-Tokens']}")
    # More long prompts than there are slots: whatever a slot still held of the first document
    # is overwritten, so its return is a host-tree restore.
    for seed in range(10, 10 + n_slots_total + 1):
        chat(proxy, document(seed), "List three words.", max_tokens=2, what=f"filler {seed}")
    if n_servers < 2:
        back = chat(proxy, doc, "Which sentence is the longest?", what="returning prompt")
    else:
        # The returning prompt on another server than the one whose KV the tree holds: keep a
        # slot of that server computing (a streamed answer of the same session: equal costs
        # go to the session's last server), so the cost model prices it higher and the
        # restore lands elsewhere. Its KV then travels from the first server's export, through
        # the host tree, into the other server as a payload file on the shared volume.
        blocker = Blocker(proxy, session, max_tokens=160)
        if blocker.headers.get("X-Radix-Server") != exporter:
            blocker.finish()
            fail(
                f"the streamed request of the document's session went to {blocker.headers.get('X-Radix-Server')}, "
                f"not to {exporter}, the server it last used (routing ties go to the session's server)"
            )
        back = chat(proxy, doc, "Which sentence is the longest?", what="returning prompt, other server")
        blocker.finish()
        if back.get("X-Radix-Server") == exporter:
            fail(
                f"with {exporter} busy the returning prompt should be restored on another server, "
                f"it went to {exporter} again (route {back.get('X-Radix-Route')})"
            )
        SUMMARY["cross_server"] = {"exporter": exporter, "restorer": back.get("X-Radix-Server")}
    if back.get("X-Radix-Route") not in ("H", "A+H", "S+H"):
        fail(
            f"a returning prompt should be restored from the host tree, got route {back.get('X-Radix-Route')}"
        )
    if int(back["X-Radix-Cached-Tokens"]) < 100:
        fail(f"too few tokens restored: {back['X-Radix-Cached-Tokens']}")
    seen = sorted({str(r["server"]) for r in SUMMARY["requests"]})
    if len(seen) < n_servers:
        fail(f"every request landed on {seen}: {n_servers} servers expected to serve")
    # A bad request: a clear 4xx in llama-server's error shape.
    status, _, reply = http(f"{proxy}/v1/chat/completions", {"messages": "not a list"})
    if not (400 <= status < 500 and isinstance(reply, dict) and "error" in reply):
        fail(f"a malformed request should get a 4xx error object, got {status}: {reply}")
    say(f"bad request: HTTP {status} {reply['error'].get('type')}")
    SUMMARY["bad_request_status"] = status
    SUMMARY["servers_seen"] = seen


def metric_sum(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name:
                total += float(value)
    return total


def prom_query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    status, _, reply = http(url, timeout=30)
    if status != 200 or not isinstance(reply, dict) or reply.get("status") != "success":
        fail(f"Prometheus rejected {expr!r}: HTTP {status}: {reply}")
    return list(reply["data"]["result"])


def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    dash = json.loads(path.read_text())

    def panels(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for item in items:
            out.append(item)
            out += panels(item.get("panels", []))
        return out

    found = [
        (panel.get("title", "?"), target["expr"])
        for panel in panels(dash.get("panels", []))
        for target in panel.get("targets", [])
        if target.get("expr")
    ]
    return found


def grafana_expr(expr: str) -> str:
    """What Grafana sends for a query: its variables replaced as on the dashboard's defaults
    (time range 5 min, the 5 s scrape interval, every server)."""
    subs = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m", "$server": ".*"}
    for var, value in subs.items():
        expr = expr.replace(var, value)
    leftover = re.findall(r"\$\{?\w+", expr)
    if leftover:
        fail(f"unknown dashboard variable {leftover} in {expr!r}")
    return expr


def check_prometheus(prometheus: str, proxy: str, dashboard: Path, n_servers: int, deadline_s: float) -> None:
    # The scrape target is up, and has been scraped since the traffic above.
    status, _, text = http(f"{proxy}/metrics", timeout=30)
    if status != 200:
        fail(f"proxy /metrics: HTTP {status}")
    cached_now = metric_sum(str(text), "radix_cached_tokens_total")
    if cached_now <= 0:
        fail("the proxy's radix_cached_tokens_total is 0 after the traffic")
    queries = [(title, grafana_expr(expr)) for title, expr in dashboard_queries(dashboard)]
    if not queries:
        fail(f"no queries found in {dashboard}")
    end = time.monotonic() + deadline_s
    while True:
        targets = http(f"{prometheus}/api/v1/targets", timeout=30)[2]["data"]["activeTargets"]
        up = [t for t in targets if t["health"] == "up" and t["labels"].get("job") == "llama-radix-proxy"]
        scraped = prom_query(prometheus, "sum(radix_cached_tokens_total)")
        scraped_value = float(scraped[0]["value"][1]) if scraped else 0.0
        empty = [(title, expr) for title, expr in queries if not prom_query(prometheus, expr)]
        if up and scraped_value >= cached_now and not empty:
            break
        if time.monotonic() > end:
            detail = "; ".join(f"{title}: {expr}" for title, expr in empty[:5])
            fail(
                f"after {deadline_s:g} s: proxy target up={bool(up)}, scraped cached tokens "
                f"{scraped_value:g} of {cached_now:g}, {len(empty)} dashboard queries without series ({detail})"
            )
        time.sleep(2)
    say(f"Prometheus scrapes the proxy ({up[0]['scrapeUrl']}); cached tokens scraped: {scraped_value:g}")
    for title, expr in queries:
        result = prom_query(prometheus, expr)
        say(f"  {len(result):2d} series  {title}: {expr}")
    # The dashboard's template variable: the servers' label values.
    status, _, reply = http(
        f"{prometheus}/api/v1/label/server/values?"
        + urllib.parse.urlencode({"match[]": "radix_requests_total"})
    )
    servers = reply.get("data", []) if isinstance(reply, dict) else []
    if len(servers) != n_servers:
        fail(f"dashboard variable `server` has values {servers}, expected {n_servers} servers")
    up_servers = prom_query(prometheus, "radix_backend_up == 1")
    if len(up_servers) != n_servers:
        fail(f"radix_backend_up == 1 for {len(up_servers)} servers, expected {n_servers}")
    tokenizer = prom_query(prometheus, "radix_tokenizer_server_fallback")
    if not tokenizer or float(tokenizer[0]["value"][1]) != 0:
        fail(
            "the proxy fell back to the server's /tokenize: it does not see the model file at the server's path"
        )
    moved = prom_query(prometheus, 'sum(radix_kv_move_bytes_total{direction="import"})')
    if not moved or float(moved[0]["value"][1]) <= 0:
        fail("no KV was imported into a slot (host restore) according to Prometheus")
    say(
        f"all {len(queries)} dashboard queries return series; servers {servers}; "
        f"KV imported {float(moved[0]['value'][1]) / 1e6:.1f} MB; local tokenizer in use"
    )
    SUMMARY["prometheus"] = {
        "cached_tokens_scraped": scraped_value,
        "dashboard_queries": len(queries),
        "dashboard_queries_with_series": len(queries),
        "servers": servers,
        "kv_imported_mb": round(float(moved[0]["value"][1]) / 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--proxy", required=True)
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--dashboard", type=Path, required=True)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--slots", type=int, default=4, help="slots per server")
    parser.add_argument("--deadline", type=float, default=120.0)
    parser.add_argument(
        "--summary", type=Path, help="write what was seen here (JSON), once every check passed"
    )
    args = parser.parse_args()
    check_traffic(args.proxy, args.servers, args.servers * args.slots)
    check_prometheus(args.prometheus, args.proxy, args.dashboard, args.servers, args.deadline)
    if args.summary:
        args.summary.write_text(json.dumps(SUMMARY, indent=2) + "\n")
    say("stack checks passed")


if __name__ == "__main__":
    main()
