"""The running proxy's state: configuration, coordinator, metrics, tokenizer, background work."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import aiohttp
import numpy as np
from aiohttp import web

from proxy.config import Config
from proxy.errors import Unavailable
from proxy.server.backend import Backend
from proxy.server.coordinator import Coordinator
from proxy.server.health import HealthMonitor
from proxy.server.metrics import Metrics
from proxy.server.recorder import Recorder
from proxy.tokenizer import PromptTokenizer
from proxy.tokenizer.template import ChatTemplate

T = TypeVar("T")

# Prompts up to this many characters are tokenized on the event loop: for them the hop to a
# worker thread and back (two wake-ups) costs more than the tokenizing (piece cache, ~50 us).
INLINE_TOKENIZE_CHARS = 4096


class Runtime:
    """What the request handlers share; built by ``startup.create_runtime``, owned by the app."""

    def __init__(
        self,
        config: Config,
        session: aiohttp.ClientSession,
        coordinator: Coordinator,
        metrics: Metrics,
        recorder: Recorder | None = None,
    ) -> None:
        self.config = config
        self.session = session
        self.coordinator = coordinator
        self.metrics = metrics
        self.recorder = recorder
        self.primary = coordinator.servers[0].backend
        self.n_vocab = 1 << 31  # the model's vocabulary size, read at startup
        self.health: HealthMonitor | None = None  # set by the app while it runs
        self.pending: list[tuple[str, str]] = []  # (name, url) of servers that did not answer yet
        self.local_tokenizer: PromptTokenizer | None = None
        self.tokenizer_note = "server"
        self.template: ChatTemplate | None = None  # the chat template, where it renders as the server's
        self.template_note = "server"
        self._tasks: set[asyncio.Task[Any]] = set()

    async def render(self, body: dict[str, Any], headers: dict[str, str]) -> str:
        """The chat request's prompt exactly as the server renders it: locally when the template
        passed the startup parity check and the request has the plain shape, else by the server."""
        if self.template is not None:
            prompt = self.template.render(body)
            if prompt is not None:
                return prompt
        return await self.on_any_server(lambda backend: backend.apply_template(body, headers))

    async def tokenize(self, prompt: str) -> np.ndarray:
        """The prompt's tokens exactly as the server's chat path makes them."""
        if self.local_tokenizer is not None:
            if len(prompt) <= INLINE_TOKENIZE_CHARS:
                ids = self.local_tokenizer.encode(prompt)
            else:
                ids = await asyncio.to_thread(self.local_tokenizer.encode, prompt)
        else:
            ids = await self.on_any_server(lambda b: b.tokenize(prompt, add_special=True, parse_special=True))
        return np.asarray(ids, dtype=np.int32)

    async def on_any_server(self, call: Callable[[Backend], Awaitable[T]]) -> T:
        """``call`` on a healthy server (template rendering, tokenizing: any server does); one
        that fails to answer is marked down and the next is tried. Waits, bounded by the queue
        deadline, while none is serving."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.queue_timeout_s
        for _ in range(2 * len(self.coordinator.servers)):
            server = next((s for s in self.coordinator.servers if s.healthy), None)
            while server is None:
                if loop.time() > deadline:
                    raise Unavailable("no llama-server is serving")
                await asyncio.sleep(0.1)
                server = next((s for s in self.coordinator.servers if s.healthy), None)
            try:
                return await call(server.backend)
            except aiohttp.ClientConnectionError as exc:  # refused, reset: it is gone
                self.coordinator.server_down(server, f"{type(exc).__name__}: {exc}")
            except TimeoutError as exc:
                # Slow, not necessarily dead (a huge prompt takes long to render): only the
                # health monitor takes a server out for slowness.
                raise Unavailable(f"llama-server did not answer in time: {exc or 'timeout'}") from exc
        raise Unavailable("no llama-server answered")

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
