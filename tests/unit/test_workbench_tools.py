"""The workbench's data, tools and incident service: deterministic answers, clear errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from proxy.bench.agents import agents
from proxy.traffic import data
from proxy.workbench import scenarios
from proxy.workbench.incident import build_incident_app
from proxy.workbench.scenarios import SCENARIOS
from proxy.workbench.tools import ToolContext, run_tool

CTX = ToolContext()


def call(scenario: str, name: str, **args: Any) -> Any:
    return json.loads(asyncio.run(run_tool(SCENARIOS[scenario].tool_map(), CTX, name, args)))


def test_statements_are_fixed_figures() -> None:
    got = call("financial_research", "get_statement", company="Altamira Foods", year=2023)
    assert got["revenue"] == 407.3 and got["current_assets"] == 88.9 and got["current_liabilities"] == 125.8
    assert call("financial_research", "get_statement", company="Altamira Foods", year=2023) == got


def test_ratio_follows_its_formula_from_the_statement() -> None:
    for company in data.COMPANIES:
        st = call("financial_research", "get_statement", company=company, year=2022)
        r = call("financial_research", "compute_ratio", company=company, ratio="current_ratio", year=2022)
        assert r["value"] == round(st["current_assets"] / st["current_liabilities"], 3)
        assert r["formula"] == "current assets / current liabilities"


def test_compare_periods_gives_the_change() -> None:
    got = call(
        "financial_research",
        "compare_periods",
        company="Altamira Foods",
        metric="revenue",
        from_year=2022,
        to_year=2023,
    )
    assert (got["from"]["value"], got["to"]["value"], got["change"], got["change_pct"]) == (
        415.9,
        407.3,
        -8.6,
        -2.1,
    )


def test_arguments_are_matched_loosely_and_bad_ones_name_the_choices() -> None:
    loose = call(
        "financial_research", "compute_ratio", company="altamira foods ", ratio="CURRENT_RATIO", year="2023"
    )
    assert loose["value"] == 0.707
    bad = call("financial_research", "get_statement", company="Acme", year=2023)
    assert "company must be one of Altamira Foods" in bad["error"]
    assert "unknown tool" in call("financial_research", "rm_rf")["error"]
    assert asyncio.run(
        run_tool(SCENARIOS["financial_research"].tool_map(), CTX, "list_companies", [])
    ) == json.dumps({"error": "arguments must be a JSON object"})


def test_the_faulty_device_drifts_past_its_limit_and_the_healthy_one_does_not() -> None:
    status = call("field_maintenance", "get_device_status", device_id="PMP-0400")
    assert status["state"] == "alarm" and status["active_alarm"] == "E101 (bearing temperature high)"
    trend = call("field_maintenance", "get_sensor_trend", device_id="PMP-0400", sensor="temp_c")
    assert trend["readings_past_limit"] == 6 and trend["change_per_reading"] > 1
    healthy = call("field_maintenance", "get_sensor_trend", device_id="FAN-0435", sensor="temp_c")
    assert healthy["readings_past_limit"] == 0
    assert call("field_maintenance", "get_device_status", device_id="FAN-0435")["state"] == "ok"
    log = call("field_maintenance", "read_device_log", device_id="PMP-0400", last_n=3)
    assert len(log) == 3 and all(line.endswith("status=E101") for line in log)
    manual = call("field_maintenance", "lookup_manual", model="Hydra-300 pump", code="E101")
    assert manual["section"].startswith("E101 (bearing temperature high): ")


def test_the_bench_still_builds_its_agents_workload_from_the_shared_data() -> None:
    work = agents(system_tokens=300, sessions=1)
    maint = next(r for r in work.requests if r.session == "maintenance-s0" and r.meta.get("turn") == 2)
    log = maint.body["messages"][-1]["content"].splitlines()
    assert log == data.device_log("PMP-0400", "E101", 8, 0)
    fin = next(r for r in work.requests if r.session == "finance-s0" and r.meta.get("turn") == 2)
    assert (
        json.loads(fin.body["messages"][-1]["content"])
        == data.financials(0, (2022, 2023))["Altamira Foods"][2023]
    )


def test_every_scenario_prompt_names_its_tools_and_the_text_protocol() -> None:
    for scenario in SCENARIOS.values():
        assert scenarios.PROTOCOL in scenario.system
        for tool in scenario.tools:
            assert f'"name": "{tool.name}"' in scenario.system
            schema = tool.call_schema()
            assert schema["properties"]["name"]["enum"] == [tool.name]


@contextlib.asynccontextmanager
async def incident_service() -> AsyncIterator[TestClient[Any, Any]]:
    """The incident app on a local port (the workbench runs it as its own process)."""
    client: TestClient[Any, Any] = TestClient(TestServer(build_incident_app()))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def test_incident_states_status_and_logs() -> None:
    async with incident_service() as incident:
        status = await (await incident.get("/services/checkout-api/status")).json()
        assert status["health"] == "degraded" and status["error_rate_pct"] > status["slo_error_rate_pct"]
        logs = (await (await incident.get("/services/checkout-api/logs?level=error&limit=5")).json())["lines"]
        assert len(logs) == 5 and all(" ERROR " in line for line in logs)
        assert (await (await incident.get("/services/edge-cache/status")).json())["health"] == "healthy"
        down = await (await incident.post("/services/edge-cache/state", json={"state": "down"})).json()
        assert down["health"] == "down" and down["replicas_ready"] == 0
        logs = (await (await incident.get("/services/edge-cache/logs?level=error")).json())["lines"]
        assert logs and all("connection refused" in line for line in logs)
        bad = await incident.post("/services/edge-cache/state", json={"state": "on fire"})
        assert bad.status == 400 and (await bad.json())["error"]["type"] == "invalid_request_error"
        assert (await incident.get("/services/nope/status")).status == 404


async def test_incident_proposals_wait_for_approval_and_are_never_executed() -> None:
    async with incident_service() as incident:
        before = await (await incident.get("/services/checkout-api/status")).json()
        made = await incident.post(
            "/proposals", json={"action": "rollback", "target": "checkout-api", "reason": "v1.5.0"}
        )
        proposal = await made.json()
        assert made.status == 201 and proposal["status"] == "pending_review" and proposal["executed"] is False
        approved = await (
            await incident.post(f"/proposals/{proposal['proposal_id']}/approve", json={"by": "ana"})
        ).json()
        assert (
            approved["status"] == "approved"
            and approved["executed"] is False
            and approved["reviewed_by"] == "ana"
        )
        assert await (await incident.get("/services/checkout-api/status")).json() == before
        assert (await incident.post("/proposals/P-999/approve")).status == 404


async def test_incident_tools_read_the_service_over_http() -> None:
    async with incident_service() as incident, aiohttp.ClientSession() as http:
        ctx = ToolContext(str(incident.make_url("")).rstrip("/"), http)
        tools = SCENARIOS["edge_incident"].tool_map()
        status = json.loads(await run_tool(tools, ctx, "get_service_status", {"service": "checkout-api"}))
        assert status["health"] == "degraded"
        logs = json.loads(await run_tool(tools, ctx, "query_logs", {"service": "checkout-api", "limit": 3}))
        assert len(logs["lines"]) == 3
        made = json.loads(
            await run_tool(tools, ctx, "propose_action", {"action": "restart", "target": "checkout-api"})
        )
        assert made["status"] == "pending_review" and made["executed"] is False
        down = ToolContext("http://127.0.0.1:9", http, timeout_s=2)
        assert (
            "did not answer"
            in json.loads(await run_tool(tools, down, "get_service_status", {"service": "edge-cache"}))[
                "error"
            ]
        )


def test_without_the_extra_the_commands_say_which_to_install(monkeypatch: Any) -> None:
    from click.testing import CliRunner

    from proxy.cli.main import main
    from proxy.workbench.launch import missing_extra

    monkeypatch.setitem(sys.modules, "langgraph.graph", None)  # makes the import fail
    assert "pip install 'llama-radix-proxy[workbench]'" in (missing_extra() or "")
    for args in (["serve"], ["verify", "--base-url", "http://127.0.0.1:9/v1"]):
        result = CliRunner().invoke(main, ["workbench", *args])
        assert result.exit_code == 2 and "install the workbench extra" in result.output


def test_verify_wants_the_openai_base_url() -> None:
    from click.testing import CliRunner

    from proxy.cli.main import main
    from proxy.workbench.launch import missing_extra

    if missing_extra() is not None:
        pytest.skip("needs the workbench extra")
    result = CliRunner().invoke(main, ["workbench", "verify", "--base-url", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "must be the proxy's OpenAI base ending in /v1" in result.output


def test_the_incident_process_does_not_outlive_the_one_that_started_it() -> None:
    import os
    import subprocess
    import time

    code = (
        "import os; from proxy.workbench.launch import IncidentProcess\n"
        "p = IncidentProcess().start(); print(p.proc.pid, flush=True); os._exit(0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, 9)
    raise AssertionError("the incident service outlived its parent")
