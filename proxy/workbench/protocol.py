"""Requests the agent sends and how tool calls are read back (no LangGraph here).

Tool calls come through the OpenAI tools API when the server emits them (``tool_calls`` in
the answer), and otherwise through the text protocol the system prompt describes:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A step that must call a tool
sends ``tool_choice: "required"``; if the answer still has no call (a server that ignores
``tools``, as llama-server does without ``--jinja``), it is asked once more with
``response_format`` set to the JSON schema of one call of one of the scenario's tools, which
llama-server turns into a grammar: so even a tiny model calls a real tool with valid arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from proxy.workbench.scenarios import Scenario

StepKind = Literal["force", "force_text", "auto", "final"]
FINAL_NUDGE = (
    "Tool budget used up: answer the question now in plain text from the evidence above, without tool calls."
)
FORCED_CALL_TOKENS = 128  # room for a whole call object, whatever max_tokens is
_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class AgentSettings:
    model: str = ""  # LLM_MODEL; empty: the server's default model
    max_steps: int = 4  # model calls per turn; the last one may not call tools
    max_tokens: int = 96
    temperature: float = 0.0
    protocol: Literal["auto", "openai", "text"] = "auto"
    force_first_tool: bool = True  # the first turn of a session starts with a tool call

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError("max_steps must be at least 1")
        if self.protocol not in ("auto", "openai", "text"):
            raise ValueError("protocol must be auto, openai or text")


def step_kind(settings: AgentSettings, step: int, first_turn: bool) -> StepKind:
    if step >= settings.max_steps:
        return "final"
    if step == 1 and first_turn and settings.force_first_tool:
        return "force_text" if settings.protocol == "text" else "force"
    return "auto"


def build_request(
    scenario: Scenario, settings: AgentSettings, messages: list[dict[str, Any]], kind: StepKind
) -> dict[str, Any]:
    """The exact body sent for one model call (also what the page previews)."""
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": scenario.system}, *messages],
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.model:
        body["model"] = settings.model
    if kind == "force_text":  # the grammar ends the answer with the call object
        body["max_tokens"] = max(settings.max_tokens, FORCED_CALL_TOKENS)
    native = settings.protocol in ("auto", "openai")
    if kind in ("force", "auto") and native:
        body["tools"] = [t.openai_schema() for t in scenario.tools]
        body["tool_choice"] = "required" if kind == "force" else "auto"
    elif kind == "force_text":
        schema = {"anyOf": [t.call_schema() for t in scenario.tools]}
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "tool_call", "schema": schema},
        }
    elif kind == "final":
        body["messages"].append({"role": "user", "content": FINAL_NUDGE})
    return body


def _call_of(obj: Any) -> dict[str, Any] | None:
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters", {}))
        return {"name": obj["name"], "arguments": args if isinstance(args, dict) else {}}
    return None


def text_calls(content: str) -> list[dict[str, Any]]:
    """Tool calls written in the text protocol (or a bare call object, as a forced step gives)."""
    found = []
    pieces = _TAG.findall(content) if "<tool_call>" in content else [content.strip()]
    for piece in pieces:
        try:
            obj, _ = json.JSONDecoder().raw_decode(piece.strip())
        except ValueError:
            continue
        call = _call_of(obj)
        if call is not None:
            found.append(call)
    return found


def without_calls(content: str) -> str:
    return _TAG.sub("", content).strip()


def assistant_message(content: str, calls: list[dict[str, Any]], native: bool) -> dict[str, Any]:
    """How the answer goes into the history (so the next request repeats what was generated)."""
    if native:
        return {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
                }
                for c in calls
            ],
        }
    if calls and "<tool_call>" not in content:  # a forced step's bare call object
        content = f"<tool_call>{content.strip()}</tool_call>"
    return {"role": "assistant", "content": content}
