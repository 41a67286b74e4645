"""The OpenAI Responses API (``/v1/responses``): the chat body its prompt is rendered from.

llama-server serves ``/v1/responses`` by converting the body to a chat body
(``server_chat_convert_responses_to_chatcmpl`` in ``tools/server/server-chat.cpp``), then
running its chat path. That conversion copies the body, so ``id_slot`` and ``cache_prompt``
reach the slot: the proxy forwards the client's own body to the server's ``/v1/responses``,
pinned, and the answer is the server's own. To know the prompt's tokens it converts the body
the same way (:func:`to_chat`, the server's function mirrored) and renders that chat body
like any chat request. Should the two conversions ever differ, the server computes more of
the prompt (the slot read after the answer shows the divergence); the answer is still right.
Inputs the server rejects are rejected here with the server's message (400).
"""

from __future__ import annotations

import copy
from typing import Any

from proxy.errors import BadRequest


def _is(item: Any, key: str, kind: type) -> bool:
    return isinstance(item, dict) and isinstance(item.get(key), kind)


def _input_message(item: dict[str, Any]) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    for part in item["content"]:
        kind = part.get("type", "") if isinstance(part, dict) else ""
        kind = kind if isinstance(kind, str) else ""
        if kind == "input_text":
            if "text" not in part:
                raise BadRequest("'Input text' requires 'text'")
            content.append({"text": part["text"], "type": "text"})
        elif kind == "input_image":
            if "image_url" not in part:
                raise BadRequest("'image_url' is required")
            content.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
        elif kind == "input_file":
            raise BadRequest("'input_file' is not supported by llamacpp at this moment")
        else:
            raise BadRequest("'type' must be one of 'input_text', 'input_image', or 'input_file'")
    item.pop("type", None)
    item.pop("status", None)
    item["content"] = content
    return item


def _output_content(item: dict[str, Any]) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = []
    if isinstance(item.get("content"), str):
        return [{"text": item["content"], "type": "text"}]
    parts = item.get("content")
    for part in parts if isinstance(parts, list) else []:
        kind = part.get("type", "") if isinstance(part, dict) else ""
        if kind in ("output_text", "input_text"):
            if not _is(part, "text", str):
                raise BadRequest("'Output text' requires 'text'")
            content.append({"text": part["text"], "type": "text"})
        elif kind == "refusal":
            if not _is(part, "refusal", str):
                raise BadRequest("'Refusal' requires 'refusal'")
            content.append({"refusal": part["refusal"], "type": "refusal"})
        else:
            raise BadRequest("'type' must be one of 'output_text' or 'refusal'")
    return content


def _tool_output(item: dict[str, Any]) -> dict[str, Any]:
    output = item["output"]
    if isinstance(output, str):
        return {"content": output, "role": "tool", "tool_call_id": item["call_id"]}
    parts = []
    for part in copy.deepcopy(output):
        if not isinstance(part, dict) or "type" not in part:
            raise BadRequest("Output of tool call missing 'type' field")
        if part["type"] == "input_text":
            part["type"] = "text"
        elif part["type"] == "input_image":
            if "image_url" not in part:
                raise BadRequest("'image_url' is required")
            part["type"] = "image_url"
            part["image_url"] = {"url": part["image_url"]}
        else:
            raise BadRequest("Output of tool call should be 'Input text' or 'Input image'")
        parts.append(part)
    return {"content": parts, "role": "tool", "tool_call_id": item["call_id"]}


def _items(items: list[Any], messages: list[dict[str, Any]]) -> None:
    for raw in items:
        item = copy.deepcopy(raw) if isinstance(raw, dict) else raw
        merge = bool(messages) and messages[-1].get("role", "") == "assistant"
        if _is(item, "content", str):
            item["content"] = [{"text": item["content"], "type": "input_text"}]
        if _is(item, "content", list) and item.get("role") in ("user", "system", "developer"):
            messages.append(_input_message(item))
        elif _is(item, "role", str) and item["role"] == "assistant" and item.get("type") == "message":
            content = _output_content(item)
            if merge:
                prev = messages[-1]
                if not isinstance(prev.get("content"), list):
                    prev["content"] = []
                prev["content"].extend(content)
            else:
                item.pop("status", None)
                item.pop("type", None)
                item["content"] = content
                messages.append(item)
        elif (
            all(_is(item, k, str) for k in ("arguments", "call_id", "name", "type"))
            and item["type"] == "function_call"
        ):
            call = {
                "function": {"arguments": item["arguments"], "name": item["name"]},
                "id": item["call_id"],
                "type": "function",
            }
            if merge:
                prev = messages[-1]
                if not isinstance(prev.get("tool_calls"), list):
                    prev["tool_calls"] = []
                prev["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif (
            _is(item, "call_id", str)
            and (_is(item, "output", str) or _is(item, "output", list))
            and _is(item, "type", str)
            and item["type"] == "function_call_output"
        ):
            messages.append(_tool_output(item))
        elif _is(item, "summary", list) and _is(item, "type", str) and item["type"] == "reasoning":
            if not _is(item, "content", list):
                raise BadRequest("item['content'] is not an array")
            if not item["content"]:
                raise BadRequest("item['content'] is empty")
            if not _is(item["content"][0], "text", str):
                raise BadRequest("item['content']['text'] is not a string")
            text = item["content"][0]["text"]
            if merge:
                messages[-1]["reasoning_content"] = text
            else:
                messages.append({"role": "assistant", "content": [], "reasoning_content": text})
        else:
            raise BadRequest("Cannot determine type of 'item'")


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body llama-server makes of a Responses body (its conversion, mirrored)."""
    if "input" not in body:
        raise BadRequest("'input' is required")
    previous = body.get("previous_response_id")
    if isinstance(previous, str) and previous:
        raise BadRequest("llama.cpp does not support 'previous_response_id'.")
    chat = {k: v for k, v in body.items() if k != "input"}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        instructions = body["instructions"]
        messages.append({"role": "system", "content": instructions if isinstance(instructions, str) else ""})
        del chat["instructions"]
    value = body["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        _items(value, messages)
    else:
        raise BadRequest("'input' must be a string or array of objects")
    chat["messages"] = messages
    if "tools" in body:
        if not isinstance(body["tools"], list):
            raise BadRequest("'tools' must be an array of objects")
        tools = []
        for tool in body["tools"]:
            if not isinstance(tool, dict) or tool.get("type") != "function":
                continue  # no chat equivalent: the server skips it too
            fn = {k: v for k, v in tool.items() if k != "type"}
            fn.setdefault("strict", True)
            tools.append({"type": "function", "function": fn})
        del chat["tools"]
        if tools:
            chat["tools"] = tools
    if "max_output_tokens" in body:
        del chat["max_output_tokens"]
        chat["max_tokens"] = body["max_output_tokens"]
    if "reasoning" in body:
        reasoning = body["reasoning"]
        if isinstance(reasoning, dict) and "effort" in reasoning:
            chat["reasoning_effort"] = reasoning["effort"]
        del chat["reasoning"]
    return chat
