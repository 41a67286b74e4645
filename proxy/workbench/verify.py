"""``radixctl workbench verify``: the proxy and the workbench healthy, each assistant run once for real.

For each scenario: a session, the scenario's task (a final answer that is not empty and at
least one tool call), then its first follow-up on the same session, whose first model call
must reuse cached tokens. Everything goes through the workbench's HTTP API, as the page does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.workbench.scenarios import SCENARIOS

Say = Callable[[str], None]


class VerifyError(Exception):
    pass


@dataclass
class Outcome:
    scenario: str
    ok: bool
    line: str
    turns: list[dict[str, Any]]


async def _get(http: aiohttp.ClientSession, url: str) -> Any:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            body = await resp.json(content_type=None)
            if resp.status != 200:
                raise VerifyError(f"{url}: status {resp.status}: {body}")
            return body
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise VerifyError(f"{url}: {type(exc).__name__}: {exc}") from exc


async def check_health(http: aiohttp.ClientSession, proxy_base: str, workbench_url: str) -> str:
    root = proxy_base.rstrip("/").removesuffix("/v1")
    proxy = await _get(http, root + "/health")
    if proxy.get("status") != "ok":
        raise VerifyError(f"proxy at {root} is not healthy: {proxy}")
    bench = await _get(http, workbench_url + "/health")
    if bench.get("status") != "ok" or bench.get("incident") != "ok":
        raise VerifyError(f"workbench at {workbench_url} is not healthy: {bench}")
    return f"proxy {root}: ok; workbench {workbench_url}: ok (incident service {bench['incident']})"


async def run_turn(
    http: aiohttp.ClientSession, workbench_url: str, sid: str, message: str, parent: str | None
) -> dict[str, Any]:
    """Send one turn and read its event stream to the saved turn."""
    url = f"{workbench_url}/api/sessions/{sid}/turns"
    async with http.post(url, json={"message": message, "parent": parent}) as resp:
        if resp.status != 200:
            raise VerifyError(f"{url}: status {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode(errors="replace").strip()
            if line.startswith("data:"):
                event = json.loads(line[5:])
                if event.get("type") == "done":
                    turn: dict[str, Any] = event["turn"]
                    return turn
    raise VerifyError(f"{url}: the stream ended without a finished turn")


def _judge(name: str, first: dict[str, Any], follow: dict[str, Any]) -> Outcome:
    problems = []
    for label, turn in (("task", first), ("follow-up", follow)):
        if turn.get("error"):
            problems.append(f"{label}: model error: {turn['error']}")
        elif not turn["final"].strip():
            problems.append(f"{label}: empty final answer")
    if not first["tools"]:
        problems.append("task: no tool call")
    call = follow["calls"][0] if follow["calls"] else {}
    cached, prompt = call.get("cached_tokens") or 0, call.get("prompt_tokens") or 0
    if cached <= 0:
        problems.append(f"follow-up: no cached tokens reused (route {call.get('route')}, prompt {prompt})")
    tools = ", ".join(t["name"] for t in first["tools"])
    detail = (
        f"{len(first['calls'])} model calls, {len(first['tools'])} tool calls ({tools or 'none'}), "
        f"answer {len(first['final'])} chars; follow-up reused {cached} of {prompt} prompt tokens "
        f"(route {call.get('route')}, server {call.get('server')}, slot {call.get('slot')})"
    )
    if problems:
        return Outcome(name, False, f"{name}: FAILED: {'; '.join(problems)} [{detail}]", [first, follow])
    return Outcome(name, True, f"{name}: ok: {detail}", [first, follow])


async def verify_scenarios(
    proxy_base: str, workbench_url: str, say: Say, scenarios: tuple[str, ...] = tuple(SCENARIOS)
) -> list[Outcome]:
    outcomes = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        say(await check_health(http, proxy_base, workbench_url))
        for name in scenarios:
            scenario = SCENARIOS[name]
            try:
                async with http.post(workbench_url + "/api/sessions", json={"scenario": name}) as resp:
                    sid = (await resp.json())["id"]
                first = await run_turn(http, workbench_url, sid, scenario.task, None)
                follow = await run_turn(http, workbench_url, sid, scenario.followups[0], first["id"])
                outcome = _judge(name, first, follow)
            except (VerifyError, aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
                outcome = Outcome(name, False, f"{name}: FAILED: {type(exc).__name__}: {exc}", [])
            say(outcome.line)
            outcomes.append(outcome)
    return outcomes
