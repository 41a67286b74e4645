"""The serving path: HTTP app, coordinator, backend client, KV mover, sharing, metrics, admin."""
