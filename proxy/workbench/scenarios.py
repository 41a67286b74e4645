"""The three assistants: system prompt, tools and suggested questions, all from local data.

``financial_research`` and ``field_maintenance`` compute every answer from ``data`` (seed 0);
``edge_incident`` reads the simulated incident service over HTTP and can only propose
actions there, which wait for a person's approval (nothing is ever executed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.traffic import data
from proxy.workbench.tools import Tool, ToolContext, ToolError, enum, integer, number, pick, text

SEED = 0
YEARS = (2021, 2022, 2023)
PROTOCOL = (
    "To call a tool, answer only with "
    '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call> and wait for its result. '
    "When you have the evidence, answer in plain text without a tool call."
)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    description: str
    system: str
    tools: tuple[Tool, ...]
    task: str
    followups: tuple[str, ...]

    def tool_map(self) -> dict[str, Tool]:
        return {t.name: t for t in self.tools}

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "description": self.description,
            "task": self.task,
            "followups": list(self.followups),
            "tools": [t.openai_schema() for t in self.tools],
        }


def system_prompt(role: str, rules: list[str], tools: tuple[Tool, ...], docs: list[str]) -> str:
    return "\n".join(
        [
            role,
            "",
            "## Tools",
            PROTOCOL,
            json.dumps([t.openai_schema()["function"] for t in tools]),
            "",
            "## Rules",
            *[f"- {r}" for r in rules],
            "",
            "## Documents",
            *docs,
        ]
    )


# ---- financial research -------------------------------------------------------------------

FIN = data.financials(SEED, YEARS)
METRICS = tuple(next(iter(next(iter(FIN.values())).values())))


async def list_companies(_ctx: ToolContext, _args: dict[str, Any]) -> Any:
    return {"companies": list(data.COMPANIES), "fiscal_years": list(YEARS), "unit": "million"}


async def get_statement(_ctx: ToolContext, args: dict[str, Any]) -> Any:
    company, year = pick(args, "company", data.COMPANIES), pick(args, "year", YEARS)
    return {"company": company, "year": year, "unit": "million", **FIN[company][year]}


async def compare_periods(_ctx: ToolContext, args: dict[str, Any]) -> Any:
    company, metric = pick(args, "company", data.COMPANIES), pick(args, "metric", METRICS)
    start, end = pick(args, "from_year", YEARS), pick(args, "to_year", YEARS)
    a, b = FIN[company][start][metric], FIN[company][end][metric]
    return {
        "company": company,
        "metric": metric,
        "from": {"year": start, "value": a},
        "to": {"year": end, "value": b},
        "change": round(b - a, 1),
        "change_pct": round(100 * (b - a) / a, 1) if a else None,
    }


async def compute_ratio(_ctx: ToolContext, args: dict[str, Any]) -> Any:
    company, name = pick(args, "company", data.COMPANIES), pick(args, "ratio", data.RATIOS)
    return data.ratio(FIN, company, name, pick(args, "year", YEARS))


def financial_research() -> Scenario:
    company = enum(data.COMPANIES, "company name")
    year = enum(YEARS, "fiscal year", "integer")
    tools = (
        Tool("list_companies", "Companies and fiscal years on file", {}, list_companies),
        Tool(
            "get_statement",
            "Reported figures of a company for a fiscal year",
            {"company": company, "year": year},
            get_statement,
        ),
        Tool(
            "compare_periods",
            "One reported figure of a company in two fiscal years, with the change",
            {
                "company": company,
                "metric": enum(METRICS, "reported figure"),
                "from_year": year,
                "to_year": year,
            },
            compare_periods,
        ),
        Tool(
            "compute_ratio",
            "A financial ratio from the reported figures, with its formula",
            {"company": company, "ratio": enum(data.RATIOS, "ratio"), "year": year},
            compute_ratio,
        ),
    )
    docs = [
        f"- {c}: fictional company, annual reports {YEARS[0]}-{YEARS[-1]} on file." for c in data.COMPANIES
    ]
    system = system_prompt(
        "You are a financial research assistant. All companies are fictional.",
        ["Use only figures returned by tools.", "Show each ratio's formula.", "Give no investment advice."],
        tools,
        docs,
    )
    return Scenario(
        "financial_research",
        "Financial research",
        "Fictional companies' statements over three fiscal years: query, compare periods, compute ratios.",
        system,
        tools,
        "Assess the liquidity of Altamira Foods in fiscal 2023 compared with 2022.",
        (
            "How does its gross margin compare with Borealis Grid?",
            "Which figure is the biggest risk for lenders?",
        ),
    )


# ---- field maintenance --------------------------------------------------------------------

SENSORS = {"temp_c": 75.0, "vibration_mm_s": 4.5, "pressure_bar": 3.4}  # alarm limits
_CODES = list(data.ERROR_CODES)


def fleet() -> dict[str, dict[str, Any]]:
    """Six devices, two per model; the last one healthy, the others each with one fault."""
    out = {}
    for i in range(6):
        model = list(data.DEVICE_MODELS)[i % len(data.DEVICE_MODELS)]
        out[data.device_id(model, i)] = {
            "model": model,
            "site": f"station {chr(ord('A') + i // 2)}",
            "code": _CODES[i % len(_CODES)] if i < 5 else "OK",
        }
    return out


FLEET = fleet()
READINGS = 12


def _device(args: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    device = pick(args, "device_id", FLEET)
    return device, FLEET[device]


async def list_devices(_ctx: ToolContext, _args: dict[str, Any]) -> Any:
    return [{"device_id": d, "model": f["model"], "site": f["site"]} for d, f in FLEET.items()]


async def get_device_status(_ctx: ToolContext, args: dict[str, Any]) -> Any:
    device, info = _device(args)
    last = data.readings(device, info["code"], READINGS, SEED, info["code"] != "OK")[-1]
    alarm = info["code"] != "OK"
    return {
        "device_id": device,
        **info,
        "state": "alarm" if alarm else "ok",
        "active_alarm": f"{info['code']} ({data.ERROR_CODES[info['code']]})" if alarm else None,
        "last_reading": last,
    }


async def get_sensor_trend(_ctx: ToolContext, args: dict[str, Any]) -> Any:
    device, info = _device(args)
    sensor = pick(args, "sensor", SENSORS)
    values = [r[sensor] for r in data.readings(device, info["code"], READINGS, SEED, info["code"] != "OK")]
    limit = SENSORS[sensor]
    over = [v for v in values if (v < limit if sensor == "pressure_bar" else v > limit)]
    return {
        "device_id": device,
        "sensor": sensor,
        "values": values,
        "change_per_reading": round((values[-1] - values[0]) / (len(values) - 1), 3),
        "alarm_limit": limit,
        "readings_past_limit": len(over),
    }


async def read_device_log(_ctx: ToolContext, args: dict[str, Any]) -> Any:
    device, info = _device(args)
    n = number(args, "last_n", 6, 1, READINGS)
    return data.device_log(device, info["code"], READINGS, SEED, info["code"] != "OK")[-n:]


async def lookup_manual(_ctx: ToolContext, args: dict[str, Any]) -> Any:
    model, code = pick(args, "model", data.DEVICE_MODELS), pick(args, "code", data.ERROR_CODES)
    return {"model": model, "section": data.manual_section(model, code, SEED)}


def field_maintenance() -> Scenario:
    device = enum(FLEET, "device id")
    tools = (
        Tool("list_devices", "Devices of the fleet", {}, list_devices),
        Tool(
            "get_device_status",
            "State, active alarm and last reading of a device",
            {"device_id": device},
            get_device_status,
        ),
        Tool(
            "get_sensor_trend",
            "Readings of one sensor of a device over time, against its alarm limit",
            {"device_id": device, "sensor": enum(SENSORS, "sensor")},
            get_sensor_trend,
        ),
        Tool(
            "read_device_log",
            "Last lines of a device's log",
            {"device_id": device, "last_n": integer("lines", 1, READINGS)},
            read_device_log,
        ),
        Tool(
            "lookup_manual",
            "Service manual section for an error code",
            {"model": enum(data.DEVICE_MODELS, "device model"), "code": enum(data.ERROR_CODES, "error code")},
            lookup_manual,
        ),
    )
    docs = [f"- {d}: {f['model']} at {f['site']}" for d, f in FLEET.items()]
    docs += [f"- Alarm limits: {', '.join(f'{k} {v}' for k, v in SENSORS.items())} (pressure: minimum)."]
    system = system_prompt(
        "You are a field maintenance assistant for remote pumping stations (a simulated fleet).",
        ["Base every finding on readings, logs or manual sections.", "Never clear an alarm yourself."],
        tools,
        docs,
    )
    first = next(iter(FLEET))
    return Scenario(
        "field_maintenance",
        "Field maintenance",
        "A simulated fleet: device status, sensor trends, logs and manual sections; anomaly analysis.",
        system,
        tools,
        f"Device {first} raised alarms overnight. What is wrong with it?",
        ("Which sensor shows the anomaly first?", "Should the technician bring spare parts?"),
    )


# ---- edge incident ------------------------------------------------------------------------

ACTIONS = ("rollback", "scale", "restart", "drain")


async def _incident(ctx: ToolContext, method: str, path: str, body: Any = None) -> Any:
    if ctx.http is None or not ctx.incident_url:
        raise ToolError("the incident service is not configured")
    try:
        timeout = aiohttp.ClientTimeout(total=ctx.timeout_s)
        async with ctx.http.request(method, ctx.incident_url + path, json=body, timeout=timeout) as resp:
            payload = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ToolError(f"the incident service did not answer: {type(exc).__name__}") from exc
    if resp.status >= 400:
        raise ToolError(str(payload.get("error", payload)) if isinstance(payload, dict) else str(payload))
    return payload


async def get_service_status(ctx: ToolContext, args: dict[str, Any]) -> Any:
    return await _incident(ctx, "GET", f"/services/{pick(args, 'service', data.SERVICES)}/status")


async def query_logs(ctx: ToolContext, args: dict[str, Any]) -> Any:
    service = pick(args, "service", data.SERVICES)
    level = pick(args, "level", ("error", "warn", "info")) if "level" in args else "error"
    limit = number(args, "limit", 8, 1, 50)
    return await _incident(ctx, "GET", f"/services/{service}/logs?level={level}&limit={limit}")


async def propose_action(ctx: ToolContext, args: dict[str, Any]) -> Any:
    body = {
        "action": pick(args, "action", ACTIONS),
        "target": pick(args, "target", data.SERVICES),
        "reason": str(args.get("reason", ""))[:500],
    }
    return await _incident(ctx, "POST", "/proposals", body)


def edge_incident() -> Scenario:
    service = enum(data.SERVICES, "service name")
    tools = (
        Tool(
            "get_service_status",
            "Health and key figures of a service (read-only)",
            {"service": service},
            get_service_status,
        ),
        Tool(
            "query_logs",
            "Recent log lines of a service (read-only)",
            {
                "service": service,
                "level": enum(("error", "warn", "info"), "lowest level"),
                "limit": integer("lines", 1, 50),
            },
            query_logs,
            required=("service",),
        ),
        Tool(
            "propose_action",
            "Record a proposed action for an operator to approve; it is never executed",
            {
                "action": enum(ACTIONS, "action"),
                "target": service,
                "reason": text("evidence", 120),
            },
            propose_action,
        ),
    )
    system = system_prompt(
        "You are an incident assistant for a simulated edge service (a test environment).",
        [
            "You may only read status and logs and propose actions.",
            "Every proposal waits for a person's approval; you never execute anything.",
            "State your evidence for each proposal.",
        ],
        tools,
        [f"- Services: {' -> '.join(data.SERVICES)}.", "- Error-rate SLO: 1 %."],
    )
    return Scenario(
        "edge_incident",
        "Edge incident",
        "A simulated service (its own HTTP process): status and logs, a diagnosis, actions proposed for approval.",
        system,
        tools,
        "Alert: checkout-api error rate is above its SLO. Investigate and propose a mitigation.",
        ("What is the risk of your proposal?", "Draft a two-sentence status page update."),
    )


SCENARIOS: dict[str, Scenario] = {
    s.name: s for s in (financial_research(), field_maintenance(), edge_incident())
}
