"""The Anthropic Messages API (``/v1/messages``) on the proxy's chat path.

llama-server serves ``/v1/messages`` by converting the body to an OpenAI chat body
(``server_chat_convert_anthropic_to_oai`` in ``tools/server/server-chat.cpp``), then running
its chat path (``oaicompat_chat_params_parse``, the completion) and writing the answer in
Anthropic's shape. Its conversion builds a new body from a fixed list of fields, so a
request's ``id_slot`` and ``cache_prompt`` never reach the slot: a ``/v1/messages`` request
cannot be pinned to the slot the proxy leased (invariant 7). So the proxy does the server's
work on both sides of the chat path:

- :func:`to_chat` is the server's conversion, line by line;
- the converted body is rendered, tokenized, leased and restored like any chat request and
  sent to the server's ``/v1/chat/completions`` pinned with ``id_slot``; the tokens are exact
  by construction, because the server computes exactly the chat body the proxy rendered;
- :func:`message_of` and :class:`EventStream` write the chat answer as the server's
  ``to_json_anthropic`` / ``to_json_anthropic_stream`` would (content blocks in the order
  thinking, text, tool_use; ``stop_reason``; usage with ``cache_read_input_tokens``).

The stop sequence that ended an answer is not in a chat answer: when the request has
``stop_sequences`` the proxy asks for the server's ``verbose`` block and reads
``stopping_word`` there (and removes the block). Errors are in Anthropic's shape
(:func:`error_body`), in the body and as a stream's ``error`` event.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from proxy.errors import BadRequest, RadixError
from proxy.server.dataplane.wire import json_or_error

CHAT_PATH = "/v1/chat/completions"
BILLING_PREFIX = "x-anthropic-billing-header:"
DEFAULT_MAX_TOKENS = 4096  # the server's, when the body has none (Anthropic requires it)
PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")

# llama-server's error types -> Anthropic's (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "not_supported_error": "invalid_request_error",
    "exceed_context_size_error": "invalid_request_error",
    "server_error": "api_error",
}


def _jv(obj: Any, key: str, default: Any) -> Any:
    """nlohmann's ``json_value``: the value when present, not null and of the default's type."""
    if not isinstance(obj, dict) or obj.get(key) is None:
        return default
    value = obj[key]
    if default is None:
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        return value if isinstance(value, bool) and isinstance(default, bool) else default
    if isinstance(default, int):
        return int(value) if isinstance(value, int | float) else default
    return value if isinstance(value, type(default)) else default


def _billing(text: str) -> str:
    """The server's ``normalize_anthropic_billing_header``: a per-request stamp made constant."""
    if not text.startswith(BILLING_PREFIX):
        return text
    at = text.find("cch=", len(BILLING_PREFIX))
    if at < 0:
        return text
    at += 4
    if at + 5 < len(text) and text[at + 5] == ";":
        return text[:at] + "fffff" + text[at + 5 :]
    return text


def _image_url(source: Any) -> str | None:
    source = source if isinstance(source, dict) else {}
    kind = _jv(source, "type", "")
    if kind == "base64":
        return f"data:{_jv(source, 'media_type', 'image/jpeg')};base64,{_jv(source, 'data', '')}"
    if kind == "url":
        return str(_jv(source, "url", ""))
    return None


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    tool_use_id = _jv(block, "tool_use_id", "")
    content = block.get("content")
    if isinstance(content, str):
        return {"role": "tool", "tool_call_id": tool_use_id, "content": content}
    if not isinstance(content, list):
        return {"role": "tool", "tool_call_id": tool_use_id, "content": ""}
    text, parts, images = "", [], False
    for item in content:
        kind = _jv(item, "type", "")
        if kind == "text":
            piece = _jv(item, "text", "")
            text += piece
            parts.append({"type": "text", "text": piece})
        elif kind == "image":
            images = True
            url = _image_url(_jv(item, "source", {}))
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
    return {"role": "tool", "tool_call_id": tool_use_id, "content": parts if images else text}


def _message(msg: Any, out: list[Any]) -> None:
    role = _jv(msg, "role", "")
    if not isinstance(msg, dict) or "content" not in msg:
        if role != "assistant":
            out.append(msg)
        return
    content = msg["content"]
    if not isinstance(content, list):
        out.append(msg)
        return
    tool_calls: list[dict[str, Any]] = []
    converted: list[Any] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        kind = _jv(block, "type", "")
        if kind == "text":
            if not isinstance(block.get("text"), str):  # the server's template fails on it (500)
                raise BadRequest("a text block needs a string 'text'")
            converted.append(block)
        elif kind == "thinking":
            reasoning += _jv(block, "thinking", "")
        elif kind == "image":
            url = _image_url(_jv(block, "source", {}))
            if url is not None:
                converted.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            args = _jv(block, "input", {})
            tool_calls.append(
                {
                    "id": _jv(block, "id", ""),
                    "type": "function",
                    "function": {"name": _jv(block, "name", ""), "arguments": _dump(args)},
                }
            )
        elif kind == "tool_result":
            results.append(_tool_result(block))
    if converted or tool_calls or reasoning:
        new: dict[str, Any] = {"role": role}
        new["content"] = converted if converted else ""
        if tool_calls:
            new["tool_calls"] = tool_calls
        if reasoning:
            new["reasoning_content"] = reasoning
        out.append(new)
    out.extend(results)


def _dump(value: Any) -> str:
    """``dump()`` of llama.cpp's ``common_json``: compact, keys in insertion order, UTF-8 kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI chat body llama-server makes of an Anthropic body (its conversion, mirrored)."""
    messages: list[Any] = []
    system = body.get("system")
    if system is not None:
        text = ""
        if isinstance(system, str):
            text = _billing(system)
        elif isinstance(system, list):
            for block in system:
                if _jv(block, "type", "") == "text":
                    text += _billing(_jv(block, "text", ""))
        messages.append({"role": "system", "content": text})
    if "messages" not in body:
        raise BadRequest("'messages' is required")
    if not isinstance(body["messages"], list):
        raise BadRequest("'messages' must be an array")
    for msg in body["messages"]:
        _message(msg, messages)
    if not messages:
        raise BadRequest("'messages' must not be empty")
    chat: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": _jv(tool, "name", ""),
                    "description": _jv(tool, "description", ""),
                    "parameters": tool["input_schema"]
                    if isinstance(tool, dict) and "input_schema" in tool
                    else {},
                },
            }
            for tool in tools
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = _jv(choice, "type", "")
        if kind == "auto":
            chat["tool_choice"] = "auto"
        elif kind in ("any", "tool"):
            chat["tool_choice"] = "required"
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    chat["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    for key in PASSED:
        if key in body:
            chat[key] = body[key]
    thinking = _jv(body, "thinking", {})
    if "thinking" in body and _jv(thinking, "type", "") == "enabled":
        chat["thinking_budget_tokens"] = _jv(thinking, "budget_tokens", 10000)
    user_id = _jv(_jv(body, "metadata", {}), "user_id", "")
    if "metadata" in body and user_id:
        chat["__metadata_user_id"] = user_id
    return chat


def forward_body(chat: dict[str, Any], original: dict[str, Any]) -> dict[str, Any]:
    """The chat body sent to the server: what the answer's conversion needs added."""
    out = dict(chat)
    if "cache_salt" in original:  # the proxy's isolation key; the server's conversion drops it
        out["cache_salt"] = original["cache_salt"]
    if out.get("stream") is True:
        out["stream_options"] = {"include_usage": True}
        out["timings_per_token"] = True  # the prompt's counts for message_start
    if wants_stop_word(chat):
        out["verbose"] = True  # stopping_word, for stop_sequence
    return out


def wants_stop_word(chat: dict[str, Any]) -> bool:
    stop = chat.get("stop")
    return bool(stop) and isinstance(stop, list | str)


# --------------------------------------------------------------------------------------------------
# Answers
# --------------------------------------------------------------------------------------------------


def stop_reason(finish_reason: Any) -> str:
    """The server's rule: stopped by a word or EOS -> end_turn (tool_use with tool calls)."""
    return {"stop": "end_turn", "tool_calls": "tool_use"}.get(str(finish_reason), "max_tokens")


def _stop_word(verbose: Any) -> str | None:
    word = verbose.get("stopping_word") if isinstance(verbose, dict) else None
    return word if isinstance(word, str) and word else None


def _input(data: Any) -> Any:
    try:
        return json.loads(data) if isinstance(data, str) else {}
    except ValueError:
        return {}


def usage(prompt: int, cached: int, output: int, show: bool) -> dict[str, int]:
    if not show:  # no cache information: all of the prompt counts as input
        return {"input_tokens": prompt, "output_tokens": output}
    return {"cache_read_input_tokens": cached, "input_tokens": prompt - cached, "output_tokens": output}


def message_of(chat: dict[str, Any], show: bool) -> dict[str, Any]:
    """The server's non-streamed Anthropic answer, from its chat answer."""
    choice = (chat.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    blocks: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id", ""),
                "name": fn.get("name", ""),
                "input": _input(fn.get("arguments")),
            }
        )
    use = chat.get("usage") or {}
    cached = int((use.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {
        "id": chat.get("id", ""),
        "type": "message",
        "role": "assistant",
        "content": blocks,
        "model": chat.get("model", ""),
        "stop_reason": stop_reason(choice.get("finish_reason")),
        "stop_sequence": _stop_word(chat.get("__verbose")),
        "usage": usage(int(use.get("prompt_tokens", 0)), cached, int(use.get("completion_tokens", 0)), show),
    }


def error_type(status: int, llama_type: str = "") -> str:
    if status == 413:
        return "request_too_large"
    if status == 429:
        return "rate_limit_error"
    if status in (503, 529):
        return "overloaded_error"
    return _ERROR_TYPES.get(llama_type, "invalid_request_error" if 400 <= status < 500 else "api_error")


def error_body(status: int, message: str, llama_type: str = "") -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": error_type(status, llama_type), "message": message}}


def error_of(exc: RadixError) -> dict[str, Any]:
    return error_body(exc.status, exc.message, exc.err_type)


def convert_error(raw: bytes, status: int) -> bytes:
    """A server's error answer ({"error": {"code", "message", "type"}}) in Anthropic's shape."""
    data = json_or_error(raw, limit=500)
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        return orjson.dumps(error_body(status, str(data)[:500]))
    return orjson.dumps(error_body(status, str(err.get("message", "")), str(err.get("type", ""))))


def event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
