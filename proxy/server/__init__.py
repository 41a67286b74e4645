"""The serving path, one package per job. Top to bottom, each package may import only the ones
below it (``tests/unit/test_layers.py`` checks it; docs/design.md, "Layers"):

- ``app`` (a module): the composition root, ``build_app(config)``; the one part that imports them all.
- ``api``: the client APIs: each API's routes, its body conversion and its answer's shape, and
  the steered path they share (tokenize, lease, restore, forward, retry).
- ``ops``: the running proxy: start-up and its checks, the runtime state the handlers see,
  health, the models served, the admin API, what is observed on scrape, the event loop.
- ``http``: what every request crosses on its way to a server and back: the trust boundary,
  request limits, forwarding and the answer's relay, connection bounds, the request recorder.
- ``coordinator``: the one owner of mutable state (slots, leases, the wait queue, the host tree).
- ``tiers``: the host cache's tiers below RAM (the disk tier).
- ``dataplane``: talking to one llama-server and moving its KV: the client and its typed /kvctl
  replies, the mover, the arena, payload files, the layout check, resident sharing.
- ``metrics``: every Prometheus family, on one injected registry.
"""
