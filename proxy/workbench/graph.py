"""The agent loop on LangGraph: ``model`` -> (``tools`` -> ``model``)* -> end, within a step limit.

One graph run is one turn: the session's history plus the new user message go in, the
messages the turn added and a trace entry per model call come out. The model, the scenario,
the tool context and the event callback travel in the run's config, so one compiled graph
serves every session.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from proxy.workbench.llm import ChatModel, Reply
from proxy.workbench.protocol import (
    AgentSettings,
    StepKind,
    assistant_message,
    build_request,
    step_kind,
    text_calls,
    without_calls,
)
from proxy.workbench.scenarios import Scenario
from proxy.workbench.tools import ToolContext, run_tool

Emit = Callable[[dict[str, Any]], Awaitable[None]]


class TurnState(TypedDict, total=False):
    messages: Annotated[list[dict[str, Any]], operator.add]
    calls: Annotated[list[dict[str, Any]], operator.add]  # one trace entry per model call
    tools: Annotated[list[dict[str, Any]], operator.add]  # one entry per tool run
    steps: int
    first_turn: bool
    pending: list[dict[str, Any]]
    final: str
    error: str


@dataclass
class RunContext:
    scenario: Scenario
    settings: AgentSettings
    model: ChatModel
    tool_ctx: ToolContext
    emit: Emit
    # Shared by the turns of one app: {"tools_ignored": True} once a forced step got no
    # call back through the tools API, so later forced steps go straight to the schema.
    hints: dict[str, bool] = field(default_factory=dict)


def trace_entry(
    step: int, kind: StepKind, body: dict[str, Any], reply: Reply, sent_at: float
) -> dict[str, Any]:
    """What the page shows for one model call: the request, the answer and the cache outcome."""
    usage, timings, h = reply.usage, reply.timings, reply.headers
    details = usage.get("prompt_tokens_details") or {}
    cached = timings.get("cache_n", details.get("cached_tokens"))
    prefilled = timings.get("prompt_n")
    prompt = usage.get("prompt_tokens")
    if prompt is None and cached is not None and prefilled is not None:
        prompt = cached + prefilled
    return {
        "step": step,
        "kind": kind,
        "request": body,
        "content": reply.content,
        "native_tool_calls": reply.tool_calls,
        "finish_reason": reply.finish_reason,
        "status": reply.status,
        "error": reply.error,
        "route": h.get("X-Radix-Route"),
        "server": h.get("X-Radix-Server"),
        "slot": int(h["X-Radix-Slot"]) if h.get("X-Radix-Slot", "").isdigit() else None,
        "prompt_tokens": prompt if prompt is not None else _int(h.get("X-Radix-Prompt-Tokens")),
        "predicted_cached_tokens": _int(h.get("X-Radix-Predicted-Cached-Tokens")),
        "cached_tokens": cached,
        "prefilled_tokens": prefilled,
        "completion_tokens": usage.get("completion_tokens", timings.get("predicted_n")),
        "ttft_s": None if reply.ttft_s is None else round(reply.ttft_s, 4),
        "e2e_s": None if reply.e2e_s is None else round(reply.e2e_s, 4),
        "sent_at": sent_at,
    }


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


async def _call(
    run: RunContext, messages: list[dict[str, Any]], step: int, kind: StepKind
) -> tuple[Reply, dict[str, Any]]:
    body = build_request(run.scenario, run.settings, messages, kind)
    await run.emit({"type": "step", "step": step, "kind": kind})

    async def on_text(piece: str) -> None:
        await run.emit({"type": "token", "step": step, "text": piece})

    sent_at = time.time()
    reply = await run.model.complete(body, on_text)
    entry = trace_entry(step, kind, body, reply, sent_at)
    await run.emit({"type": "call", "call": entry})
    return reply, entry


async def model_node(state: TurnState, config: RunnableConfig) -> dict[str, Any]:
    run: RunContext = config["configurable"]["run"]
    step = state.get("steps", 0) + 1
    kind = step_kind(run.settings, step, state.get("first_turn", False))
    auto = run.settings.protocol == "auto"
    if kind == "force" and auto and run.hints.get("tools_ignored"):
        kind = "force_text"
    reply, entry = await _call(run, state["messages"], step, kind)
    entries = [entry]
    native, calls = bool(reply.tool_calls), reply.tool_calls or text_calls(reply.content)
    if native:
        run.hints["tools_ignored"] = False
    if kind == "force" and not native and reply.error is None and auto:
        run.hints["tools_ignored"] = True
        if not calls:  # the server ignored tools: ask again with the call's schema
            reply, entry = await _call(run, state["messages"], step, "force_text")
            entries.append(entry)
            calls = text_calls(reply.content)
    out: dict[str, Any] = {"steps": step, "calls": entries, "pending": []}
    if reply.error is not None:
        return {**out, "error": reply.error, "final": ""}
    if kind == "final":
        calls = []
    for i, call in enumerate(calls):
        call["id"], call["native"] = call.get("id") or f"call_{step}_{i}", native
    message = assistant_message(reply.content, calls, native)
    if calls:
        return {**out, "messages": [message], "pending": calls}
    final = without_calls(reply.content) or reply.content.strip()
    return {**out, "messages": [message], "final": final}


async def tools_node(state: TurnState, config: RunnableConfig) -> dict[str, Any]:
    run: RunContext = config["configurable"]["run"]
    tools, messages, records = run.scenario.tool_map(), [], []
    for call in state.get("pending", []):
        result = await run_tool(tools, run.tool_ctx, call["name"], call["arguments"])
        record = {"step": state.get("steps", 0), **call, "result": result}
        await run.emit({"type": "tool", **record})
        records.append(record)
        message: dict[str, Any] = {"role": "tool", "content": result}
        if call.get("native"):  # answered by id in the tools API
            message["tool_call_id"] = call["id"]
        messages.append(message)
    return {"messages": messages, "tools": records, "pending": []}


def _after_model(state: TurnState) -> str:
    return "tools" if state.get("pending") else END


def build_graph() -> Any:
    graph = StateGraph(TurnState)
    graph.add_node("model", model_node)
    graph.add_node("tools", tools_node)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", _after_model, {"tools": "tools", END: END})
    graph.add_edge("tools", "model")
    return graph.compile()


@dataclass
class TurnResult:
    messages: list[dict[str, Any]]  # what the turn added, the user's message first
    calls: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    final: str
    error: str | None


async def run_turn(
    graph: Any,
    run: RunContext,
    history: list[dict[str, Any]],
    user: str,
) -> TurnResult:
    first = not any(m["role"] == "user" for m in history)
    start = [*history, {"role": "user", "content": user}]
    state: TurnState = {"messages": start, "calls": [], "tools": [], "steps": 0, "first_turn": first}
    limit = 4 * run.settings.max_steps + 4  # LangGraph counts node runs
    out = await graph.ainvoke(state, config={"configurable": {"run": run}, "recursion_limit": limit})
    return TurnResult(
        out["messages"][len(history) :], out["calls"], out["tools"], out.get("final", ""), out.get("error")
    )
