"""Record the completion requests the proxy receives as a replayable manifest.

The format is the one `radixctl bench` writes and `radixctl bench replay` reads: JSON lines
``{"t", "id", "session", "group", "via", "path", "body"}`` with ``t`` the arrival time in
seconds from the first recorded request and ``body`` the request exactly as the client sent
it (before the proxy sets ``id_slot`` and ``cache_prompt``), less its ``cache_salt``: the
manifest holds every tenant's prompts, so it is the operator's alone (created 0600), and a
replay should not carry a tenant's isolation key.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

import orjson

from proxy.server.http.front import SALT_FIELD


class Recorder:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)  # one left by an earlier run may have been readable by others
        # Long-lived, line-buffered: a crash keeps what was seen. Closed by Runtime.close().
        self._handle = os.fdopen(fd, "a", buffering=1)
        self._start: float | None = None
        self._ids = itertools.count(1)

    def append(self, path: str, body: dict[str, Any], session: str = "") -> None:
        body.pop(SALT_FIELD, None)
        now = time.monotonic()
        if self._start is None:
            self._start = now
        line = {
            "t": round(now - self._start, 6),
            "id": f"rec{next(self._ids)}",
            "session": session,
            "group": "recorded",
            "via": "front",
            "path": path,
            "body": body,
        }
        self._handle.write(orjson.dumps(line).decode() + "\n")

    def close(self) -> None:
        self._handle.close()
