"""HTTP client for one (patched) llama-server: completions pass-through and the /kvctl API."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import aiohttp
import msgpack
import orjson

from proxy.errors import BackendError, KvMoveError


class Backend:
    """One llama-server. All KV moves on it are serialized by the coordinator's lock."""

    def __init__(self, url: str, session: aiohttp.ClientSession, kvctl_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.session = session
        self._auth = {"Authorization": f"Bearer {kvctl_key}"} if kvctl_key else {}

    # ---- plain server API -------------------------------------------------------------

    async def get_json(self, path: str) -> Any:
        async with self.session.get(self.url + path) as resp:
            return await self._json(resp, path)

    async def post_json(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> Any:
        async with self.session.post(self.url + path, data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json", **(headers or {})}) as resp:
            return await self._json(resp, path)

    async def apply_template(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> str:
        """The prompt exactly as the server's chat path renders it."""
        data = await self.post_json("/apply-template", body, headers)
        return str(data["prompt"])

    async def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        data = await self.post_json("/tokenize", {"content": text, "add_special": add_special,
                                                  "parse_special": parse_special})
        return [int(t) for t in data["tokens"]]

    @staticmethod
    async def _json(resp: aiohttp.ClientResponse, what: str) -> Any:
        raw = await resp.read()
        try:
            data = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            data = {"error": {"message": raw[:200].decode(errors="replace")}}
        if resp.status >= 400:
            raise backend_error(resp.status, data, what)
        return data

    # ---- /kvctl -----------------------------------------------------------------------

    async def kv_get(self, route: str, params: Mapping[str, str] | None = None) -> Any:
        async with self.session.get(f"{self.url}/kvctl/{route}", params=params, headers=self._auth) as resp:
            return await self._json(resp, f"/kvctl/{route}")

    async def kv_post(self, route: str, body: Mapping[str, Any], cause: str) -> Any:
        """POST a /kvctl operation; a refusal becomes a KvMoveError naming ``cause``."""
        has_bytes = any(isinstance(v, bytes | bytearray | memoryview) for v in _walk(body))
        if has_bytes:
            data = msgpack.packb(body, use_bin_type=True)
            headers = {**self._auth, "Content-Type": "application/msgpack", "Accept": "application/msgpack"}
        else:
            data = orjson.dumps(body)
            headers = {**self._auth, "Content-Type": "application/json"}
        async with self.session.post(f"{self.url}/kvctl/{route}", data=data, headers=headers) as resp:
            raw = await resp.read()
            try:
                if resp.content_type == "application/msgpack":
                    reply = msgpack.unpackb(raw, raw=False)
                else:
                    reply = orjson.loads(raw) if raw else {}
            except (ValueError, msgpack.UnpackException) as exc:
                raise KvMoveError(cause, f"/kvctl/{route}: unreadable reply ({exc})") from exc
            if resp.status >= 400:
                message = (reply.get("error") or {}).get("message", str(reply)) if isinstance(reply, dict) else reply
                raise KvMoveError(cause, f"/kvctl/{route} answered {resp.status}: {message}")
            return reply

    async def caps(self) -> dict[str, Any]:
        return dict(await self.kv_get("caps"))

    async def slots(self, tokens: bool = False) -> dict[str, Any]:
        return dict(await self.kv_get("slots", {"tokens": "1"} if tokens else None))

    async def cells(self) -> dict[str, Any]:
        return dict(await self.kv_get("cells"))

    async def export(self, seq: Mapping[str, int], p0: int, p1: int, file: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {**seq, "p0": p0, "p1": p1}
        if file:
            body["file"] = file
        reply = dict(await self.kv_post("export", body, cause="export"))
        if isinstance(reply.get("data"), str):
            reply["data"] = base64.b64decode(reply["data"])
        return reply


def backend_error(status: int, data: Any, what: str) -> BackendError:
    """A server error kept as the server said it: a 4xx passes through with its status."""
    err = data.get("error") if isinstance(data, dict) else None
    message = str(err.get("message", err)) if isinstance(err, dict) else str(err or data)
    exc = BackendError(message if status < 500 else f"llama-server {what} failed ({status}): {message}",
                       backend_status=status, backend_message=message)
    if 400 <= status < 500:
        exc.status = status
        exc.err_type = str(err.get("type", "invalid_request_error")) if isinstance(err, dict) else exc.err_type
    return exc


def _walk(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [x for v in value.values() for x in _walk(v)]
    if isinstance(value, list | tuple):
        return [x for v in value for x in _walk(v)]
    return [value]
