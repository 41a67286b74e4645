"""HTTP client for one (patched) llama-server: completions pass-through and the /kvctl API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import aiohttp
import msgpack
import numpy as np
import orjson

from proxy.core.payload import tokens_sha256
from proxy.errors import BackendError, FallbackCause, KvMoveError, RadixError
from proxy.server.dataplane.kvctl import Caps, Cells, KvRoute, SeqInfo, Slots, Tokenized
from proxy.server.dataplane.kvctl_moves import (
    CheckpointReply,
    EraseReply,
    ExportReply,
    ImportReply,
    ReleaseReply,
    RestoreReply,
)
from proxy.server.dataplane.wire import json_or_error

log = logging.getLogger("radix")

# llama-server's HTTP library closes a kept-alive connection after a few idle seconds or
# 100 requests; a request sent on such a connection fails before the server read it, so
# one retry on a fresh connection is safe.
_STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
# What a call to a server may raise besides the proxy's own errors: the connection failed or
# broke (timeouts are OSErrors). Callers above the client catch these without aiohttp.
TRANSPORT_ERRORS: tuple[type[Exception], ...] = (aiohttp.ClientError, OSError)

# Request headers llama-server reads as its API key.
_CREDENTIALS = {"authorization", "x-api-key"}

# Deadlines (invariant 8: every wait has a bound). Template, tokenize and /props are answered
# by the server's HTTP threads; /kvctl reads wait for its main loop (a decode step); a KV move
# gets a base plus time for its bytes at a pessimistic rate.
PLAIN_TIMEOUT = aiohttp.ClientTimeout(total=10, sock_connect=5)
KV_READ_TIMEOUT = aiohttp.ClientTimeout(total=60, sock_connect=5)
MOVE_BASE_S = 30.0
MOVE_MIN_RATE = 20e6  # bytes/s


def move_timeout_s(nbytes: int) -> float:
    return MOVE_BASE_S + nbytes / MOVE_MIN_RATE


class ServerClient:
    """The HTTP client of one llama-server: its plain API and its /kvctl routes, whose replies
    are parsed into typed replies (proxy/server/dataplane/kvctl.py) here. All KV moves on it are
    serialized by the coordinator's lock."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        kvctl_key: str | None = None,
        read_timeout_s: float = 600.0,
        total_timeout_s: float | None = None,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        # The server's own API key (its --api-key-file): sent on every call but /kvctl, which
        # has its own; it replaces whatever credentials a client's request carried.
        self._api_key = api_key
        self.session = session
        # A completion: no byte for read_timeout_s (a long prefill sends none) or the whole
        # answer past total_timeout_s ends it.
        self.completion_timeout = aiohttp.ClientTimeout(
            total=total_timeout_s, sock_connect=5, sock_read=read_timeout_s
        )
        self._auth = {"Authorization": f"Bearer {kvctl_key}"} if kvctl_key else {}
        # The server process's random id (from the first /kvctl reply, normally caps): a reply
        # with another id comes from a restarted server whose KV and slot state are gone.
        self.instance: str | None = None
        self._instance_logged = False

    # ---- plain server API -------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, path: str, retry_stale: bool = True, **kw: Any
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request, retried once if a pooled connection turned out to be closed (unless
        ``retry_stale`` is off: the caller decides whether sending it again is safe)."""
        kw.setdefault("timeout", PLAIN_TIMEOUT)
        if self._api_key and not path.startswith("/kvctl/"):
            kw["headers"] = self.with_api_key(kw.get("headers"))
        for attempt in (0, 1):
            try:
                resp = await self.session.request(method, self.url + path, **kw)
                break
            except _STALE:
                if attempt or not retry_stale:
                    raise
        try:
            yield resp
        finally:
            resp.release()

    def with_api_key(self, headers: Mapping[str, str] | None) -> dict[str, str]:
        kept = {k: v for k, v in (headers or {}).items() if k.lower() not in _CREDENTIALS}
        return {**kept, "Authorization": f"Bearer {self._api_key}"}

    def post_stream(
        self, path: str, data: bytes, headers: Mapping[str, str]
    ) -> contextlib.AbstractAsyncContextManager[aiohttp.ClientResponse]:
        # Not retried here: a completion after which the server died must not be sent again
        # (routes._steered asks whether the server survived it).
        return self.request(
            "POST", path, retry_stale=False, data=data, headers=headers, timeout=self.completion_timeout
        )

    async def get_json(self, path: str) -> Any:
        async with self.request("GET", path) as resp:
            return await self._json(resp, path)

    async def post_json(
        self,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str] | None = None,
        timeout: aiohttp.ClientTimeout = PLAIN_TIMEOUT,
    ) -> Any:
        async with self.request(
            "POST",
            path,
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json", **(headers or {})},
            timeout=timeout,
        ) as resp:
            return await self._json(resp, path)

    async def apply_template(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> str:
        """The prompt exactly as the server's chat path renders it."""
        data = await self.post_json("/apply-template", body, headers)
        return str(data["prompt"])

    async def kvctl_tokenize(self, body: Mapping[str, Any]) -> Tokenized:
        """A chat request's tokens as its completion makes them, media chunks keyed as the moves
        key them (patch 0027); the server's own error (a bad image: 400) as a BackendError."""
        return Tokenized.parse(await self.post_json("/kvctl/tokenize", body, self._auth))

    async def tokenize(
        self, text: str | list[str | int], add_special: bool, parse_special: bool = True
    ) -> list[int]:
        """``text``: a string, or strings and token ids (the server's tokenize_mixed)."""
        data = await self.post_json(
            "/tokenize", {"content": text, "add_special": add_special, "parse_special": parse_special}
        )
        return [int(t) for t in data["tokens"]]

    @staticmethod
    async def _json(resp: aiohttp.ClientResponse, what: str) -> Any:
        raw = await resp.read()
        data = json_or_error(raw) if raw else {}
        if resp.status >= 400:
            raise backend_error(resp.status, data, what)
        return data

    # ---- /kvctl -----------------------------------------------------------------------

    def check_instance(self, reply: Any, route: KvRoute, adopt: bool = False) -> None:
        """Refuse a reply from another server process than the one this proxy knows at this URL.

        ``adopt`` (caps only: the startup handshake and the health monitor, which resets the
        slot table and residents of a new instance in the same step) takes the new id instead."""
        got = reply.get("instance") if isinstance(reply, dict) else None
        if not isinstance(got, str):
            return
        if self.instance is None or (adopt and got != self.instance):
            if self.instance is not None:
                log.warning("%s: llama-server is a new instance (%s, was %s)", self.url, got, self.instance)
            self.instance, self._instance_logged = got, False
        elif got != self.instance:
            if not self._instance_logged:
                self._instance_logged = True
                log.error(
                    "%s: llama-server restarted (instance %s, was %s): its KV state is gone; "
                    "refusing its /kvctl replies",
                    self.url,
                    got,
                    self.instance,
                )
            raise KvMoveError(
                FallbackCause.INSTANCE,
                f"/kvctl/{route}: another server instance ({got}, expected {self.instance})",
            )

    async def kv_get(
        self, route: KvRoute, params: Mapping[str, str] | None = None, adopt: bool = False
    ) -> Any:
        """GET a /kvctl route: the reply as sent (the typed getters below parse it)."""
        try:
            async with self.request(
                "GET", f"/kvctl/{route}", params=params, headers=self._auth, timeout=KV_READ_TIMEOUT
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except aiohttp.ClientError as exc:
            raise KvMoveError(FallbackCause.TRANSPORT, f"/kvctl/{route}: {exc}") from exc
        except TimeoutError as exc:
            raise KvMoveError(FallbackCause.TIMEOUT, f"/kvctl/{route}: no answer in time") from exc
        data = json_or_error(raw) if raw else {}
        self.check_instance(data, route, adopt)
        if status >= 400:
            raise backend_error(status, data, f"/kvctl/{route}")
        return data

    async def kv_post(
        self, route: KvRoute, body: Mapping[str, Any], cause: FallbackCause, timeout_s: float = MOVE_BASE_S
    ) -> Any:
        """POST a /kvctl operation; a refusal becomes a KvMoveError naming ``cause``, no
        answer within ``timeout_s`` a KvMoveError(TIMEOUT). The reply as sent: the typed
        operations below parse it."""
        has_bytes = any(isinstance(v, bytes | bytearray | memoryview) for v in _walk(body))
        if has_bytes:
            data = msgpack.packb(body, use_bin_type=True)
            headers = {**self._auth, "Content-Type": "application/msgpack", "Accept": "application/msgpack"}
        else:
            data = orjson.dumps(body)
            headers = {**self._auth, "Content-Type": "application/json"}
            if route in (KvRoute.EXPORT, KvRoute.CHECKPOINT) and "file" not in body:
                # An inline export: its KV comes back as msgpack bin (raw bytes), not base64 in JSON.
                headers["Accept"] = "application/msgpack"
        try:
            async with self.request(
                "POST",
                f"/kvctl/{route}",
                data=data,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=5),
            ) as resp:
                raw = await resp.read()
                status, content_type = resp.status, resp.content_type
        except aiohttp.ClientError as exc:
            raise KvMoveError(FallbackCause.TRANSPORT, f"/kvctl/{route}: {exc}") from exc
        except TimeoutError as exc:
            raise KvMoveError(
                FallbackCause.TIMEOUT, f"/kvctl/{route}: no answer within {timeout_s:.0f} s"
            ) from exc
        try:
            reply = (
                msgpack.unpackb(raw, raw=False)
                if content_type == "application/msgpack"
                else (orjson.loads(raw) if raw else {})
            )
        except (ValueError, msgpack.UnpackException) as exc:
            raise KvMoveError(cause, f"/kvctl/{route}: unreadable reply ({exc})") from exc
        self.check_instance(reply, route)
        if status == 409:
            # the slot or owner does not hold what the move names (or is busy): nothing changed
            cause = FallbackCause.CONFLICT
        if status >= 400:
            message = (
                (reply.get("error") or {}).get("message", str(reply)) if isinstance(reply, dict) else reply
            )
            raise KvMoveError(cause, f"/kvctl/{route} answered {status}: {message}")
        return reply

    async def survived(self, instance: str | None, timeout_s: float = 5.0) -> bool:
        """Whether the server process ``instance`` still answers here (not dead, not replaced)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.kv_get(KvRoute.CAPS)
        except (RadixError, TimeoutError):
            return False
        return instance is None or self.instance == instance

    async def caps(self) -> Caps:
        """The server's capabilities; a new instance id is adopted here (see check_instance)."""
        return Caps.parse(await self.kv_get(KvRoute.CAPS, adopt=True))

    async def slots(self, tokens: bool = False) -> Slots:
        return Slots.parse(await self.kv_get(KvRoute.SLOTS, {"tokens": "1"} if tokens else None))

    async def cells(self) -> Cells:
        return Cells.parse(await self.kv_get(KvRoute.CELLS))

    async def export(
        self,
        seq: Mapping[str, int],
        p0: int,
        tokens: Sequence[int] | np.ndarray,
        file: str | None,
        timeout_s: float = MOVE_BASE_S,
        in_place: bool = False,
        chunk: int = 0,
        offsets: Sequence[int] = (),
    ) -> ExportReply:
        """Export ``[p0, len(tokens))`` of a sequence that must hold ``tokens`` (else 409: CONFLICT).
        ``in_place``: into the existing ``file`` (its first bytes), not a new one; with ``chunk``
        and ``offsets`` (the arena), one blob per chunk of the range at its offset."""
        body: dict[str, Any] = {**seq, "p0": p0, "p1": len(tokens), "expect_sha256": tokens_sha256(tokens)}
        if file:
            body["file"] = file
            if in_place:
                body["in_place"] = True
            if chunk:
                body["chunk"] = chunk
                body["offsets"] = list(offsets)
        reply = await self.kv_post(KvRoute.EXPORT, body, cause=FallbackCause.EXPORT, timeout_s=timeout_s)
        return ExportReply.parse(reply)

    async def import_(self, body: Mapping[str, Any], timeout_s: float = MOVE_BASE_S) -> ImportReply:
        """Write segments into an idle slot (the body as docs/kvctl.md's import; built by the mover)."""
        reply = await self.kv_post(KvRoute.IMPORT, body, cause=FallbackCause.IMPORT, timeout_s=timeout_s)
        return ImportReply.parse(reply)

    async def erase(self, slot: int) -> EraseReply:
        """Clear an idle slot's KV and tokens."""
        reply = await self.kv_post(KvRoute.ERASE, {"slot": slot}, cause=FallbackCause.ERASE)
        return EraseReply.parse(reply)

    async def release(self, owner: int) -> ReleaseReply:
        """Drop an owner sequence (a resident prefix)."""
        reply = await self.kv_post(KvRoute.RELEASE, {"owner": owner}, cause=FallbackCause.RELEASE)
        return ReleaseReply.parse(reply)

    async def publish(self, slot: int, owner: int, n: int, expect_sha256: str) -> SeqInfo:
        """The owner now holds the slot's ``[0, n)`` (shared cells); the owner's entry."""
        body = {"slot": slot, "owner": owner, "n": n, "expect_sha256": expect_sha256}
        reply = await self.kv_post(KvRoute.PUBLISH, body, cause=FallbackCause.PUBLISH)
        return SeqInfo.parse(reply, KvRoute.PUBLISH, FallbackCause.PUBLISH)

    async def attach(
        self,
        owner: int,
        slot: int,
        m: int,
        expect_sha256: str,
        lora: Sequence[Mapping[str, Any]] | None = None,
    ) -> SeqInfo:
        """The slot now holds the owner's ``[0, m)`` (shared cells); the slot's entry. ``lora``:
        the adapters its KV was computed with (None: the server's own), which the slot takes."""
        body: dict[str, Any] = {"owner": owner, "slot": slot, "m": m, "expect_sha256": expect_sha256}
        if lora is not None:
            body["lora"] = list(lora)
        reply = await self.kv_post(KvRoute.ATTACH, body, cause=FallbackCause.ATTACH)
        return SeqInfo.parse(reply, KvRoute.ATTACH, FallbackCause.ATTACH)

    async def checkpoint(self, slot: int, tokens: np.ndarray) -> CheckpointReply:
        """The whole state of ``slot`` after ``tokens`` (recurrent and hybrid memory), from the
        context checkpoint the server took at ``len(tokens)``; 409 (CONFLICT) when the slot does
        not hold these tokens, 404 when it kept no checkpoint there."""
        body = {"slot": slot, "n": len(tokens), "expect_sha256": tokens_sha256(tokens)}
        reply = await self.kv_post(KvRoute.CHECKPOINT, body, cause=FallbackCause.EXPORT)
        return CheckpointReply.parse(reply)

    async def prefill(
        self, slot: int, tokens: np.ndarray, lora: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[int, float]:
        """Compute ``tokens`` into ``slot`` (one token generated, not computed: the slot then
        holds exactly them); the server's prompt_n and prompt_ms. No deadline of its own: the
        caller bounds it (a long prompt on a busy CPU server takes minutes)."""
        body = {
            "prompt": [int(t) for t in tokens],
            "n_predict": 1,
            "id_slot": slot,
            "cache_prompt": True,
            "temperature": 0.0,
        }
        if lora is not None:
            body["lora"] = list(lora)
        reply = await self.post_json("/completion", body, timeout=aiohttp.ClientTimeout(total=None))
        timings = reply.get("timings") if isinstance(reply, dict) else None
        if not isinstance(timings, dict):
            return 0, 0.0
        return int(timings.get("prompt_n", 0) or 0), float(timings.get("prompt_ms", 0.0) or 0.0)

    async def restore(
        self, slot: int, tokens: np.ndarray, data: bytes, lora: Sequence[Mapping[str, Any]] | None = None
    ) -> RestoreReply:
        """Write a checkpoint of exactly ``tokens`` into an idle slot (the server checks it is
        theirs); on any failure the server cleared the slot."""
        body: dict[str, Any] = {"slot": slot, "tokens": tokens.tolist(), "segments": [{"data": data}]}
        if lora is not None:
            body["lora"] = list(lora)
        reply = await self.kv_post(
            KvRoute.RESTORE, body, cause=FallbackCause.IMPORT, timeout_s=move_timeout_s(len(data))
        )
        return RestoreReply.parse(reply)


def backend_error(status: int, data: Any, what: str) -> BackendError:
    """A server error kept as the server said it: a 4xx passes through with its status."""
    err = data.get("error") if isinstance(data, dict) else None
    message = str(err.get("message", err)) if isinstance(err, dict) else str(err or data)
    exc = BackendError(
        message if status < 500 else f"llama-server {what} failed ({status}): {message}",
        backend_status=status,
        backend_message=message,
    )
    if 400 <= status < 500:
        exc.status = status
        exc.err_type = (
            str(err.get("type", "invalid_request_error")) if isinstance(err, dict) else exc.err_type
        )
    return exc


def _walk(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [x for v in value.values() for x in _walk(v)]
    if isinstance(value, list | tuple):
        return [x for v in value for x in _walk(v)]
    return [value]
