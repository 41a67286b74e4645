"""What every request crosses on its way to a server and back, whatever its API.

``front`` (the trust boundary: what the proxy accepts from clients and what it tells them),
``limits`` (what one request may make a server spend), ``forward`` (a completion to the
leased slot's server and its answer relayed back), ``connections`` (bounds on client
connections), ``recorder`` (received requests as a replayable manifest).

Below ``api`` and ``ops``: it knows no API (an answer's shape is handed to ``forward``) and may
import ``coordinator``, ``tiers``, ``dataplane`` and ``metrics``.
"""
