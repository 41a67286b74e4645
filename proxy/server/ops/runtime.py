"""The running proxy's state: configuration, coordinator, metrics, tokenizer, background work."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

import aiohttp
import numpy as np
from aiohttp import web

from proxy.config import Config
from proxy.core.infill import PieceCache
from proxy.errors import BadRequest, Unavailable
from proxy.server.coordinator import Coordinator, ServerState
from proxy.server.dataplane.arena import Arena
from proxy.server.dataplane.backend import ServerClient
from proxy.server.dataplane.kvctl import Tokenized
from proxy.server.dataplane.layoutcheck import LayoutChecks
from proxy.server.http.recorder import Recorder
from proxy.server.metrics import Metrics
from proxy.server.ops.health import HealthMonitor
from proxy.server.ops.models import ModelEntry
from proxy.tokenizer import PromptTokenizer
from proxy.tokenizer.template import ChatTemplate

T = TypeVar("T")

# Prompts up to this many characters are tokenized on the event loop, piece by piece on the loop's
# own thread: for them the hop to a worker thread and back (two wake-ups), or to the tokenizer's
# own thread pool, costs more than the tokenizing (piece cache, ~50 us).
INLINE_TOKENIZE_CHARS = 4096


class PassthroughTurns:
    """At most ``limit`` read-only pass-through requests at once per server, each waiting up to
    ``timeout_s`` for its turn (then 503). They run on the server's few HTTP threads, which its
    /health shares: a flood of them must not take them all."""

    def __init__(self, limit: int, timeout_s: float) -> None:
        self.limit, self.timeout_s = limit, timeout_s
        self._turns: dict[str, asyncio.Semaphore] = {}  # by server URL

    @contextlib.asynccontextmanager
    async def turn(self, url: str) -> AsyncIterator[None]:
        turns = self._turns.setdefault(url, asyncio.Semaphore(self.limit))
        try:
            async with asyncio.timeout(self.timeout_s):
                await turns.acquire()
        except TimeoutError as exc:
            raise Unavailable(
                f"too many read-only requests are waiting for the server (--max-passthrough {self.limit}); "
                "try again"
            ) from exc
        try:
            yield
        finally:
            turns.release()


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
        self.n_vocab = 1 << 31  # the model's vocabulary size, read at startup
        self.health: HealthMonitor | None = None  # set by the app while it runs
        self.pending: list[tuple[str, str]] = []  # (name, url) of servers that did not answer yet
        self.layout_checks = LayoutChecks()  # verdicts of servers still pending, by instance
        self.arena: Arena | None = None  # the host tree's KV memory (startup), None without
        self.local_tokenizer: PromptTokenizer | None = None
        self.tokenizer_note = "server"
        # Served models by name (startup); the attributes above describe the first one.
        self.models: dict[str, ModelEntry] = {}
        self.template: ChatTemplate | None = None  # the first model's, where it renders as the server's
        self.template_note = "server"
        self._tasks: set[asyncio.Task[Any]] = set()
        self.passthrough = PassthroughTurns(config.max_passthrough, config.queue_timeout_s)
        self.infill_pieces: dict[str, PieceCache] = {}  # /infill's tokenized pieces, by model namespace

    async def render(
        self, body: dict[str, Any], headers: dict[str, str], model: ModelEntry | None = None
    ) -> str:
        """The chat request's prompt exactly as the server renders it: locally when the model's
        template passed the startup parity check and the request has the plain shape, else by a
        server of the model."""
        template = model.template if model is not None else self.template
        if template is not None:
            prompt = template.render(body)
            if prompt is not None:
                return prompt
        name = model.name if model is not None else ""
        return await self.on_any_server(lambda backend: backend.apply_template(body, headers), name)

    async def tokenize(self, prompt: str, model: ModelEntry | None = None) -> np.ndarray:
        """The prompt's tokens exactly as the server's chat path makes them."""
        local = model.local_tokenizer if model is not None else self.local_tokenizer
        if local is not None:
            if len(prompt) <= INLINE_TOKENIZE_CHARS:
                ids = local.encode(prompt, batch=False)
            else:
                ids = await asyncio.to_thread(local.encode, prompt)
        else:
            name = model.name if model is not None else ""
            ids = await self.on_any_server(
                lambda b: b.tokenize(prompt, add_special=True, parse_special=True), name
            )
        return np.asarray(ids, dtype=np.int32)

    async def media_tokens(self, body: dict[str, Any], model: ModelEntry) -> Tokenized:
        """A chat request with media, tokenized by a server with a projector exactly as its
        completion will be (``/kvctl/tokenize``: the media chunks' cells keyed by their content
        hash); the proxy never guesses media tokens. The keys depend on the server (its
        projector, image token limits, draft model): the tokenization carries the answering
        server's ``media_keys``, and only servers keying alike take the request (``Leases``)."""
        if not any(s.media_marker for s in self.coordinator.servers if s.model == model.name):
            raise BadRequest(
                f"image, audio and video input is not supported by model {model.name!r}: none of its "
                "servers loaded a projector (--mmproj)"
            )

        async def tokenize(server: ServerState) -> Tokenized:
            return replace(await server.client.kvctl_tokenize(body), keys=server.media_keys)

        return await self._on_server(tokenize, model.name, media=True)

    def _healthy(self, model: str, media: bool = False) -> ServerState | None:
        return next(
            (
                s
                for s in self.coordinator.servers
                if s.healthy and (not model or s.model == model) and (s.media_marker or not media)
            ),
            None,
        )

    async def on_any_server(self, call: Callable[[ServerClient], Awaitable[T]], model: str = "") -> T:
        """``call`` on a healthy server of ``model`` ("" = any): template rendering, tokenizing;
        one that fails to answer is marked down and the next is tried. Waits, bounded by the
        queue deadline, while none is serving."""
        return await self._on_server(lambda server: call(server.client), model)

    async def _on_server(
        self, call: Callable[[ServerState], Awaitable[T]], model: str = "", media: bool = False
    ) -> T:
        """``on_any_server`` on the server's state; ``media``: only servers with a projector."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.queue_timeout_s
        for _ in range(2 * len(self.coordinator.servers)):
            server = self._healthy(model, media)
            while server is None:
                if loop.time() > deadline:
                    raise Unavailable("no llama-server is serving")
                await asyncio.sleep(0.1)
                server = self._healthy(model, media)
            try:
                return await call(server)
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
