"""Prometheus metrics of the remote tier (docs/scale-out.md), on the proxy's registry.

Every label value exists at 0 from the start, whether or not ``--cache-remote`` is set.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.core.diskindex import DropCause
from proxy.core.remotekeys import RemoteFallback, WriteDrop

REMOTE_FALLBACKS = tuple(c.value for c in RemoteFallback)
WRITE_DROPS = tuple(c.value for c in WriteDrop)
REFUSALS = tuple(c.value for c in DropCause)


class RemoteMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        ns = "radix_remote"
        self.up = Gauge(f"{ns}_up", "1 while the remote store answers, 0 after a failure", registry=registry)
        self.lookups = Counter(
            f"{ns}_lookups", "Requests the remote store was asked about", registry=registry
        )
        self.promotions = Counter(
            f"{ns}_promotions", "Matches continued from the remote store into RAM", registry=registry
        )
        self.promoted_tokens = Counter(
            f"{ns}_promoted_tokens", "Tokens of KV read from the remote store", registry=registry
        )
        self.writes = Counter(f"{ns}_writes", "Chunks written to the remote store", registry=registry)
        self.written_bytes = Counter(
            f"{ns}_written_bytes", "Bytes written to the remote store", registry=registry
        )
        self.write_dropped = Counter(
            f"{ns}_write_dropped",
            "Chunks that did not reach the remote store, by cause",
            ["cause"],
            registry=registry,
        )
        self.fallbacks = Counter(
            f"{ns}_fallbacks",
            "Requests planned without the remote store's KV, by cause",
            ["cause"],
            registry=registry,
        )
        self.refused = Counter(
            f"{ns}_refused",
            "Remote chunks that failed a check and were not used, by cause",
            ["cause"],
            registry=registry,
        )
        self.queue_bytes = Gauge(
            f"{ns}_queue_bytes", "Bytes waiting to be written to the remote store", registry=registry
        )
        for cause in REMOTE_FALLBACKS:
            self.fallbacks.labels(cause)
        for drop in WRITE_DROPS:
            self.write_dropped.labels(drop)
        for refusal in REFUSALS:
            self.refused.labels(refusal)
