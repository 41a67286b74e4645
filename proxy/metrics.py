"""Prometheus metrics of the proxy, on an injected registry.

Label values are initialised at start so every series exists (at 0) before traffic.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ROUTES = ("A", "S", "H", "A+H", "S+H", "prefill")
FALLBACK_CAUSES = ("export", "import", "verify", "compat", "payload", "transport")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class Metrics:
    def __init__(self, registry: CollectorRegistry, servers: tuple[str, ...]) -> None:
        self.registry = registry
        ns = "radix"
        self.requests = Counter(f"{ns}_requests", "Completion requests by route and server",
                                ["route", "server"], registry=registry)
        self.request_errors = Counter(f"{ns}_request_errors", "Requests answered with an error, by status class",
                                      ["status"], registry=registry)
        self.ttft = Histogram(f"{ns}_ttft_seconds", "Time to first byte of the answer", ["route", "server"],
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{ns}_request_seconds", "End-to-end request time", ["route", "server"],
                             buckets=_LATENCY_BUCKETS, registry=registry)
        self.queue_wait = Histogram(f"{ns}_queue_wait_seconds", "Wait for a free slot", ["server"],
                                    buckets=_LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter(f"{ns}_prompt_tokens", "Prompt tokens of steered requests", registry=registry)
        self.cached_tokens = Counter(f"{ns}_cached_tokens", "Prompt tokens the server reused (timings.cache_n)",
                                     registry=registry)
        self.prefilled_tokens = Counter(f"{ns}_prefilled_tokens", "Prompt tokens the server computed",
                                        registry=registry)
        self.predicted_cached = Counter(f"{ns}_predicted_cached_tokens", "Prompt tokens the plan expected to reuse",
                                        registry=registry)
        self.route_tokens = Counter(f"{ns}_route_tokens", "Prompt tokens served from cache, by route",
                                    ["route"], registry=registry)
        self.fallbacks = Counter(f"{ns}_fallbacks", "KV moves that failed and fell back to prefill, by cause",
                                 ["cause"], registry=registry)
        self.kv_move_bytes = Counter(f"{ns}_kv_move_bytes", "Bytes moved between server and host",
                                     ["direction"], registry=registry)
        self.kv_move_seconds = Counter(f"{ns}_kv_move_seconds", "Time spent in KV moves",
                                       ["direction"], registry=registry)
        self.tree_nodes = Gauge(f"{ns}_host_tree_nodes", "Nodes in the host radix tree", registry=registry)
        self.tree_bytes = Gauge(f"{ns}_host_tree_bytes", "Bytes held by the host radix tree", registry=registry)
        self.tree_unique = Gauge(f"{ns}_host_tree_unique_tokens", "Distinct token positions stored",
                                 registry=registry)
        self.tree_logical = Gauge(f"{ns}_host_tree_logical_tokens", "Tokens servable across stored prompts",
                                  registry=registry)
        self.tree_saves = Counter(f"{ns}_host_saves", "Exports inserted into the host tree", registry=registry)
        self.tree_saved_tokens = Counter(f"{ns}_host_saved_tokens", "New tokens stored in the host tree",
                                         registry=registry)
        self.tree_loads = Counter(f"{ns}_host_loads", "Host restores into a slot", registry=registry)
        self.tree_evictions = Gauge(f"{ns}_host_evictions", "Host tree evictions since start", registry=registry)
        self.tokenizer_fallback = Gauge(f"{ns}_tokenizer_server_fallback",
                                        "1 when the server's tokenizer is used because the local one differed",
                                        registry=registry)
        for server in servers:
            self.queue_wait.labels(server)
            for route in ROUTES:
                self.requests.labels(route, server)
                self.ttft.labels(route, server)
                self.e2e.labels(route, server)
        for route in ROUTES:
            self.route_tokens.labels(route)
        for cause in FALLBACK_CAUSES:
            self.fallbacks.labels(cause)
        for direction in ("export", "import"):
            self.kv_move_bytes.labels(direction)
            self.kv_move_seconds.labels(direction)
        for status in ("4xx", "5xx"):
            self.request_errors.labels(status)
