"""Prometheus metrics of the disk tier (docs/disk-tier.md), on the proxy's registry.

Every label value exists at 0 from the start, whether or not ``--cache-disk`` is set, so
the dashboard's disk panels read 0 rather than "no data" on a proxy without the tier.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.core.diskindex import DemoteFailure, DiskStats, DropCause
from proxy.core.radix import TreeStats

TIERS = ("ram", "disk")
DROP_CAUSES = tuple(c.value for c in DropCause)
DEMOTE_FAILURES = tuple(c.value for c in DemoteFailure)


class DiskMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        ns = "radix"
        self.tier_bytes = Gauge(
            f"{ns}_tier_bytes", "Bytes held by each tier of the host cache", ["tier"], registry=registry
        )
        self.tier_budget = Gauge(
            f"{ns}_tier_budget_bytes",
            "Byte budget of each tier of the host cache",
            ["tier"],
            registry=registry,
        )
        self.tier_entries = Gauge(
            f"{ns}_tier_entries",
            "Entries in each tier (RAM: tree nodes; disk: segment files)",
            ["tier"],
            registry=registry,
        )
        self.promotions = Counter(
            f"{ns}_disk_promotions", "Matches continued from the disk tier into RAM", registry=registry
        )
        self.promoted_tokens = Counter(
            f"{ns}_disk_promoted_tokens", "Tokens of KV read from disk into the host tree", registry=registry
        )
        self.demotions = Counter(
            f"{ns}_disk_demotions", "Segments written to the disk tier", registry=registry
        )
        self.demoted_bytes = Counter(
            f"{ns}_disk_demoted_bytes", "Bytes written to the disk tier", registry=registry
        )
        self.demotion_failures = Counter(
            f"{ns}_disk_demotion_failures",
            "Segments that did not reach the disk, by cause",
            ["cause"],
            registry=registry,
        )
        self.dropped = Counter(
            f"{ns}_disk_dropped",
            "Disk entries found unusable and not imported, by cause",
            ["cause"],
            registry=registry,
        )
        self.evictions = Counter(
            f"{ns}_disk_evictions", "Disk entries removed to stay within the disk budget", registry=registry
        )
        for tier in TIERS:
            self.tier_bytes.labels(tier)
            self.tier_budget.labels(tier)
            self.tier_entries.labels(tier)
        for cause in DROP_CAUSES:
            self.dropped.labels(cause)
        for failure in DEMOTE_FAILURES:
            self.demotion_failures.labels(failure)

    def sync(self, tree: TreeStats, disk: DiskStats | None) -> None:
        self.tier_bytes.labels("ram").set(tree.bytes)
        self.tier_budget.labels("ram").set(tree.budget_bytes)
        self.tier_entries.labels("ram").set(tree.nodes)
        if disk is not None:
            self.tier_bytes.labels("disk").set(disk.bytes)
            self.tier_budget.labels("disk").set(disk.budget_bytes)
            self.tier_entries.labels("disk").set(disk.entries)
