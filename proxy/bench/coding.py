"""The ``coding-agent`` workload: a coding agent's sessions through the Anthropic Messages API.

What coding agents send: one long system prompt (the agent's rules, the repository's
conventions and file map) and the same tool schemas on every request, shared by every session;
each session a tool loop (read a file, search, run the tests) whose tool results are a few
hundred tokens of generated code and test output; and sub-agents that branch off a session's
history after its second tool result with a sub-task of their own (sent together with the
session's next turn). The assistant turns are scripted, so the request list never depends on
what the model answers. ``api="chat"`` sends the same conversations as OpenAI chat bodies
(what llama-server makes of the Anthropic ones), for comparison.
"""

from __future__ import annotations

import random
from typing import Any

from proxy.traffic.spec import BenchRequest, Workload
from proxy.traffic.text import fill_to, prose, seeded

MESSAGES_PATH = "/v1/messages"
CHAT_PATH = "/v1/chat/completions"
APIS = ("messages", "chat")

TOOLS: list[dict[str, Any]] = [
    {
        "name": name,
        "description": description,
        "input_schema": {
            "type": "object",
            "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
            "required": list(props),
        },
    }
    for name, description, props in (
        ("read_file", "Read a file of the repository", {"path": "path from the repository root"}),
        ("grep", "Search the repository for a regular expression", {"pattern": "regex", "path": "folder"}),
        ("run_tests", "Run the test suite, or the tests matching a selector", {"selector": "pytest -k"}),
        (
            "edit_file",
            "Replace a unique snippet of a file",
            {"path": "file", "old": "snippet", "new": "text"},
        ),
    )
]
MODULES = ("ledger", "parser", "scheduler", "cache", "report", "auth")


def _code(rng: random.Random, module: str, n_funcs: int) -> str:
    """A module of plausible Python: functions with docstrings and bodies."""
    out = [f'"""{module}: {prose(rng, 8)}"""', "from __future__ import annotations", ""]
    for i in range(n_funcs):
        name = f"{rng.choice(('load', 'merge', 'check', 'apply', 'render', 'split'))}_{module}_{i}"
        args = ", ".join(rng.sample(("items", "limit", "key", "state", "path", "strict"), 2))
        out += [
            f"def {name}({args}):",
            f'    """{prose(rng, 10)}"""',
            f"    total = {rng.randint(0, 9)}",
            "    for item in items:",
            f"        if item.{rng.choice(('size', 'age', 'rank'))} > limit:",
            f"            total += {rng.randint(1, 5)}",
            "    return total",
            "",
        ]
    return "\n".join(out)


def _system(tokens: int, seed: object) -> str:
    rng = seeded(seed, "coding-system")
    rules = [prose(rng, 14) for _ in range(8)]
    files = "\n".join(f"- src/{m}.py: {prose(rng, 9)}" for m in MODULES)
    text = "\n".join(
        [
            "You are a coding agent working in a Python repository. Use the tools to read, search, "
            "test and edit; make the smallest change that fixes the task; run the tests before you answer.",
            "",
            "## Conventions",
            *[f"- {r}" for r in rules],
            "",
            "## Repository map",
            files,
            "",
            "## Notes",
        ]
    )
    return fill_to(text, rng, tokens)


def _steps(rng: random.Random, module: str, seed: object) -> list[tuple[str, dict[str, str], str]]:
    """(tool, input, result) of one session's loop: read, grep, test."""
    failing = f"test_{module}_{rng.randint(1, 9)}"
    test_out = "\n".join(
        [f"FAILED tests/test_{module}.py::{failing} - AssertionError: {prose(rng, 6)}"]
        + [f"    {prose(rng, 8)}" for _ in range(28)]
        + ["1 failed, 41 passed in 0.8s"]
    )
    grep_out = "\n".join(
        f"src/{m}.py:{rng.randint(10, 300)}: {prose(rng, 7)}" for m in rng.sample(MODULES, 4) * 3
    )
    return [
        ("read_file", {"path": f"src/{module}.py"}, _code(seeded(seed, "code", module), module, 8)),
        ("grep", {"pattern": f"{module}_[0-9]", "path": "src"}, grep_out),
        ("run_tests", {"selector": failing}, test_out),
    ]


def coding_agent(
    system_tokens: int = 1500,
    sessions: int = 3,
    max_tokens: int = 24,
    seed: int = 0,
    api: str = "messages",
) -> Workload:
    """Every session at once; turns in order; one sub-agent per session after its second tool result."""
    if api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}")
    system = _system(system_tokens, seed)
    reqs: list[BenchRequest] = []
    for s in range(sessions):
        rng = seeded(seed, "session", s)
        module = MODULES[s % len(MODULES)]
        session = f"s{s}"
        turns: list[dict[str, Any]] = [
            {"role": "user", "content": f"{prose(rng, 12)} Fix the failing test in {module}."}
        ]
        prev: tuple[str, ...] = ()
        steps = _steps(rng, module, seed)
        for t in range(len(steps) + 1):
            if t:
                tool, args, result = steps[t - 1]
                call = f"toolu_{session}_{t}"
                turns = [
                    *turns,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": call, "name": tool, "input": args}],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": call, "content": result}],
                    },
                ]
            rid = f"{session}-t{t + 1}"
            reqs.append(_request(api, rid, session, f"turn {t + 1}", system, turns, max_tokens, prev))
            if t == 2:  # a sub-agent off the history so far, with its own task
                task = f"Sub-task: list every caller of {module}_{rng.randint(0, 7)} and say which ones the fix affects."
                sub = [*turns, {"role": "assistant", "content": "I will delegate the call-site survey."}]
                sub.append({"role": "user", "content": task})
                reqs.append(
                    _request(
                        api, f"{session}-sub", f"{session}-sub", "sub-agent", system, sub, max_tokens, prev
                    )
                )
            prev = (rid,)
    return Workload(
        "coding-agent",
        "a coding agent: one shared system prompt and tool schemas, tool loops with code results, sub-agents",
        tuple(reqs),
        max(1, 2 * sessions),
        {
            "system_tokens": system_tokens,
            "sessions": sessions,
            "max_tokens": max_tokens,
            "seed": seed,
            "api": api,
        },
    )


def _request(
    api: str,
    rid: str,
    session: str,
    group: str,
    system: str,
    turns: list[dict[str, Any]],
    max_tokens: int,
    after: tuple[str, ...],
) -> BenchRequest:
    if api == "messages":
        body: dict[str, Any] = {
            "model": "bench",
            "system": system,
            "tools": TOOLS,
            "messages": [dict(t) for t in turns],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        return BenchRequest(rid, session, group, body, after, path=MESSAGES_PATH)
    return BenchRequest(rid, session, group, _chat_body(system, turns, max_tokens), after, path=CHAT_PATH)


def _chat_body(system: str, turns: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """The same conversation as an OpenAI chat body (tools as functions, tool calls and results)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in turns:
        content = turn["content"]
        if isinstance(content, str):
            messages.append({"role": turn["role"], "content": content})
        elif content[0]["type"] == "tool_use":
            use = content[0]
            call = {
                "id": use["id"],
                "type": "function",
                "function": {"name": use["name"], "arguments": _json(use["input"])},
            }
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            res = content[0]
            messages.append({"role": "tool", "tool_call_id": res["tool_use_id"], "content": res["content"]})
    tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
        }
        for t in TOOLS
    ]
    return {"messages": messages, "tools": tools, "max_tokens": max_tokens, "temperature": 0}


def _json(value: Any) -> str:
    import json

    return json.dumps(value)
