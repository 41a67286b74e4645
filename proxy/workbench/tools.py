"""Tools as the model sees them (OpenAI function schemas) and as they run (async functions).

A tool's result is JSON text. Bad arguments give a result naming what is accepted (never an
exception in the agent loop), so a small model that guesses wrong sees how to call it right.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp


class ToolError(Exception):
    """Bad arguments or an unreachable backing service: told to the model as the tool's result."""


@dataclass
class ToolContext:
    """What a tool may reach: the incident service (its own HTTP process) and nothing else."""

    incident_url: str = ""
    http: aiohttp.ClientSession | None = None
    timeout_s: float = 10.0


Runner = Callable[[ToolContext, dict[str, Any]], Awaitable[Any]]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    params: dict[str, dict[str, Any]]  # argument name -> JSON schema
    run: Runner
    required: tuple[str, ...] = field(default=())

    def parameters(self) -> dict[str, Any]:
        return {"type": "object", "properties": self.params, "required": list(self.required or self.params)}

    def openai_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters()},
        }

    def call_schema(self) -> dict[str, Any]:
        """JSON schema of one call of this tool in the text protocol ({"name", "arguments"})."""
        return {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [self.name]}, "arguments": self.parameters()},
            "required": ["name", "arguments"],
        }


def enum(values: Any, description: str, kind: str = "string") -> dict[str, Any]:
    return {"type": kind, "enum": list(values), "description": description}


def text(description: str, max_length: int = 200) -> dict[str, Any]:
    # The bound keeps a forced call (a grammar from this schema) from running past max_tokens.
    return {"type": "string", "description": description, "maxLength": max_length}


def integer(description: str, minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "description": description, "minimum": minimum, "maximum": maximum}


def pick(args: dict[str, Any], name: str, allowed: Any) -> Any:
    """``args[name]`` if it is one of ``allowed`` (compared as text), else a ToolError naming them."""
    value = args.get(name)
    for option in allowed:
        if str(option).lower() == str(value).strip().lower():
            return option
    raise ToolError(f"{name} must be one of {', '.join(map(str, allowed))} (got {value!r})")


def number(args: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    try:
        value = int(args.get(name, default))
    except (TypeError, ValueError) as exc:
        raise ToolError(f"{name} must be a whole number from {lo} to {hi}") from exc
    return max(lo, min(hi, value))


async def run_tool(tools: dict[str, Tool], ctx: ToolContext, name: str, args: Any) -> str:
    """The tool's JSON result, or a JSON error the model can read."""
    tool = tools.get(name)
    if tool is None:
        return json.dumps({"error": f"unknown tool {name!r}; available: {', '.join(tools)}"})
    if not isinstance(args, dict):
        return json.dumps({"error": "arguments must be a JSON object"})
    try:
        return json.dumps(await tool.run(ctx, args))
    except ToolError as exc:
        return json.dumps({"error": str(exc)})
