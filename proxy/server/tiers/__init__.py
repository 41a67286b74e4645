"""The host cache's tiers below the RAM tree: the disk tier (docs/disk-tier.md) and the remote
tier (docs/scale-out.md).

``disk`` (demotion queue, checked promotion, the startup scan) and ``disk_files`` (its file
work on the tier's threads); ``remote`` (the shared store: write queue, checked reads) and
``remote_store`` (its URL, password and client).

Below ``coordinator``, which demotes to and promotes from it: it may import ``dataplane``
(the arena's blocks) and ``metrics``, never the coordinator or anything above.
"""
