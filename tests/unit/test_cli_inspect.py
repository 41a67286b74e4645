"""radixctl's inspect tables, the metrics helpers and the admin formatting, without a server."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from proxy.cli import inspect as cli_admin
from proxy.cli.inspect import (
    format_slots,
    format_stats,
    format_tree,
    snippet,
    table,
    tier_lines,
    why_text,
)
from proxy.core.payload import KvLayout, KvSegment
from proxy.core.radix import RadixTree
from proxy.server.metrics import FALLBACK_CAUSES, ROUTES, Metrics
from proxy.server.ops.observe import cache_summary

LAYOUT = KvLayout(2, (1, 1), (8, 8), (1, 1), False, (8, 8), (0, 0), (0, 0))


# ---- formatting --------------------------------------------------------------------------------


def test_table_aligns_columns_and_marks_missing_values() -> None:
    out = table([["a", None, 3], ["long value", 22, None]], ["x", "y", "z"]).splitlines()
    assert out == ["x           y   z", "a           -   3", "long value  22  -"]


def test_snippet_is_one_quoted_line() -> None:
    assert snippet("a\nb\tc") == '"a\\nb\\tc"'
    assert snippet("abcdefghij", 5) == '"abcd…"'
    assert snippet("abcdefghij", 5, tail=True) == '"…ghij"'
    assert snippet(None) == "-"


def decision(**over: Any) -> dict[str, Any]:
    base = {
        "time": 0.0,
        "request_id": "r1",
        "route": "A",
        "predicted_cached": 10,
        "cached": 10,
        "prefilled": 5,
        "ttft_s": 0.1,
        "server": "s0",
        "slot": 1,
        "prompt_tokens": 15,
        "fallback": None,
        "host_match": 4,
        "best_slot_match": 10,
    }
    return {**base, **over}


def test_why_text_names_the_divergence() -> None:
    assert why_text(decision(fallback="import")) == "KV move failed (import), prefilled"
    assert why_text(decision(diverge={"at": 15, "complete": True})) == "whole prompt was cached"
    # Without the token windows (older coordinators) only the position is known.
    assert why_text(decision()) == "@10 (slot)"
    full = why_text(
        decision(
            diverge={
                "at": 10,
                "source": "slot s0/1",
                "complete": False,
                "before": "the weather in",
                "request": " Paris today",
                "cached": " London today",
            }
        )
    )
    assert full == '@10 (slot s0/1) "the weather in" ▸ " Paris today" | cached ▸ " London today"'
    host = why_text(
        decision(
            diverge={
                "at": 4,
                "source": "host",
                "complete": False,
                "before": "x",
                "request": "y",
                "cached": None,
            }
        )
    )
    assert host == '@4 (host) "x" ▸ "y"'
    fresh = why_text(
        decision(
            diverge={
                "at": 0,
                "source": None,
                "complete": False,
                "before": "",
                "request": "Hello",
                "cached": None,
            }
        )
    )
    assert fresh == '@0 (nothing cached starts like it) ▸ "Hello"'


def test_route_rows() -> None:
    (row,) = cli_admin.route_rows([decision(ttft_s=0.25)])
    assert row[1:8] == ["r1", "A", 10, 10, 5, "250ms", "s0/1"]


def tree_stats(**over: Any) -> dict[str, Any]:
    base = {
        "nodes": 3,
        "leaves": 2,
        "unique_tokens": 100,
        "logical_tokens": 150,
        "bytes": 3 * 1024 * 1024,
        "budget_bytes": 1 << 30,
        "pinned_nodes": 0,
        "saves": 2,
        "saved_tokens": 100,
        "loads": 1,
        "loaded_tokens": 50,
        "evictions": 0,
        "evicted_tokens": 0,
    }
    return {**base, **over}


def test_format_tree() -> None:
    data = {
        "stats": tree_stats(),
        "dedup_ratio": 1.5,
        "top": [
            {
                "length": 80,
                "hits": 4,
                "bytes": 2048,
                "head": [1, 2],
                "preview": {"head": "You are", "tail": "the end"},
            }
        ],
    }
    out = format_tree(data)
    assert "3 nodes (2 terminal), 3.0 MiB of 1.0 GiB, 100 unique / 150 logical tokens (dedup 1.50x)" in out
    assert '80      4     2.0 KiB  "You are" … "the end"' in out
    assert format_tree({**data, "top": []}).endswith("(the tree is empty)")


def test_format_slots() -> None:
    data = {
        "servers": [
            {
                "server": "s0",
                "url": "http://x",
                "errors": ["s0 /kvctl/cells: timeout"],
                "slots": [
                    {
                        "id": 0,
                        "busy": True,
                        "n_tokens": 7,
                        "n_cells": 7,
                        "idle_s": None,
                        "preview": {"head": "hi", "tail": ""},
                    }
                ],
                "residents": [
                    {
                        "owner": 4,
                        "n_tokens": 5,
                        "n_cells": 5,
                        "hits": 2,
                        "sharers": {"0": 5},
                        "preview": {"head": "sys", "tail": ""},
                    }
                ],
                "pool": {"n_cells": 100, "used": 12, "slot": 7, "owner": 5, "owner_only": 5, "logical": 14},
            }
        ]
    }
    out = format_slots(data)
    assert out.splitlines()[1].split()[:5] == ["s0", "0", "busy", "7", "7"]
    assert "resident entries: \nserver  owner  tokens  cells  hits  slots:cells" in out
    assert 's0      4      5       5      2     0:5          "sys"' in out
    assert "12 of 100 cells used, slots 7, owners 5 (5 owner-only), logical 14 (2 shared)" in out
    assert "unanswered: s0 /kvctl/cells: timeout" in out


def test_format_stats() -> None:
    data = {
        "uptime_s": 5,
        "requests": 3,
        "by_route": {"A": 1, "prefill": 2},
        "errors": {"4xx": 0, "5xx": 1},
        "prompt_tokens": 300,
        "cached_tokens": 100,
        "prefilled_tokens": 200,
        "predicted_cached_tokens": 100,
        "hit_ratio": 1 / 3,
        "cached_by_route": {"A": 100},
        "ttft_mean_s_by_route": {"A": 0.05},
        "kv_moves": {"export": {"bytes": 1024, "seconds": 0.5}, "import": {"bytes": 0, "seconds": 0.0}},
        "fallbacks": dict.fromkeys(FALLBACK_CAUSES, 0),
        "tree": tree_stats(),
        "dedup_ratio": 1.5,
        "pool": {"s0": None},
        "tokenizer": "local",
        "resident": {"s0": {"entries": 2, "tokens": 90, "pinned": 0, "admitted": 3, "evicted": 1, "hits": 4}},
    }
    out = format_stats(data)
    assert "requests         3 (A 1, prefill 2); errors 4xx 0, 5xx 1" in out
    assert "prompt tokens    300: cached 100 (33.3%), prefilled 200" in out
    assert "pool s0          unanswered" in out and "fallbacks        none" in out
    assert "resident s0      2 entries (90 tokens, 0 pinned), admitted 3, evicted 1, hits 4" in out


# ---- metrics and admin helpers ---------------------------------------------------------------------


def test_metrics_series_exist_at_zero_before_traffic() -> None:
    m = Metrics(CollectorRegistry(), ("s0", "s1"))
    for server in ("s0", "s1"):
        for route in ROUTES:
            assert (
                m.registry.get_sample_value("radix_requests_total", {"route": route, "server": server}) == 0
            )
        for name in (
            "kv_cache_used_cells",
            "radix_resident_entries",
            "radix_resident_cells",
            "radix_backend_up",
        ):
            assert m.registry.get_sample_value(name, {"server": server}) == 0
    for cause in FALLBACK_CAUSES:
        assert m.value("radix_fallbacks_total", cause=cause) == 0


def test_synced_counters_and_pool_gauges() -> None:
    m = Metrics(CollectorRegistry(), ("s0",))
    m.tree_evictions.set(3)
    m.tree_evictions.set(2)  # never goes down
    m.tree_evictions.set(5)
    assert m.value("radix_host_evictions_total") == 5
    m.set_pool("s0", {"n_cells": 100, "used": 10, "slot": 10, "owner": 0, "owner_only": 0, "logical": 12})
    m.set_pool("s0", None)  # unanswered: keep the last counts
    assert m.value("kv_cache_business_logical_cells", server="s0") == 12
    assert m.value("radix_backend_up", server="s0") == 0
    m.requests.labels("A", "s0").inc(2)
    assert m.total("radix_requests_total", "route", ROUTES)["A"] == 2


def fake_runtime(tree: RadixTree) -> Any:
    tokenizer = SimpleNamespace(decode=lambda ids: "".join(chr(96 + i) for i in ids))
    return SimpleNamespace(
        coordinator=SimpleNamespace(tree=tree),
        metrics=Metrics(CollectorRegistry(), ("s0",)),
        local_tokenizer=tokenizer,
    )


def test_cache_summary_and_tree_mirror() -> None:
    tree = RadixTree(1 << 20)
    tree.insert(
        np.arange(1, 11), KvSegment.from_rows(0, LAYOUT, np.zeros((10, LAYOUT.bytes_per_token), np.uint8))
    )
    tree.insert(
        np.r_[np.arange(1, 6), [20, 21]],
        KvSegment.from_rows(5, LAYOUT, np.zeros((2, LAYOUT.bytes_per_token), np.uint8)),
    )
    runtime = fake_runtime(tree)
    line = cache_summary(runtime)
    assert line.startswith("cache terminal_nodes=2 nodes=3 ")
    assert "unique_tokens=12 logical_tokens=17 dedup=1.42 saves=2 loads=0 evictions=0" in line
    runtime.metrics.sync_tree(tree.stats())
    assert runtime.metrics.value("radix_host_tree_leaves") == 2
    assert runtime.metrics.value("radix_host_tree_logical_tokens") == 17


def test_tier_lines_show_ram_and_disk() -> None:
    ram = {"entries": 3, "tokens": 100, "bytes": 3 << 20, "budget_bytes": 1 << 30}
    assert tier_lines(None) == []
    assert tier_lines({"ram": ram, "disk": None})[1] == ("tier disk", "off (--cache-disk)")
    disk = {
        "dir": "/var/cache/radix",
        "usable": True,
        "entries": 7,
        "tokens": 900,
        "bytes": 20 << 20,
        "budget_bytes": 16 << 30,
        "pinned": 0,
        "promotions": 2,
        "promoted_tokens": 640,
        "demotions": 5,
        "evictions": 1,
        "demotion_failures": {"no_space": 1},
        "dropped": {"checksum": 1},
    }
    lines = dict(tier_lines({"ram": ram, "disk": disk}))
    assert lines["tier ram"] == "3 nodes, 100 tokens, 3.0 MiB of 1.0 GiB"
    assert lines["tier disk"] == (
        "7 entries, 900 tokens, 20.0 MiB of 16.0 GiB in /var/cache/radix; promotions 2 (640 tokens), "
        "demotions 5, evictions 1; no_space 1, dropped checksum 1"
    )
    tree = format_tree(
        {"stats": tree_stats(), "dedup_ratio": 1.0, "top": [], "tiers": {"ram": ram, "disk": disk}}
    )
    assert "tier disk: 7 entries" in tree


def test_tier_lines_show_the_remote_tier_when_it_is_on() -> None:
    ram = {"entries": 1, "tokens": 10, "bytes": 100, "budget_bytes": 1000}
    remote = {
        "where": "redis://h:6379/0",
        "up": False,
        "lookups": 3,
        "promotions": 1,
        "promoted_tokens": 512,
        "writes": 4,
        "fallbacks": {"timeout": 2},
        "write_dropped": {"queue_full": 1},
    }
    lines = tier_lines({"ram": ram, "disk": None, "remote": remote})
    assert [k for k, _ in lines] == ["tier ram", "tier disk", "tier remote"]
    text = lines[2][1]
    assert "redis://h:6379/0 down" in text and "promotions 1 (512 tokens)" in text
    assert "timeout 2" in text and "write queue_full 1" in text
    assert [k for k, _ in tier_lines({"ram": ram, "disk": None})] == ["tier ram", "tier disk"]
