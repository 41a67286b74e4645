"""Observability end to end: exact metrics, response headers, the admin API, radixctl, the dashboard.

One patched server of its own with two slots and a proxy in front. A scripted sequence of
five raw-text completions (no chat template, so prompts share no token and each route is
exact) runs once per module:

  r1 P1  prefill (slot 0)          r4 P3  prefill (slot 0, the least recently used)
  r2 P1  A       (slot 0)          r5 P1  H       (slot 1: neither slot holds P1 any more)
  r3 P2  prefill (slot 1)

``max_tokens: 1`` keeps each slot at exactly its prompt (the sampled token is never
decoded), so saves, bytes and cells are exact too. /metrics is captured right after.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from proxy.cli import inspect as cli_admin
from proxy.cli.main import main as radixctl
from proxy.config import Config
from proxy.core.payload import blob_size
from proxy.native.launch import ServerProcess, free_port
from proxy.server.metrics import FALLBACK_CAUSES, ROUTES
from proxy.server.ops.observe import cache_summary, refresh_metrics
from tests.helpers import ProxyThread, Reply, ServerFactory, get, post, request

ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "observe-me"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
WORDS = [
    "river",
    "signal",
    "ledger",
    "turbine",
    "harbor",
    "sensor",
    "margin",
    "valve",
    "audit",
    "copper",
    "beacon",
    "orchard",
    "glacier",
    "compass",
    "battery",
    "lantern",
    "meadow",
    "quartz",
]
TIMINGS_KEYS = {
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
}


def text(first: str, seed: int, n_words: int = 110) -> str:
    rng = random.Random(seed)
    return first + " " + " ".join(rng.choice(WORDS) for _ in range(n_words)) + "."


P1, P2, P3 = text("Alpha", 1), text("Bravo", 2), text("Charlie", 3)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(body: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@dataclass
class Live:
    proxy: ProxyThread
    backend: ServerProcess
    replies: list[Reply]
    metrics: Samples  # /metrics right after the scripted sequence
    caps: dict[str, Any]


@pytest.fixture(scope="module")
def backend(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    # Its own server: the proxy must be the only client of the slots it steers.
    return start_server(patched_bin, n_parallel=2)


@pytest.fixture(scope="module")
def live(backend: ServerProcess) -> Iterator[Live]:
    assert backend.spec.kvctl_dir is not None
    config = Config(
        backends=(backend.url,),
        port=free_port(),
        shm_dir=backend.spec.kvctl_dir,
        kvctl_key=backend.spec.kvctl_key,
        admin_show_text=True,
        min_restore_tokens=32,
        cache_ram_mib=256,
        admin_key=ADMIN_KEY,
        # The scripted sequence's routes are those of slots that keep their KV (route A);
        # releasing them (the default) is observed in test_idle_release.py.
        idle_release=False,
    )
    thread = ProxyThread(config).start()
    try:
        replies = [complete(thread, p) for p in (P1, P1, P2, P3, P1)]
        assert thread.runtime is not None
        thread.run(refresh_metrics(thread.runtime))  # also done by /metrics once app.py calls it
        metrics = parse_metrics(scrape(thread.url).body)
        caps = request(
            f"{backend.url}/kvctl/caps", headers={"Authorization": f"Bearer {backend.spec.kvctl_key}"}
        ).body
        yield Live(thread, backend, replies, metrics, caps)
    finally:
        thread.stop()


def complete(proxy: ProxyThread, prompt: str, n: int = 1) -> Reply:
    reply = post(f"{proxy.url}/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0})
    assert reply.status == 200, reply.body
    proxy.settle()
    return reply


def run_cli(*args: str) -> Any:
    result = CliRunner().invoke(radixctl, list(args), catch_exceptions=False)
    return result


# ---- 2. every response says what happened ------------------------------------------------------


def test_headers_say_what_happened(live: Live) -> None:
    routes = [r.headers["X-Radix-Route"] for r in live.replies]
    assert routes == ["prefill", "A", "prefill", "prefill", "H"]
    assert [r.headers["X-Radix-Slot"] for r in live.replies] == ["0", "0", "1", "0", "1"]
    n1 = int(live.replies[0].headers["X-Radix-Prompt-Tokens"])
    assert [int(r.headers["X-Radix-Predicted-Cached-Tokens"]) for r in live.replies] == [
        0,
        n1 - 1,
        0,
        0,
        n1 - 1,
    ]
    for reply in live.replies:
        timings = reply.body["timings"]
        # llama-server's timings, untouched: its own keys, and the same numbers it reports elsewhere.
        assert set(timings) == TIMINGS_KEYS
        assert reply.body["usage"]["prompt_tokens_details"]["cached_tokens"] == timings["cache_n"]
        assert reply.headers["X-Radix-Server"] == "s0"
        assert int(reply.headers["X-Radix-Cached-Tokens"]) == timings["cache_n"]
        assert int(reply.headers["X-Radix-Prompt-Tokens"]) == timings["cache_n"] + timings["prompt_n"]
        assert reply.headers["X-Request-Id"].startswith("r")
    # Delivered equals predicted on both cached routes.
    assert live.replies[1].body["timings"]["cache_n"] == n1 - 1
    assert live.replies[4].body["timings"]["cache_n"] == n1 - 1


# ---- 1. exact metrics ------------------------------------------------------------------------------


def test_exact_metrics_after_scripted_sequence(live: Live) -> None:
    m = live.metrics
    n = [int(r.headers["X-Radix-Prompt-Tokens"]) for r in live.replies]
    n1, n2, n3 = n[0], n[2], n[3]
    timings = [r.body["timings"] for r in live.replies]
    expected = {"prefill": 3, "A": 1, "H": 1}
    for route in ROUTES:
        want = expected.get(route, 0)  # every route's series exists from the start
        assert sample(m, "radix_requests_total", route=route, server="s0") == want, route
        assert sample(m, "radix_ttft_seconds_count", route=route, server="s0") == want, route
        assert sample(m, "radix_request_seconds_count", route=route, server="s0") == want, route
    assert sample(m, "radix_queue_wait_seconds_count", server="s0") == 5
    assert (
        sample(m, "radix_prompt_tokens_total") == sum(n) == sum(t["cache_n"] + t["prompt_n"] for t in timings)
    )
    assert sample(m, "radix_cached_tokens_total") == sum(t["cache_n"] for t in timings) == 2 * (n1 - 1)
    assert sample(m, "radix_prefilled_tokens_total") == sum(t["prompt_n"] for t in timings)
    assert sample(m, "radix_predicted_cached_tokens_total") == 2 * (n1 - 1)
    assert sample(m, "radix_route_tokens_total", route="A") == n1 - 1
    assert sample(m, "radix_route_tokens_total", route="H") == n1 - 1
    assert sample(m, "radix_route_tokens_total", route="prefill") == 0
    # Host tree: three disjoint prompts saved once each, one restore.
    assert sample(m, "radix_host_saves_total") == 3
    assert sample(m, "radix_host_saved_tokens_total") == n1 + n2 + n3
    assert sample(m, "radix_host_loads_total") == 1
    assert sample(m, "radix_host_loaded_tokens_total") == n1 - 1
    assert sample(m, "radix_host_evictions_total") == 0
    assert sample(m, "radix_host_tree_nodes") == 3
    assert sample(m, "radix_host_tree_leaves") == 3
    assert sample(m, "radix_host_tree_unique_tokens") == n1 + n2 + n3
    assert sample(m, "radix_host_tree_logical_tokens") == n1 + n2 + n3
    assert sample(m, "radix_host_tree_budget_bytes") == 256 * 1024 * 1024
    layout = live.proxy.call(lambda rt: rt.coordinator.servers[0].mover.layout)
    assert layout is not None
    assert sample(m, "radix_host_tree_bytes") >= (n1 + n2 + n3) * layout.bytes_per_token
    # KV moves: three exports (KV rows), one import (a whole payload).
    assert (
        sample(m, "radix_kv_move_bytes_total", direction="export") == (n1 + n2 + n3) * layout.bytes_per_token
    )
    payload = live.caps["payload"]
    assert (
        sample(m, "radix_kv_move_bytes_total", direction="import")
        == blob_size(layout, n1 - 1)
        == payload["header_bytes"] + (n1 - 1) * payload["cell_bytes"]
    )
    assert sample(m, "radix_kv_move_seconds_total", direction="import") > 0
    assert sample(m, "radix_kv_move_seconds_total", direction="export") > 0
    for cause in FALLBACK_CAUSES:
        assert sample(m, "radix_fallbacks_total", cause=cause) == 0
    for status in ("4xx", "5xx"):
        assert sample(m, "radix_request_errors_total", status=status) == 0
    for api in ("chat", "completions", "messages", "responses", "infill"):
        assert sample(m, "radix_api_requests_total", api=api) == (5 if api == "completions" else 0), api
        assert sample(m, "radix_prompt_mismatch_total", api=api) == 0, api
    assert sample(m, "radix_tokenizer_server_fallback") == 0
    # The server's pool: slot 0 holds P3, slot 1 holds P1, nothing shared, no owners.
    assert sample(m, "radix_backend_up", server="s0") == 1
    assert sample(m, "kv_cache_total_cells", server="s0") == live.caps["n_cells"]
    assert sample(m, "kv_cache_used_cells", server="s0") == n1 + n3
    assert sample(m, "kv_cache_slot_cells", server="s0") == n1 + n3
    assert sample(m, "kv_cache_business_logical_cells", server="s0") == n1 + n3
    assert sample(m, "kv_cache_owner_cells", server="s0") == 0
    assert sample(m, "kv_cache_owner_only_cells", server="s0") == 0
    assert sample(m, "radix_resident_entries", server="s0") == 0
    assert sample(m, "radix_resident_cells", server="s0") == 0


def test_metrics_scrape_reads_the_pool(live: Live) -> None:
    complete(live.proxy, text("Delta", 4, 30))
    held = live.proxy.call(lambda rt: sum(len(s.tokens) for s in rt.coordinator.servers[0].slots))
    m = parse_metrics(scrape(live.proxy.url).body)
    assert sample(m, "kv_cache_used_cells", server="s0") == held
    tree = live.proxy.call(lambda rt: rt.coordinator.tree.stats())
    assert sample(m, "radix_host_tree_leaves") == tree.leaves


def test_cache_summary_line(live: Live) -> None:
    line = live.proxy.call(cache_summary)
    s = live.proxy.call(lambda rt: rt.coordinator.tree.stats())
    fields = dict(kv.split("=", 1) for kv in line.split()[1:])
    assert line.startswith("cache ")
    assert int(fields["terminal_nodes"]) == s.leaves and int(fields["host_bytes"]) == s.bytes
    assert (
        int(fields["unique_tokens"]) == s.unique_tokens and int(fields["logical_tokens"]) == s.logical_tokens
    )
    assert (int(fields["saves"]), int(fields["loads"]), int(fields["evictions"])) == (
        s.saves,
        s.loads,
        s.evictions,
    )
    assert fields["fallbacks"] == ",".join(f"{c}:0" for c in FALLBACK_CAUSES)


# ---- 3. admin API and radixctl ---------------------------------------------------------------------


def test_admin_api_needs_the_key(live: Live) -> None:
    for path in ("routes", "tree", "slots", "stats"):
        denied = get(f"{live.proxy.url}/radix/{path}")
        assert denied.status == 401 and denied.body["error"]["type"] == "authentication_error"
    # Under the admin rule too: a cache-hit counter is an oracle for other clients' prompts.
    assert get(f"{live.proxy.url}/metrics").status == 401
    assert scrape(live.proxy.url).status == 200
    bad = run_cli("stats", "--url", live.proxy.url)
    assert bad.exit_code == 1 and "--admin-key" in bad.output
    assert get_admin(live, "/radix/routes?limit=zero").status == 400
    m = parse_metrics(scrape(live.proxy.url).body)
    assert sample(m, "radix_request_errors_total", status="4xx") == 0  # admin refusals are not request errors


def scrape(url: str) -> Reply:
    """GET /metrics with the admin key (the proxy under test has one)."""
    return request(f"{url}/metrics", headers=AUTH)


def get_admin(live: Live, path: str) -> Reply:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(live.proxy.url + path, headers=AUTH)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return Reply(resp.status, dict(resp.headers), json.loads(resp.read()))
    except urllib.error.HTTPError as err:
        return Reply(err.code, dict(err.headers), json.loads(err.read()))


def cli(live: Live, *args: str) -> Any:
    result = run_cli(*args, "--url", live.proxy.url, "--admin-key", ADMIN_KEY)
    assert result.exit_code == 0, result.output
    return result


def test_radixctl_routes(live: Live) -> None:
    rows = [json.loads(line) for line in cli(live, "routes", "-n", "50", "--json").stdout.splitlines()]
    scripted = [d for d in rows if d["request_id"] in {r.headers["X-Request-Id"] for r in live.replies}]
    assert [d["route"] for d in scripted] == ["prefill", "A", "prefill", "prefill", "H"]
    n1 = int(live.replies[0].headers["X-Radix-Prompt-Tokens"])
    h = scripted[4]
    assert (h["predicted_cached"], h["cached"], h["prefilled"], h["server"], h["slot"]) == (
        n1 - 1,
        n1 - 1,
        1,
        "s0",
        1,
    )
    assert h["ttft_s"] > 0 and h["diverge"]["at"] >= n1 - 1
    human = cli(live, "routes", "-n", "5").stdout
    header, *lines = human.splitlines()
    assert header.split()[:8] == [
        "time",
        "request",
        "route",
        "predicted",
        "cached",
        "prefilled",
        "ttft",
        "server/slot",
    ]
    assert len(lines) == 5 and all(re.match(r"\d\d:\d\d:\d\d\s+r[0-9a-f]{16}\s", line) for line in lines)


def test_radixctl_routes_shows_where_the_prompt_diverged(live: Live) -> None:
    words = P1.split()
    prompt = " ".join(words[:60]) + " zebra quokka narwhal axolotl pangolin."
    reply = complete(live.proxy, prompt)
    rid = reply.headers["X-Request-Id"]
    rows = [json.loads(line) for line in cli(live, "routes", "-n", "3", "--json").stdout.splitlines()]
    decision = next(d for d in rows if d["request_id"] == rid)
    assert "before" in decision["diverge"], decision
    div = decision["diverge"]
    # The slot holding P1 is the longest holder; the request goes on with the new words.
    assert div["source"] == "slot s0/1" and not div["complete"]
    assert div["at"] == reply.body["timings"]["cache_n"]
    assert "zebra" in div["request"] and "zebra" not in div["cached"]
    assert (div["before"] + div["cached"]).strip() in P1 and div["before"].strip() in prompt
    human = cli(live, "routes", "-n", "1").stdout
    assert f"@{div['at']} (slot s0/1)" in human and "zebra" in human and "cached ▸" in human


def test_radixctl_routes_follow(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []

    def wait(seconds: float) -> None:
        if sent:
            raise KeyboardInterrupt
        sent.append(complete(live.proxy, text("Echo", 5, 20)).headers["X-Request-Id"])

    monkeypatch.setattr(cli_admin, "_wait", wait)
    out = cli(live, "routes", "-n", "2", "--follow").stdout.splitlines()
    assert out[0].startswith("time") and len(out) == 4  # header, the last two, then the new one
    assert re.match(rf"\d\d:\d\d:\d\d\s+{sent[0]}\s", out[3])
    follow_json = cli(live, "routes", "-n", "1", "--follow", "--json").stdout.splitlines()
    assert [json.loads(line)["request_id"] for line in follow_json] == [sent[0]]


def test_radixctl_tree(live: Live) -> None:
    data = json.loads(cli(live, "tree", "--top", "3", "--json").stdout)
    stats = live.proxy.call(lambda rt: rt.coordinator.tree.stats())
    assert data["stats"]["leaves"] == stats.leaves and data["stats"]["bytes"] == stats.bytes
    assert data["dedup_ratio"] == pytest.approx(stats.logical_tokens / stats.unique_tokens)
    top = data["top"][0]
    assert top["hits"] >= 2 and top["preview"]["head"].startswith("Alpha")  # P1 is the most reused prefix
    assert top["preview"]["tail"] and top["preview"]["tail"].strip() in P1
    human = cli(live, "tree", "--top", "3").stdout
    assert f"{stats.nodes} nodes ({stats.leaves} terminal)" in human and '"Alpha' in human
    assert "tokens" in human and "hits" in human and "size" in human


def test_radixctl_slots(live: Live) -> None:
    data = json.loads(cli(live, "slots", "--json").stdout)
    (server,) = data["servers"]
    assert server["server"] == "s0" and server["url"] == live.backend.url and server["errors"] == []
    assert server["residents"] == [] and server["pool"]["owner"] == 0
    for slot in server["slots"]:
        assert (
            slot["n_tokens"] == slot["server_n_tokens"] == slot["n_cells"]
        )  # the proxy's view is the server's
        assert not slot["busy"]
    assert server["pool"]["used"] == sum(s["n_cells"] for s in server["slots"])
    human = cli(live, "slots").stdout
    assert "resident entries: none" in human and "KV pool:" in human and "s0" in human
    assert len([line for line in human.splitlines() if line.startswith("s0 ")]) == 2


def test_radixctl_stats(live: Live) -> None:
    data = json.loads(cli(live, "stats", "--json").stdout)
    m = parse_metrics(scrape(live.proxy.url).body)
    assert data["requests"] == sum(sample(m, "radix_requests_total", route=r, server="s0") for r in ROUTES)
    assert data["by_route"]["H"] == 1 and data["by_route"]["prefill"] >= 3
    assert data["cached_tokens"] == sample(m, "radix_cached_tokens_total")
    assert data["hit_ratio"] == pytest.approx(data["cached_tokens"] / data["prompt_tokens"])
    assert data["kv_moves"]["import"]["bytes"] == sample(m, "radix_kv_move_bytes_total", direction="import")
    assert data["pool"]["s0"]["n_cells"] == live.caps["n_cells"] and data["tokenizer"] == "local"
    assert set(data["tree"]) >= {
        "nodes",
        "leaves",
        "bytes",
        "unique_tokens",
        "logical_tokens",
        "saves",
        "loads",
    }
    human = cli(live, "stats").stdout
    for label in ("requests", "prompt tokens", "mean TTFT", "host tree", "KV moves", "fallbacks", "pool s0"):
        assert re.search(rf"^{label}\s", human, re.M), label


def test_radixctl_doctor(live: Live, stock_server: ServerProcess, tmp_path: Path) -> None:
    spec = live.backend.spec
    key = ["--kvctl-key", str(spec.kvctl_key)]
    good = CliRunner().invoke(
        radixctl,
        ["doctor", "--backend-url", live.backend.url, *key, "--shm-dir", str(spec.kvctl_dir), "--json"],
    )
    assert good.exit_code == 0, good.output
    checks = {c["name"]: c for c in json.loads(good.stdout)["servers"][0]["checks"]}
    assert {"reachable", "build", "kvctl", "KV layout", "payload dir", "chat template", "tokenizer"} <= set(
        checks
    )
    assert all(c["status"] != "fail" for c in checks.values())
    assert checks["tokenizer"]["status"] == "ok" and checks["payload dir"]["status"] == "ok"
    human = CliRunner().invoke(radixctl, ["doctor", "--backend-url", live.backend.url, *key]).stdout
    assert "OK    tokenizer" in human and "result:" in human
    key_file = tmp_path / "kvctl.key"
    key_file.write_text(f"{spec.kvctl_key}\n")
    from_file = CliRunner().invoke(
        radixctl, ["doctor", "--backend-url", live.backend.url, "--kvctl-key-file", str(key_file), "--json"]
    )
    assert from_file.exit_code == 0, from_file.output
    checks = {c["name"]: c for c in json.loads(from_file.stdout)["servers"][0]["checks"]}
    assert checks["kvctl"]["status"] == "ok" and checks["tokenizer"]["status"] == "ok"

    stock = CliRunner().invoke(radixctl, ["doctor", "--backend-url", stock_server.url])
    assert stock.exit_code == 1
    assert "FAIL  kvctl" in stock.stdout
    assert (
        "fix: run the patched llama-server" in stock.stdout and "--cache-ram 0 -sps 0 --kvctl" in stock.stdout
    )

    gone = CliRunner().invoke(
        radixctl, ["doctor", "--backend-url", f"http://127.0.0.1:{free_port()}", "--json"]
    )
    assert gone.exit_code == 1
    (result,) = json.loads(gone.stdout)["servers"]
    assert result["checks"][0]["name"] == "reachable" and result["checks"][0]["status"] == "fail"


# ---- 4. dashboard and scrape config ------------------------------------------------------------------


METRIC_NAME = re.compile(r"\b((?:radix|kv_cache)_[a-z_]+)\b")


def _queries(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, str | dict):
                yield value if isinstance(value, str) else str(value.get("query", ""))
            else:
                yield from _queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _queries(item)


def test_dashboard_uses_only_exported_metrics(live: Live) -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/llama-radix-proxy.json").read_text())
    exported = {name for name, _ in parse_metrics(scrape(live.proxy.url).body)}
    used: set[str] = set()
    for panel in dashboard["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs and all(METRIC_NAME.search(e) for e in exprs), panel["title"]
    for query in _queries(dashboard):
        used |= set(METRIC_NAME.findall(query))
    assert used, "the dashboard queries no metric"
    assert used <= exported, f"not exported by the proxy: {sorted(used - exported)}"
    # What the issue asks the dashboard to show.
    for needed in (
        "radix_route_tokens_total",
        "radix_prompt_tokens_total",
        "radix_cached_tokens_total",
        "radix_ttft_seconds_bucket",
        "radix_host_tree_bytes",
        "radix_host_tree_logical_tokens",
        "radix_host_tree_unique_tokens",
        "kv_cache_used_cells",
        "kv_cache_business_logical_cells",
    ):
        assert needed in used, needed
    titles = {p["title"] for p in dashboard["panels"]}
    assert {
        "Hit rate by route",
        "TTFT by route",
        "Host cache bytes",
        "Host dedup ratio",
        "KV cells used and shared",
    } <= titles


def test_prometheus_scrape_config_points_at_metrics() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "llama-radix-proxy"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    # The compose stack's proxy service, on its metrics port (the client port needs the admin rule).
    assert job["static_configs"][0]["targets"] == ["proxy:9464"]
    compose = yaml.safe_load((ROOT / "deploy/docker-compose.yml").read_text())
    assert compose["services"]["proxy"]["environment"]["RADIX_METRICS_PORT"] == "${PROXY_METRICS_PORT:-9464}"
