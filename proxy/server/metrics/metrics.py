"""Prometheus metrics of the proxy, on an injected registry.

Every label value is initialised at start (routes, servers, causes, directions), so every
series exists at 0 before traffic and dashboards never see "no data" for a quiet route.
Names follow the Prometheus conventions: base units (seconds, bytes), counters end in
``_total`` (added by the client library), gauges describe a current state.

Two families are not ``radix_``-prefixed because they describe the llama-server's KV pool,
not the proxy: ``kv_cache_*_cells{server}``, read from each server's ``GET /kvctl/cells``
when /metrics is scraped (see ``proxy.server.ops.observe.refresh_metrics``).

The metric list, with what each means and how to read it, is in docs/observability.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.core.radix import TreeStats
from proxy.server.metrics.labels import (
    APIS,
    ARENA_FULL_DIRECTIONS,
    ARENA_PATHS,
    ARENA_STATES,
    DIRECTIONS,
    FALLBACK_CAUSES,
    POOL_FIELDS,
    POOL_HELP,
    REJECT_REASONS,
    ROUTES,
)
from proxy.server.metrics.remote import RemoteMetrics
from proxy.server.metrics.tiers import DiskMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class SyncedCounter:
    """A Counter that follows a monotonic total kept elsewhere (the radix tree's stats).

    ``set(total)`` adds what the total grew by since the last call; it never goes down.
    """

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self._last = 0.0

    def set(self, total: float) -> None:
        if total > self._last:
            self.counter.inc(total - self._last)
        self._last = max(self._last, total)


class Metrics:
    def __init__(self, registry: CollectorRegistry, servers: tuple[str, ...]) -> None:
        self.registry = registry
        self.servers = servers
        self.started = time.time()
        self.disk = DiskMetrics(registry)  # the disk tier's families (docs/disk-tier.md)
        self.remote = RemoteMetrics(registry)  # the remote tier's families (docs/scale-out.md)
        ns = "radix"
        # ---- per request (coordinator.record_decision) ----------------------------------
        self.requests = Counter(
            f"{ns}_requests",
            "Completion requests by route and server",
            ["route", "server"],
            registry=registry,
        )
        self.api_requests = Counter(
            f"{ns}_api_requests",
            "Steered requests by client API (chat, completions, messages, responses)",
            ["api"],
            registry=registry,
        )
        self.prompt_mismatch = Counter(
            f"{ns}_prompt_mismatch",
            "Requests whose prompt the server counted at another length than the proxy's tokens "
            "(an API conversion, template or tokenizer not the server's: costs hits, not correctness)",
            ["api"],
            registry=registry,
        )
        self.request_errors = Counter(
            f"{ns}_request_errors",
            "Requests answered with an error, by status class",
            ["status"],
            registry=registry,
        )
        self.poison_requests = Counter(
            f"{ns}_poison_requests",
            "Requests after which their server died before answering (not retried)",
            ["server"],
            registry=registry,
        )
        self.ttft = Histogram(
            f"{ns}_ttft_seconds",
            "Time from arrival to the first byte of the answer (whole answer when not streamed)",
            ["route", "server"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            f"{ns}_request_seconds",
            "End-to-end request time",
            ["route", "server"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        # By server only: the route is chosen when the slot is granted, i.e. when the wait ends.
        self.queue_length = Gauge(
            f"{ns}_queue_length",
            "Requests waiting: for a free slot, or for a request in flight that holds their prefix (fan-out)",
            registry=registry,
        )
        self.rejected = Counter(
            f"{ns}_rejected_requests",
            "Requests refused by admission, by reason",
            ["reason"],
            registry=registry,
        )
        self.queue_wait = Histogram(
            f"{ns}_queue_wait_seconds",
            "Wait for a free slot",
            ["server"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.save_hold = Histogram(
            f"{ns}_save_hold_seconds",
            "How long a slot stayed leased after its answer for the save (read back and export; "
            "the tree insert and idle release run after the slot is handed on)",
            ["server"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefix_steps = Counter(
            f"{ns}_prefix_steps",
            "Prefix steps: a wave's first request computed the prefix it shares with the others "
            "alone first, and the proxy put it in the tree for them (docs/design.md, Waves), by outcome",
            ["outcome"],
            registry=registry,
        )
        self.prefix_step_tokens = Counter(
            f"{ns}_prefix_step_tokens",
            "Prompt tokens the servers computed in prefix steps (their own prompt_n)",
            registry=registry,
        )
        self.saving_slot_takes = Counter(
            f"{ns}_saving_slot_takes",
            "Slots a request took while their previous answer's save was pending (not worth "
            "waiting for: the tree lacked less than --min-restore-tokens of it)",
            ["server"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            f"{ns}_prompt_tokens", "Prompt tokens of steered requests", registry=registry
        )
        self.cached_tokens = Counter(
            f"{ns}_cached_tokens", "Prompt tokens the server reused (timings.cache_n)", registry=registry
        )
        self.prefilled_tokens = Counter(
            f"{ns}_prefilled_tokens",
            "Prompt tokens the server computed (timings.prompt_n)",
            registry=registry,
        )
        self.predicted_cached = Counter(
            f"{ns}_predicted_cached_tokens", "Prompt tokens the plan expected to reuse", registry=registry
        )
        self.route_tokens = Counter(
            f"{ns}_route_tokens",
            "Prompt tokens the server reused (timings.cache_n), by route",
            ["route"],
            registry=registry,
        )
        # ---- KV moves --------------------------------------------------------------------
        self.fallbacks = Counter(
            f"{ns}_fallbacks",
            "KV moves that failed and fell back to prefill, by cause",
            ["cause"],
            registry=registry,
        )
        self.kv_move_bytes = Counter(
            f"{ns}_kv_move_bytes",
            "Bytes moved between server and host (export: KV data; import: payload with headers)",
            ["direction"],
            registry=registry,
        )
        self.kv_move_seconds = Counter(
            f"{ns}_kv_move_seconds", "Time spent in KV moves", ["direction"], registry=registry
        )
        # ---- the arena (docs/design.md, "The arena") ---------------------------------------
        self.arena_bytes = Gauge(
            f"{ns}_arena_bytes",
            "The KV arena: capacity, bytes in blocks, bytes quarantined after unanswered moves",
            ["state"],
            registry=registry,
        )
        self.arena_move_bytes = Counter(
            f"{ns}_arena_move_bytes",
            "KV bytes moved, by path: in_place (the server copies to or from arena blocks, the proxy "
            "not at all), staged (the proxy copied them into a temporary block), file (payload files)",
            ["direction", "path"],
            registry=registry,
        )
        self.arena_full = Counter(
            f"{ns}_arena_full",
            "Moves that found no room in the arena even after evicting, and went through a payload "
            "file (export, import), or disk promotions read into ordinary memory (promote)",
            ["direction"],
            registry=registry,
        )
        # ---- host radix tree ---------------------------------------------------------------
        self.tree_nodes = Gauge(f"{ns}_host_tree_nodes", "Nodes in the host radix tree", registry=registry)
        self.tree_leaves = Gauge(
            f"{ns}_host_tree_leaves", "Terminal nodes (leaves) of the host radix tree", registry=registry
        )
        self.tree_bytes = Gauge(
            f"{ns}_host_tree_bytes", "Bytes held by the host radix tree (KV plus metadata)", registry=registry
        )
        self.tree_budget = Gauge(
            f"{ns}_host_tree_budget_bytes", "Byte budget of the host radix tree", registry=registry
        )
        self.tree_unique = Gauge(
            f"{ns}_host_tree_unique_tokens",
            "Token positions stored (each shared prefix once)",
            registry=registry,
        )
        self.tree_logical = Gauge(
            f"{ns}_host_tree_logical_tokens",
            "Prompt tokens servable from the tree (sum of leaf depths)",
            registry=registry,
        )
        self.tree_saves = Counter(
            f"{ns}_host_saves", "Exports inserted into the host tree", registry=registry
        )
        self.tree_saved_tokens = Counter(
            f"{ns}_host_saved_tokens", "New tokens stored in the host tree", registry=registry
        )
        self.tree_loads = Counter(f"{ns}_host_loads", "Host restores into a slot", registry=registry)
        self.checkpoint_saves = Counter(
            f"{ns}_checkpoint_saves",
            "Whole-state checkpoints (recurrent, hybrid and window-sized SWA models) kept in host memory",
            registry=registry,
        )
        self.checkpoint_restores = Counter(
            f"{ns}_checkpoint_restores",
            "Whole-state checkpoints restored into a slot (route H on a server with moves off)",
            registry=registry,
        )
        self.room_erases = Counter(
            f"{ns}_room_erases",
            "Idle slots erased to make room for the KV cells of admitted requests (resident sharing)",
            registry=registry,
        )
        self.idle_releases = Counter(
            f"{ns}_idle_releases",
            "Slots whose KV was erased from the server once the host tree held it (--cache-idle-release)",
            registry=registry,
        )
        self.room_overdue = Counter(
            f"{ns}_room_overdue",
            "Requests sent to a server without sharing after waiting the queue deadline for room "
            "on the proxy's books (the server decides)",
            registry=registry,
        )
        self.tree_loaded_tokens = SyncedCounter(
            Counter(
                f"{ns}_host_loaded_tokens", "Tokens restored from the host tree into slots", registry=registry
            )
        )
        self.tree_evictions = SyncedCounter(
            Counter(f"{ns}_host_evictions", "Leaves evicted from the host tree", registry=registry)
        )
        self.tree_evicted_tokens = SyncedCounter(
            Counter(f"{ns}_host_evicted_tokens", "Tokens evicted from the host tree", registry=registry)
        )
        # ---- resident prefixes (route S; mirrored from each server's index on scrape) ----------
        self.resident_entries = Gauge(
            f"{ns}_resident_entries",
            "Resident prefixes held by owner sequences",
            ["server"],
            registry=registry,
        )
        self.resident_cells = Gauge(
            f"{ns}_resident_cells", "KV cells held by resident prefixes", ["server"], registry=registry
        )
        self.resident_pinned = Gauge(
            f"{ns}_resident_pinned",
            "Resident prefixes pinned by an attach in flight",
            ["server"],
            registry=registry,
        )
        self.resident_evictions = {}
        self.resident_admitted = {}
        evictions = Counter(
            f"{ns}_resident_evictions",
            "Resident prefixes released (budget, headroom, entries)",
            ["server"],
            registry=registry,
        )
        admitted = Counter(
            f"{ns}_resident_admitted", "Prefixes published as resident", ["server"], registry=registry
        )
        for server in servers:
            self.resident_evictions[server] = SyncedCounter(evictions.labels(server))
            self.resident_admitted[server] = SyncedCounter(admitted.labels(server))
        self.share_path_requests = {
            path: Counter(
                f"kv_share_path_{path}_requests", f"Requests served on path {path}", registry=registry
            )
            for path in ("a", "s", "h", "prefill")
        }
        self.share_path_tokens = {
            path: Counter(
                f"kv_share_path_{path}_tokens",
                f"Prompt tokens reused on path {path} (cache_n)",
                registry=registry,
            )
            for path in ("a", "s", "h", "prefill")
        }
        # ---- servers -------------------------------------------------------------------------
        self.backend_up = Gauge(
            f"{ns}_backend_up",
            "1 when the server answered the last /kvctl/cells read",
            ["server"],
            registry=registry,
        )
        self.server_checkpoints = Gauge(
            f"{ns}_server_checkpoints",
            "1 when the server's moves are off but whole-state checkpoints of its recurrent, hybrid or window "
            "memory are on (host restores at the positions it took them)",
            ["server"],
            registry=registry,
        )
        self.server_moves = Gauge(
            f"{ns}_server_moves",
            "1 when KV moves (host restores, saves, sharing) are on for the server; 0 when its "
            "model's memory cannot be moved exactly and it is served with routes A and prefill only",
            ["server"],
            registry=registry,
        )
        self.server_kv_device = Gauge(
            f"{ns}_server_kv_device",
            "1 for each device and ggml backend the server's KV cache (and recurrent state) "
            "lives on, as its /kvctl/caps memory.buffers say (an info metric)",
            ["server", "device", "backend"],
            registry=registry,
        )
        self._kv_places: dict[str, tuple[tuple[str, str], ...]] = {}
        self.server_move_rate = Gauge(
            f"{ns}_server_kv_move_bytes_per_second",
            "The server's KV move rate the cost model uses, learned from its moves: export "
            "(device-to-host where its KV is on a device) and import (host-to-device)",
            ["server", "direction"],
            registry=registry,
        )
        self.pool = {
            field: Gauge(name, POOL_HELP[field], ["server"], registry=registry)
            for field, name in POOL_FIELDS.items()
        }
        self.tokenizer_fallback = Gauge(
            f"{ns}_tokenizer_server_fallback",
            "1 when the server's /tokenize is used because the local tokenizer is "
            "unavailable or differed from the server's",
            registry=registry,
        )
        self.template_fallback = Gauge(
            f"{ns}_chat_template_server_fallback",
            "1 when every chat request is rendered by the server's /apply-template because the "
            "local chat template is unknown or differed from the server's",
            registry=registry,
        )

        for server in servers:
            self.queue_wait.labels(server)
            self.save_hold.labels(server)
            self.saving_slot_takes.labels(server)
            self.poison_requests.labels(server)
            self.resident_entries.labels(server)
            self.resident_cells.labels(server)
            self.resident_pinned.labels(server)
            self.backend_up.labels(server)
            for gauge in self.pool.values():
                gauge.labels(server)
            for route in ROUTES:
                self.requests.labels(route, server)
                self.ttft.labels(route, server)
                self.e2e.labels(route, server)
        for route in ROUTES:
            self.route_tokens.labels(route)
        for cause in FALLBACK_CAUSES:
            self.fallbacks.labels(cause)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for direction in DIRECTIONS:
            self.kv_move_bytes.labels(direction)
            self.kv_move_seconds.labels(direction)
            for path in ARENA_PATHS:
                self.arena_move_bytes.labels(direction, path)
        for outcome in ("done", "failed"):
            self.prefix_steps.labels(outcome)
        for direction in ARENA_FULL_DIRECTIONS:
            self.arena_full.labels(direction)
        for state in ARENA_STATES:
            self.arena_bytes.labels(state)
        for status in ("4xx", "5xx"):
            self.request_errors.labels(status)
        for api in APIS:
            self.api_requests.labels(api)
            self.prompt_mismatch.labels(api)

    # ---- updates from state owned elsewhere --------------------------------------------------

    def sync_tree(self, stats: TreeStats) -> None:
        """Gauges and counters that mirror the host radix tree's own statistics."""
        self.tree_nodes.set(stats.nodes)
        self.tree_leaves.set(stats.leaves)
        self.tree_bytes.set(stats.bytes)
        self.tree_budget.set(stats.budget_bytes)
        self.tree_unique.set(stats.unique_tokens)
        self.tree_logical.set(stats.logical_tokens)
        self.tree_loaded_tokens.set(stats.loaded_tokens)
        self.tree_evictions.set(stats.evictions)
        self.tree_evicted_tokens.set(stats.evicted_tokens)
        self.disk.sync(stats, None)

    def set_pool(self, server: str, cells: Mapping[str, Any] | None) -> None:
        """The server's KV pool counts from GET /kvctl/cells; None: the server did not answer."""
        self.backend_up.labels(server).set(0 if cells is None else 1)
        if cells is None:
            return  # keep the last known counts rather than report an empty pool
        for field, gauge in self.pool.items():
            gauge.labels(server).set(float(cells.get(field, 0)))

    def set_kv_place(self, server: str, places: tuple[tuple[str, str], ...]) -> None:
        """Where the server's KV lives, as (device, backend) pairs from its caps at connect:
        one series each, 1 (("unknown", "unknown") where the caps cannot say); a reconnected
        server's earlier series are removed."""
        for labels in self._kv_places.pop(server, ()):
            self.server_kv_device.remove(server, *labels)
        self._kv_places[server] = places or (("unknown", "unknown"),)
        for device, backend in self._kv_places[server]:
            self.server_kv_device.labels(server, device, backend).set(1)

    def set_arena(self, stats: Mapping[str, int]) -> None:
        for state in ARENA_STATES:
            self.arena_bytes.labels(state).set(stats.get(state, 0))

    def set_move_rates(self, server: str, export_bytes_per_s: float, import_bytes_per_s: float) -> None:
        self.server_move_rate.labels(server, "export").set(export_bytes_per_s)
        self.server_move_rate.labels(server, "import").set(import_bytes_per_s)

    # ---- reading (admin API, radixctl stats) -------------------------------------------------

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0 when absent): ``value("radix_requests_total", route="A", server="s0")``."""
        got = self.registry.get_sample_value(name, labels)
        return float(got) if got is not None else 0.0

    def total(self, name: str, label: str, values: tuple[str, ...]) -> dict[str, float]:
        """``{value: sample}`` for one label, summed over every other label."""
        out = dict.fromkeys(values, 0.0)
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name == name and label in sample.labels and sample.labels[label] in out:
                    out[sample.labels[label]] += float(sample.value)
        return out
