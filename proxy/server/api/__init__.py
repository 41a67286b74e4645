"""The client APIs, one module per API: its routes, its body conversion, its answer's shape.

``routes`` (OpenAI chat and completions, /v1/models, /health, /metrics, the read-only
pass-through, and the steered path every leased API shares), ``agents`` (the routes of
Anthropic Messages and OpenAI Responses), ``anthropic`` and ``anthropic_stream`` (Messages
converted to chat, the answer and its event stream back), ``responses`` (Responses converted
to chat), ``infill``, ``embeddings`` (embeddings and rerank), ``shapes`` (an answer's shape
per API on its way back).

The top layer under ``proxy.server.app``: it may import ``ops``, ``http``, ``coordinator``,
``tiers``, ``dataplane`` and ``metrics``; nothing in ``proxy.server`` but ``app`` imports it.
"""
