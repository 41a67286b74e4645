"""What the coordinator needs from a server's client and from its KV mover, as Protocols.

``ServerClient`` (proxy/server/dataplane/backend.py) and ``KvMover`` (proxy/server/dataplane/mover.py) are the
implementations; the coordinator's unit tests give it fakes, which mypy checks against
these. The HTTP pass-through (completions, tokenize, ...) needs the real client:
``ServerState.client``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from proxy.core.payload import KvLayout, KvSegment
from proxy.server.dataplane.kvctl import Cells, SeqInfo, Slots
from proxy.server.dataplane.kvctl_moves import CheckpointReply, EraseReply, ReleaseReply, RestoreReply


class KvServer(Protocol):
    """A server's /kvctl operations the coordinator and resident sharing use."""

    @property
    def url(self) -> str: ...

    async def slots(self, tokens: bool = False) -> Slots: ...

    async def cells(self) -> Cells: ...

    async def erase(self, slot: int) -> EraseReply: ...

    async def release(self, owner: int) -> ReleaseReply: ...

    async def publish(self, slot: int, owner: int, n: int, expect_sha256: str) -> SeqInfo: ...

    async def attach(
        self,
        owner: int,
        slot: int,
        m: int,
        expect_sha256: str,
        lora: Sequence[Mapping[str, Any]] | None = None,
    ) -> SeqInfo: ...

    async def checkpoint(self, slot: int, tokens: np.ndarray) -> CheckpointReply: ...

    async def restore(
        self, slot: int, tokens: np.ndarray, data: bytes, lora: Sequence[Mapping[str, Any]] | None = None
    ) -> RestoreReply: ...

    # Compute ``tokens`` into the slot (a completion of one token, cache on): the server's own
    # prompt_n and prompt_ms. A wave's prefix step (coordinator/waves.py).
    async def prefill(
        self, slot: int, tokens: np.ndarray, lora: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[int, float]: ...


class Mover(Protocol):
    """KV between one server's slots and the host: export a range, import segments."""

    @property
    def layout(self) -> KvLayout | None: ...  # None: KV moves are off for this server

    @property
    def compat(self) -> dict[str, Any]: ...

    @property
    def shm_dir(self) -> Path | None: ...  # None: inline payloads

    @property
    def bytes_per_token(self) -> int: ...

    @property
    def chunk_tokens(self) -> int: ...  # positions per arena block (an export's chunks)

    async def export(
        self,
        seq: dict[str, int],
        p0: int,
        tokens: Sequence[int] | np.ndarray,
        hold: contextlib.AbstractAsyncContextManager[Any] | None = None,
    ) -> list[KvSegment]: ...

    async def import_(
        self,
        slot: int,
        p0: int,
        tokens: Sequence[int],
        segments: Sequence[KvSegment],
        hold: contextlib.AbstractAsyncContextManager[Any] | None = None,
        lora: Sequence[Mapping[str, Any]] | None = None,
        media: Sequence[Mapping[str, Any]] = (),
    ) -> None: ...

    def new_instance(self) -> None: ...  # the server is a new process: what it never answered is gone

    def close(self) -> None: ...
