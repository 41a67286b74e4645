"""The running proxy's state: configuration, coordinator, metrics, tokenizer, background work."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from proxy.config import Config
from proxy.server.coordinator import Coordinator
from proxy.server.health import HealthMonitor
from proxy.server.metrics import Metrics
from proxy.server.recorder import Recorder
from proxy.tokenizer import PromptTokenizer


class Runtime:
    """What the request handlers share; built by ``startup.create_runtime``, owned by the app."""

    def __init__(self, config: Config, session: aiohttp.ClientSession, coordinator: Coordinator,
                 metrics: Metrics, recorder: Recorder | None = None) -> None:
        self.config = config
        self.session = session
        self.coordinator = coordinator
        self.metrics = metrics
        self.recorder = recorder
        self.primary = coordinator.servers[0].backend
        self.n_vocab = 1 << 31  # the model's vocabulary size, read at startup
        self.health: HealthMonitor | None = None  # set by the app while it runs
        self.local_tokenizer: PromptTokenizer | None = None
        self.tokenizer_note = "server"
        self._tasks: set[asyncio.Task[Any]] = set()

    async def tokenize(self, prompt: str) -> np.ndarray:
        """The prompt's tokens exactly as the server's chat path makes them."""
        if self.local_tokenizer is not None:
            ids = await asyncio.to_thread(self.local_tokenizer.encode, prompt)
        else:
            ids = await self.primary.tokenize(prompt, add_special=True, parse_special=True)
        return np.asarray(ids, dtype=np.int32)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Background work (saving KV after an answer) that must not be garbage-collected."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for background work (saves) to end; False when ``timeout_s`` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._tasks:
                    await asyncio.gather(*list(self._tasks), return_exceptions=True)
        except TimeoutError:
            return False
        return True


RUNTIME: web.AppKey[Runtime] = web.AppKey("runtime", Runtime)
