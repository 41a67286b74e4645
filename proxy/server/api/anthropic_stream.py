"""A streamed chat answer (OpenAI chunks) rewritten as Anthropic Messages events.

The events are the server's own (``to_json_anthropic`` of its partial and final results in
``tools/server/server-task.cpp``): ``message_start`` with the prompt's usage, then content
blocks in the order thinking (index 0), text, tool_use (one per call, indexed after those),
each opened by ``content_block_start``, filled by ``content_block_delta`` (``thinking_delta``,
``text_delta``, ``input_json_delta``) and closed by ``content_block_stop`` (a thinking block
gets an empty ``signature_delta`` first), then ``message_delta`` (stop reason, stop
sequence, output tokens) and ``message_stop``. A stream that breaks, or an error the server
sends mid-stream, ends with an ``error`` event in Anthropic's shape.

One difference from the server: when its final result carries content that no partial did,
the server opens that block a second time; here a block is opened once.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.server.api.anthropic import error_body, event, stop_reason, usage
from proxy.server.dataplane.wire import LineSplitter


class EventStream:
    """Feed it the chat stream's bytes as they come; it returns Anthropic SSE bytes."""

    def __init__(self, show: bool, prompt_tokens: int) -> None:
        self.show = show
        self.prompt_tokens = prompt_tokens  # the proxy's count, when no timings came
        self._lines = LineSplitter()
        self._started = False
        self._done = False
        self._thinking = False
        self._text = False
        self._tools: dict[int, int] = {}  # tool call index -> content block index
        self._timings: dict[str, Any] = {}
        self._finish: Any = None
        self._stop_word: str | None = None
        self._output = 0
        self.id = ""
        self.model = ""

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(self._line(line) for line in self._lines.feed(chunk))

    def flush(self) -> bytes:
        rest = self._lines.rest()
        out = self._line(rest) if rest else b""
        if not self._done and self._finish is not None:
            out += self._close()
        elif not self._done:  # the chat stream ended without an answer's end
            out += self.error("llama-server ended the stream before the answer was complete")
        return out

    def error(self, message: str, status: int = 502, llama_type: str = "server_error") -> bytes:
        self._done = True
        return event("error", error_body(status, message, llama_type))

    # ---- one SSE line ---------------------------------------------------------------------

    def _line(self, line: bytes) -> bytes:
        if self._done:
            return b""
        if line.startswith(b":"):
            return line + b"\n\n"  # the server's keep-alive ping, a comment in SSE
        if not line.startswith(b"data: "):
            return b""
        payload = line[6:].strip()
        if payload == b"[DONE]":
            return self._close() if self._finish is not None else b""
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return b""
        if not isinstance(data, dict):
            return b""
        err = data.get("error")
        if err is not None:
            if isinstance(err, dict):
                code = err.get("code")
                return self.error(
                    str(err.get("message", "")),
                    code if isinstance(code, int) else 500,
                    str(err.get("type", "server_error")),
                )
            return self.error(str(err))
        return self._chunk(data)

    def _chunk(self, data: dict[str, Any]) -> bytes:
        self.id = str(data.get("id", self.id))
        self.model = str(data.get("model", self.model))
        if isinstance(data.get("timings"), dict):
            self._timings = data["timings"]
        verbose = data.get("__verbose")
        if isinstance(verbose, dict) and isinstance(verbose.get("stopping_word"), str):
            self._stop_word = verbose["stopping_word"] or None
        use = data.get("usage")
        if isinstance(use, dict):
            self._output = int(use.get("completion_tokens", self._output))
        out = b""
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if not self._started and (_has_content(delta) or choice.get("finish_reason") is not None):
                out += self._start()
            out += self._delta(delta)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        if isinstance(use, dict) and self._finish is not None:
            out += self._close()  # the usage chunk is the chat stream's last
        return out

    def _start(self) -> bytes:
        self._started = True
        if self._timings:
            cached = int(self._timings.get("cache_n", 0))
            prompt = cached + int(self._timings.get("prompt_n", 0))
        else:
            cached, prompt = 0, self.prompt_tokens
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(prompt, cached, 0, self.show),
        }
        return event("message_start", {"type": "message_start", "message": message})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        out = b""
        thinking = delta.get("reasoning_content")
        if isinstance(thinking, str) and thinking:
            if not self._thinking:
                self._thinking = True
                out += _block_start(0, {"type": "thinking", "thinking": ""})
            out += _block_delta(0, {"type": "thinking_delta", "thinking": thinking})
        text = delta.get("content")
        if isinstance(text, str) and text:
            index = 1 if self._thinking else 0
            if not self._text:
                self._text = True
                out += _block_start(index, {"type": "text", "text": ""})
            out += _block_delta(index, {"type": "text_delta", "text": text})
        for call in delta.get("tool_calls") or []:
            out += self._tool(call)
        return out

    def _tool(self, call: dict[str, Any]) -> bytes:
        out = b""
        n = int(call.get("index", 0))
        fn = call.get("function") or {}
        if n not in self._tools:
            index = int(self._thinking) + int(self._text) + n
            self._tools[n] = index
            block = {"type": "tool_use", "id": call.get("id", ""), "name": fn.get("name", "")}
            out += _block_start(index, block)
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            out += _block_delta(self._tools[n], {"type": "input_json_delta", "partial_json": args})
        return out

    def _close(self) -> bytes:
        if self._done:
            return b""
        self._done = True
        out = b"" if self._started else self._start()
        if self._thinking:
            out += _block_delta(0, {"type": "signature_delta", "signature": ""})
            out += _block_stop(0)
        if self._text:
            out += _block_stop(1 if self._thinking else 0)
        for n in sorted(self._tools):
            out += _block_stop(self._tools[n])
        delta = {"stop_reason": stop_reason(self._finish), "stop_sequence": self._stop_word}
        out += event(
            "message_delta",
            {"type": "message_delta", "delta": delta, "usage": {"output_tokens": self._output}},
        )
        return out + event("message_stop", {"type": "message_stop"})


def _has_content(delta: dict[str, Any]) -> bool:
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


def _block_start(index: int, block: dict[str, Any]) -> bytes:
    return event(
        "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}
    )


def _block_delta(index: int, delta: dict[str, Any]) -> bytes:
    return event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def _block_stop(index: int) -> bytes:
    return event("content_block_stop", {"type": "content_block_stop", "index": index})
