"""The data plane: talking to one llama-server and moving its KV.

``backend`` (``ServerClient``: the HTTP client of one server and its /kvctl routes),
``kvctl`` and ``kvctl_moves`` (the /kvctl routes and replies, typed), ``ports`` (the Protocols
the coordinator needs of a client and a mover), ``wire`` (a server's bytes read one way),
``mover`` (KV export and import), ``arena`` (the shared-memory arena), ``payfile`` and
``paydir`` (payload files and their directory), ``layoutcheck`` (a server's KV layout
checked with a real move), ``sharing`` (resident prefixes in owner sequences), ``netlocal``
(is a server on this host).

Below ``coordinator`` and ``tiers``: it holds no request state, and may import only
``metrics`` (and ``proxy.core``, ``proxy.errors``, ``proxy.config``).
"""
