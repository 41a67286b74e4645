"""One streamed chat completion against an OpenAI base URL, with what the proxy said about it.

Plain aiohttp rather than an SDK: the trace needs the exact body sent, the ``X-Radix-*``
answer headers and llama-server's ``timings`` in the last chunk, which SDKs hide. A model
is anything with ``complete(body, on_text)``; tests give the agent graph a scripted one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

OnText = Callable[[str], Awaitable[None]]


@dataclass
class Reply:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # [{"id", "name", "arguments"}]
    finish_reason: str | None = None
    status: int = 200
    error: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # the X-Radix-* ones
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    ttft_s: float | None = None
    e2e_s: float | None = None


class ChatModel(Protocol):
    async def complete(self, body: dict[str, Any], on_text: OnText | None = None) -> Reply: ...


class OpenAIModel:
    """``POST {base_url}/chat/completions`` with ``stream: true``."""

    def __init__(
        self, base_url: str, http: aiohttp.ClientSession, api_key: str = "", timeout_s: float = 600
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.http, self.api_key, self.timeout_s = http, api_key, timeout_s

    async def complete(self, body: dict[str, Any], on_text: OnText | None = None) -> Reply:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        reply, started = Reply(), time.monotonic()
        calls: dict[int, dict[str, Any]] = {}
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with self.http.post(self.url, json=body, headers=headers, timeout=timeout) as resp:
                reply.status = resp.status
                reply.headers = {k: v for k, v in resp.headers.items() if k.lower().startswith("x-radix-")}
                if resp.status != 200:
                    reply.error = _error_text(await resp.text())
                    return reply
                async for data in _events(resp):
                    await _take(data, reply, calls, started, on_text)
        except (aiohttp.ClientError, TimeoutError) as exc:
            reply.error = f"{type(exc).__name__}: {exc}"
        reply.e2e_s = time.monotonic() - started
        reply.tool_calls = [_finish_call(c) for _, c in sorted(calls.items())]
        return reply


async def _events(resp: aiohttp.ClientResponse) -> Any:
    """The JSON payload of each ``data:`` line of a server-sent event stream."""
    async for raw in resp.content:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            yield json.loads(payload)
        except ValueError:
            continue


async def _take(
    data: Any, reply: Reply, calls: dict[int, dict[str, Any]], started: float, on_text: OnText | None
) -> None:
    if not isinstance(data, dict):
        return
    if "error" in data:
        reply.error = _error_text(json.dumps(data))
    reply.usage = data.get("usage") or reply.usage
    reply.timings = data.get("timings") or reply.timings
    for choice in data.get("choices") or []:
        delta = choice.get("delta") or {}
        piece = delta.get("content") or ""
        if piece or delta.get("tool_calls"):
            reply.ttft_s = reply.ttft_s if reply.ttft_s is not None else time.monotonic() - started
        if piece:
            reply.content += piece
            if on_text is not None:
                await on_text(piece)
        for tc in delta.get("tool_calls") or []:
            slot = calls.setdefault(int(tc.get("index", 0)), {"id": "", "name": "", "arguments": ""})
            fn = tc.get("function") or {}
            slot["id"] = tc.get("id") or slot["id"]
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
        reply.finish_reason = choice.get("finish_reason") or reply.finish_reason


def _finish_call(call: dict[str, Any]) -> dict[str, Any]:
    try:
        args = json.loads(call["arguments"] or "{}")
    except ValueError:
        args = {"_unparsed": call["arguments"]}
    return {"id": call["id"], "name": call["name"], "arguments": args}


def _error_text(raw: str) -> str:
    try:
        data = json.loads(raw)
        return str(data["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:300]
