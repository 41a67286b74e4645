"""Operations: the running proxy and what keeps it running.

``startup`` (connect to the servers, check them, build the runtime) and ``connect`` (one
server: caps, KV layout and its check, payload directory, mover, slots, sharing),
``runtime`` (the state the handlers see), ``health`` (who may get new requests),
``models`` (several models behind one proxy), ``admin`` (the read-only /radix/ API),
``observe`` (gauges read on scrape, the periodic summary), ``eventloop`` (uvloop or asyncio).

Below ``api``: it may import ``http``, ``coordinator``, ``tiers``, ``dataplane`` and
``metrics``, never ``api``.
"""
