"""A discrete-event simulator of many servers behind one routing policy (docs/scale.md).

Pure Python (no event loop, no I/O): fake servers with modelled prefill, decode and KV-move
times, driven through the proxy's real planner (``proxy.core.planner``), host radix tree
(``proxy.core.radix``) and resident index (``proxy.core.resident``).
"""
