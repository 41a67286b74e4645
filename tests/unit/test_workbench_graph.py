"""The agent graph against a scripted model: tool loop, both tool protocols, step limit, branches.

The model here is a script (it tests the graph's logic, not a server); the whole path with
the real proxy, server and model is tests/integration/test_workbench.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langgraph", reason="needs the workbench extra: pip install -e '.[workbench]'")

from proxy.traffic.runner import ManifestEntry  # noqa: E402
from proxy.workbench.app import manifest_lines  # noqa: E402
from proxy.workbench.graph import RunContext, build_graph, run_turn  # noqa: E402
from proxy.workbench.llm import OnText, Reply  # noqa: E402
from proxy.workbench.protocol import FINAL_NUDGE, AgentSettings, text_calls  # noqa: E402
from proxy.workbench.scenarios import SCENARIOS  # noqa: E402
from proxy.workbench.store import NotFound, Store  # noqa: E402
from proxy.workbench.tools import ToolContext  # noqa: E402

FIN = SCENARIOS["financial_research"]
GRAPH = build_graph()


class Script:
    """Answers each request with the next scripted reply; keeps every request it got."""

    def __init__(self, *replies: Reply) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []

    async def complete(self, body: dict[str, Any], on_text: OnText | None = None) -> Reply:
        self.requests.append(json.loads(json.dumps(body)))
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        if on_text is not None and reply.content:
            await on_text(reply.content)
        return Reply(**{**reply.__dict__, "headers": {"X-Radix-Route": "A", "X-Radix-Slot": "1"}})


def text_call(name: str, **args: Any) -> Reply:
    return Reply(content=f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>")


def turn(
    model: Script,
    history: list[dict[str, Any]],
    user: str,
    hints: dict[str, bool] | None = None,
    **settings: Any,
) -> Any:
    events: list[dict[str, Any]] = []

    async def emit(event: dict[str, Any]) -> None:
        events.append(event)

    run = RunContext(
        FIN, AgentSettings(**settings), model, ToolContext(), emit, {} if hints is None else hints
    )
    result = asyncio.run(run_turn(GRAPH, run, history, user))
    return result, events


def test_text_protocol_tool_loop_feeds_results_back_and_ends_on_an_answer() -> None:
    model = Script(
        text_call("get_statement", company="Altamira Foods", year=2023), Reply(content="Revenue was 407.3 M.")
    )
    result, events = turn(model, [], "Altamira revenue 2023?", force_first_tool=False)
    assert result.final == "Revenue was 407.3 M." and result.error is None
    assert [t["name"] for t in result.tools] == ["get_statement"]
    assert json.loads(result.tools[0]["result"])["revenue"] == 407.3
    # The second request carries the call and its result; the system prompt stays first.
    second = model.requests[1]["messages"]
    assert second[0] == {"role": "system", "content": FIN.system}
    assert second[-2]["content"].startswith("<tool_call>") and second[-1]["role"] == "tool"
    assert json.loads(second[-1]["content"])["revenue"] == 407.3
    assert [m["role"] for m in result.messages] == ["user", "assistant", "tool", "assistant"]
    assert [e["type"] for e in events if e["type"] != "token"] == ["step", "call", "tool", "step", "call"]
    assert result.calls[0]["route"] == "A" and result.calls[0]["slot"] == 1


def test_native_tool_calls_are_answered_by_id() -> None:
    native = Reply(tool_calls=[{"id": "abc", "name": "list_companies", "arguments": {}}])
    model = Script(native, Reply(content="Four companies."))
    result, _ = turn(model, [], "Which companies?", force_first_tool=False)
    assert model.requests[0]["tool_choice"] == "auto" and len(model.requests[0]["tools"]) == len(FIN.tools)
    assistant, tool = result.messages[1], result.messages[2]
    assert assistant["tool_calls"][0]["id"] == "abc" and tool["tool_call_id"] == "abc"
    assert result.final == "Four companies."


def test_a_forced_first_step_falls_back_to_a_schema_when_tools_are_ignored() -> None:
    bare = Reply(content='{"name": "list_companies", "arguments": {}}')
    model = Script(Reply(content="I cannot help."), bare, Reply(content="Done."))
    hints: dict[str, bool] = {}
    result, _ = turn(model, [], "Start.", hints)
    first, retry = model.requests[0], model.requests[1]
    assert first["tool_choice"] == "required" and "response_format" not in first
    assert retry["response_format"]["type"] == "json_schema" and "tools" not in retry
    assert first["max_tokens"] == 96 and retry["max_tokens"] == 128  # room for a whole call object
    names = [
        s["properties"]["name"]["enum"][0] for s in retry["response_format"]["json_schema"]["schema"]["anyOf"]
    ]
    assert names == [t.name for t in FIN.tools]
    assert [c["kind"] for c in result.calls] == ["force", "force_text", "auto"]
    assert result.tools[0]["name"] == "list_companies" and result.final == "Done."
    assert (
        result.messages[1]["content"] == '<tool_call>{"name": "list_companies", "arguments": {}}</tool_call>'
    )


def test_the_step_limit_ends_with_an_answer_without_tools() -> None:
    model = Script(text_call("list_companies"))  # would call tools forever
    result, _ = turn(model, [], "Loop.", max_steps=3, force_first_tool=False)
    assert len(model.requests) == 3 and len(result.tools) == 2
    last = model.requests[-1]
    assert "tools" not in last and last["messages"][-1] == {"role": "user", "content": FINAL_NUDGE}
    assert result.calls[-1]["kind"] == "final" and result.final  # the call text itself, tags removed or not
    assert not any(m.get("content") == FINAL_NUDGE for m in result.messages)


def test_a_server_error_ends_the_turn_with_the_error() -> None:
    result, _ = turn(Script(Reply(status=400, error="bad request")), [], "Hi.", force_first_tool=False)
    assert result.error == "bad request" and result.final == "" and len(result.calls) == 1


def test_text_calls_parse_tags_bare_objects_and_ignore_junk() -> None:
    assert text_calls('x <tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call> y') == [
        {"name": "a", "arguments": {"k": 1}}
    ]
    assert text_calls('{"name": "b", "arguments": {}}') == [{"name": "b", "arguments": {}}]
    assert text_calls('<tool_call>{"name": "c", "parameters": {"q": 2}}') == [
        {"name": "c", "arguments": {"q": 2}}
    ]
    assert text_calls("<tool_call>```\n```") == [] and text_calls("plain answer") == []


def test_branches_share_their_parent_prefix_and_persist(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite3"
    store = Store(db)
    session = store.create_session(FIN.name, FIN.title, FIN.system)
    sid = session["id"]
    first, _ = turn(Script(Reply(content="A1")), [], "Q1", force_first_tool=False)
    t1 = store.add_turn(sid, None, "Q1", first.messages, first.final, first.calls, first.tools, None)
    model = Script(Reply(content="A2"))
    second, _ = turn(model, store.history(sid, t1["id"]), "Q2")
    t2 = store.add_turn(sid, t1["id"], "Q2", second.messages, second.final, second.calls, second.tools, None)
    branch_model = Script(Reply(content="B2"))
    branch, _ = turn(branch_model, store.history(sid, t1["id"]), "Q2 other")
    b2 = store.add_turn(
        sid, t1["id"], "Q2 other", branch.messages, branch.final, branch.calls, branch.tools, None
    )
    # A follow-up is not forced to call a tool; both branches repeat the same prefix exactly.
    assert "tools" in model.requests[0] and model.requests[0]["tool_choice"] == "auto"
    shared = model.requests[0]["messages"][:-1]
    assert branch_model.requests[0]["messages"][:-1] == shared
    assert shared[-1] == {"role": "assistant", "content": "A1"}
    store.close()
    reopened = Store(db)  # sessions survive a restart
    assert [t["id"] for t in reopened.path(sid, b2["id"])] == [t1["id"], b2["id"]]
    assert {t["parent_id"] for t in reopened.turns(sid)} == {None, t1["id"]}
    assert reopened.history(sid, t2["id"])[-1] == {"role": "assistant", "content": "A2"}
    with pytest.raises(NotFound):
        reopened.add_turn(sid, "nope", "Q", [], "", [], [], None)
    # The export is a replayable manifest: every model call, exact bodies, times from 0.
    lines = manifest_lines(reopened, sid, None)
    entries = [ManifestEntry.from_line(x) for x in lines]
    assert len(entries) == 3 and entries[0].t == 0.0 and entries[0].path == "/v1/chat/completions"
    assert entries[1].body == model.requests[0] and {e.group for e in entries} == {FIN.name}
    assert len(manifest_lines(reopened, sid, b2["id"])) == 2
