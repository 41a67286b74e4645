"""The ``agents`` workload: three edge-agent scenarios with scripted tool loops.

Each scenario has one long system prompt (role, rules, tool schemas, reference documents)
shared by all its sessions. A session is a multi-turn tool loop: the user's task, then for
each step the assistant's tool call and the tool's result, then the final answer and two
follow-ups branching from it (sent together). The assistant turns are scripted and every
tool result is computed from deterministic local data, so the request list never depends
on what the model answers. The incident scenario's actions are proposals awaiting human
review; nothing is ever executed (there is nothing to execute: it is all text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proxy.traffic.data import (
    COMPANIES,
    DEVICE_MODELS,
    ERROR_CODES,
    RATIOS,
    SERVICES,
    device_log,
    error_logs,
    financials,
    manual_section,
    ratio,
    service_status,
)
from proxy.traffic.spec import BenchRequest, Workload
from proxy.traffic.text import fill_to, prose, seeded

SCENARIOS = ("finance", "maintenance", "incident")


@dataclass(frozen=True)
class Task:
    user: str
    steps: tuple[tuple[dict[str, Any], str], ...]  # (tool call, tool result)
    final: str
    followups: tuple[str, str]


def _tool(name: str, description: str, **props: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
                "required": list(props),
            },
        },
    }


def _system(
    role: str, tools: list[dict[str, Any]], rules: list[str], docs: list[str], tokens: int, seed: object
) -> str:
    text = "\n".join(
        [
            role,
            "",
            "## Tools",
            'Call one tool at a time by answering only with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.',
            json.dumps(tools),
            "",
            "## Rules",
            *[f"- {r}" for r in rules],
            "",
            "## Documents",
            *docs,
            "",
            "## Background notes",
        ]
    )
    return fill_to(text, seeded(seed, "notes"), tokens)


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


# ---- financial research (data: proxy.traffic.data) -------------------------------------

_COMPANIES = COMPANIES
_YEARS = (2022, 2023)


def finance(n_sessions: int, tokens: int, seed: object) -> tuple[str, list[Task]]:
    data = financials(seed, _YEARS)
    docs = []
    for name in _COMPANIES:
        for year in _YEARS:
            figures = "; ".join(f"{k.replace('_', ' ')} {v} M" for k, v in data[name][year].items())
            docs.append(
                f"### {name}, annual report {year} (fictional)\n{figures}.\n"
                f"{prose(seeded(seed, 'fin-doc', name, year), 10)}"
            )
    tools = [
        _tool(
            "get_financials",
            "Reported figures of a company for a fiscal year",
            company="company name",
            year="fiscal year",
        ),
        _tool(
            "compute_ratio",
            "Compute a financial ratio from the reported figures",
            company="company name",
            ratio="|".join(RATIOS),
            year="fiscal year",
        ),
        _tool("search_reports", "Full-text search in the annual reports", query="search terms"),
    ]
    system = _system(
        "You are a financial research assistant. All companies below are fictional.",
        tools,
        [
            "Use only the figures in the documents or returned by tools.",
            "Show each ratio's formula.",
            "Give no investment advice.",
        ],
        docs,
        tokens,
        (seed, "finance"),
    )
    tasks = []
    for i in range(n_sessions):
        company, other = _COMPANIES[i % len(_COMPANIES)], _COMPANIES[(i + 1) % len(_COMPANIES)]
        year = _YEARS[-1]
        cur, prior, dte = (
            ratio(data, company, "current_ratio", year),
            ratio(data, company, "current_ratio", year - 1),
            ratio(data, company, "debt_to_equity", year),
        )
        steps = (
            (_call("get_financials", company=company, year=year), json.dumps(data[company][year])),
            (_call("compute_ratio", company=company, ratio="current_ratio", year=year), json.dumps(cur)),
            (_call("compute_ratio", company=company, ratio="debt_to_equity", year=year), json.dumps(dte)),
        )
        final = (
            f"{company} {year}: current ratio {cur['value']} (prior year {prior['value']}), "
            f"debt to equity {dte['value']}."
        )
        tasks.append(
            Task(
                f"Assess the liquidity and leverage of {company} for fiscal {year}.",
                steps,
                final,
                (
                    f"How does its gross margin compare with {other}?",
                    "Which reported figure is the biggest risk for lenders?",
                ),
            )
        )
    return system, tasks


# ---- field maintenance ----------------------------------------------------------------------

_MODELS, _CODES = DEVICE_MODELS, ERROR_CODES


def maintenance(n_sessions: int, tokens: int, seed: object) -> tuple[str, list[Task]]:
    docs = []
    for model in _MODELS:
        docs.append(f"### Service manual: {model}")
        for code in _CODES:
            docs.append(manual_section(model, code, seed))
    tools = [
        _tool(
            "read_device_log", "Last readings of a device", device_id="device id", last_n="number of lines"
        ),
        _tool("lookup_manual", "Manual section for an error code", model="device model", code="error code"),
        _tool(
            "create_work_order",
            "Draft a work order for a supervisor to approve",
            device_id="device id",
            action="what to do",
            priority="low|medium|high",
        ),
    ]
    system = _system(
        "You are a field maintenance assistant for remote pumping stations.",
        tools,
        [
            "Quote the manual section you rely on.",
            "Never clear an alarm yourself.",
            "Work orders are drafts until a supervisor approves them.",
        ],
        docs,
        tokens,
        (seed, "maint"),
    )
    tasks = []
    models, codes = list(_MODELS), list(_CODES)
    for i in range(n_sessions):
        model = models[i % len(models)]
        device, code = f"{_MODELS[model]}-{400 + 7 * i:04d}", codes[i % len(codes)]
        log = device_log(device, code, 8, seed)
        manual = manual_section(model, code, seed)
        order = {
            "work_order": f"WO-{7100 + i}",
            "device_id": device,
            "status": "draft",
            "note": "awaiting supervisor approval",
        }
        steps = (
            (_call("read_device_log", device_id=device, last_n=8), "\n".join(log)),
            (_call("lookup_manual", model=model, code=code), manual),
            (
                _call(
                    "create_work_order",
                    device_id=device,
                    action=f"inspect for {_CODES[code]}",
                    priority="high",
                ),
                json.dumps(order),
            ),
        )
        final = f"{device} shows {code} ({_CODES[code]}) in its last three readings; draft {order['work_order']} is ready."
        tasks.append(
            Task(
                f"Device {device} ({model}) raised alarms overnight. Find the cause and prepare a work order.",
                steps,
                final,
                (
                    "Which spare parts should the technician bring?",
                    "Can the device keep running until the next planned stop?",
                ),
            )
        )
    return system, tasks


# ---- edge incident ------------------------------------------------------------------------

_SERVICES = SERVICES


def incident(n_sessions: int, tokens: int, seed: object) -> tuple[str, list[Task]]:
    docs = [f"### Runbook: {s}\n{prose(seeded(seed, 'runbook', s), 40)}" for s in _SERVICES]
    docs.append(f"### Architecture\n{' -> '.join(_SERVICES)}. {prose(seeded(seed, 'arch'), 60)}")
    tools = [
        _tool(
            "get_service_status", "Health and key figures of a service (read-only)", service="service name"
        ),
        _tool(
            "query_logs",
            "Recent log lines of a service (read-only)",
            service="service name",
            level="error|warn|info",
            limit="number of lines",
        ),
        _tool(
            "propose_action",
            "Record a proposed action for an operator to review; never executes it",
            action="rollback|scale|restart|drain",
            target="service name",
            reason="why",
        ),
    ]
    system = _system(
        "You are an incident assistant for a simulated edge service (a test environment).",
        tools,
        [
            "You may only read status and logs and propose actions.",
            "Every proposal waits for a human operator's review; you never execute anything.",
            "State your evidence for each proposal.",
        ],
        docs,
        tokens,
        (seed, "incident"),
    )
    tasks = []
    for i in range(n_sessions):
        service = _SERVICES[i % len(_SERVICES)]
        status = service_status(service, seed)
        logs = error_logs(service, _SERVICES[(i + 1) % len(_SERVICES)], status["version"], 10, seed)
        proposal = {
            "proposal_id": f"P-{300 + i}",
            "status": "pending_review",
            "executed": False,
            "note": "Proposals are never executed by the assistant; an operator must approve them.",
        }
        steps = (
            (_call("get_service_status", service=service), json.dumps(status)),
            (_call("query_logs", service=service, level="error", limit=10), "\n".join(logs)),
            (
                _call(
                    "propose_action",
                    action="rollback",
                    target=service,
                    reason=f"errors began with v{status['version']}",
                ),
                json.dumps(proposal),
            ),
        )
        final = (
            f"{service} runs v{status['version']} at {status['error_rate_pct']}% errors (SLO 1%). "
            f"Proposal {proposal['proposal_id']} (rollback to v{status['previous_version']}) awaits review; "
            "nothing was executed."
        )
        tasks.append(
            Task(
                f"Alert: {service} error rate is above its SLO. Investigate and propose a mitigation.",
                steps,
                final,
                ("What is the risk of the proposed rollback?", "Draft a two-sentence status page update."),
            )
        )
    return system, tasks


_BUILDERS = {"finance": finance, "maintenance": maintenance, "incident": incident}


def agents(
    system_tokens: int = 1200,
    sessions: int = 2,
    max_tokens: int = 32,
    seed: int = 0,
    scenarios: tuple[str, ...] = SCENARIOS,
) -> Workload:
    """All sessions of all scenarios run concurrently; turns within a session in order."""
    reqs: list[BenchRequest] = []
    for scenario in scenarios:
        system, tasks = _BUILDERS[scenario](sessions, system_tokens, seed)
        for i, task in enumerate(tasks):
            session = f"{scenario}-s{i}"
            messages: list[dict[str, str]] = [
                {"role": "system", "content": system},
                {"role": "user", "content": task.user},
            ]
            prev: tuple[str, ...] = ()
            for turn in range(len(task.steps) + 1):
                if turn:
                    call, result = task.steps[turn - 1]
                    messages = [
                        *messages,
                        {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
                        {"role": "tool", "content": result},
                    ]
                rid = f"{session}-t{turn + 1}"
                reqs.append(
                    BenchRequest(
                        rid,
                        session,
                        f"turn {turn + 1}",
                        _body(messages, max_tokens),
                        prev,
                        meta={"scenario": scenario, "turn": turn + 1},
                    )
                )
                prev = (rid,)
            base = [*messages, {"role": "assistant", "content": task.final}]
            for b, follow in enumerate(task.followups):
                reqs.append(
                    BenchRequest(
                        f"{session}-b{b + 1}",
                        f"{session}-b{b + 1}",
                        "follow-up",
                        _body([*base, {"role": "user", "content": follow}], max_tokens),
                        prev,
                        meta={"scenario": scenario, "branch": b + 1},
                    )
                )
    return Workload(
        "agents",
        "edge agents: shared system prompts, tool loops, branching follow-ups",
        tuple(reqs),
        max(1, sessions * len(scenarios) * 2),
        {
            "system_tokens": system_tokens,
            "sessions": sessions,
            "max_tokens": max_tokens,
            "seed": seed,
            "scenarios": list(scenarios),
        },
    )


def _body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"messages": [dict(m) for m in messages], "max_tokens": max_tokens, "temperature": 0}
