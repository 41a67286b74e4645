"""The workbench end to end: the real proxy, patched llama-server and default model, the
incident service as its own process, the workbench app over HTTP, and the page in a real
headless browser (Debian's chromium driven by selenium).

Short on purpose: few turns, small ``max_tokens``. The screenshot of the page test is saved
under pytest's tmp dir, and also to ``$WORKBENCH_SCREENSHOT`` when that is set (how
docs/workbench.png was made).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langgraph", reason="needs the workbench extra: pip install -e '.[workbench]'")

from aiohttp import web  # noqa: E402

from proxy.native.launch import ServerProcess, free_port  # noqa: E402
from proxy.workbench.app import WorkbenchConfig, build_workbench_app  # noqa: E402
from proxy.workbench.launch import IncidentProcess  # noqa: E402
from proxy.workbench.protocol import AgentSettings  # noqa: E402
from proxy.workbench.scenarios import SCENARIOS  # noqa: E402
from proxy.workbench.verify import verify_scenarios  # noqa: E402
from tests.helpers import ProxyThread, ServerFactory, get, post, proxy_config, request  # noqa: E402


class AppThread:
    """An aiohttp app on its own loop in a background thread."""

    def __init__(self, app: web.Application) -> None:
        self.app, self.port = app, free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner = web.AppRunner(app)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> AppThread:
        self.thread.start()

        async def up() -> None:
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

        asyncio.run_coroutine_threadsafe(up(), self.loop).result(60)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def proxy(start_server: ServerFactory, patched_bin: Path) -> Iterator[ProxyThread]:
    backend: ServerProcess = start_server(patched_bin)
    proxy = ProxyThread(proxy_config(backend)).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def workbench(proxy: ProxyThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppThread]:
    tmp = tmp_path_factory.mktemp("workbench")
    with IncidentProcess(log=tmp / "incident.log") as incident:
        config = WorkbenchConfig(
            proxy.url + "/v1",
            incident.url,
            str(tmp / "sessions.sqlite3"),
            settings=AgentSettings(max_steps=2, max_tokens=32),
        )
        app = AppThread(build_workbench_app(config)).start()
        yield app
        app.stop()


def _browser() -> Any:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("Debian's chromium and chromium-driver are not installed (make browser installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def test_the_page_streams_an_answer_and_shows_the_trace(workbench: AppThread, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser = _browser()
    try:
        browser.get(workbench.url + "/")
        wait = WebDriverWait(browser, 600, poll_frequency=0.05)
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#scenario option"))
        Select(browser.find_element(By.ID, "scenario")).select_by_value("field_maintenance")
        browser.find_element(By.ID, "new-session").click()
        box = browser.find_element(By.ID, "message")
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#sessions li.current"))
        assert box.get_attribute("value") == SCENARIOS["field_maintenance"].task
        browser.find_element(By.ID, "send").click()
        # Streamed: text shows up in a live bubble before the turn is done.
        wait.until(
            lambda b: any(e.text.strip() for e in b.find_elements(By.CSS_SELECTOR, ".msg.assistant.live"))
        )
        streamed_before_done = not browser.find_elements(By.CSS_SELECTOR, ".msg.assistant.answer")
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, ".msg.assistant.answer"))
        answer = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant.answer")[-1].text
        # Read everything while the browser is open (elements are gone after quit).
        rows = browser.find_elements(By.CSS_SELECTOR, "#trace tr.trace-call")
        routes = [r.find_elements(By.TAG_NAME, "td")[2].text for r in rows]
        timeline = len(browser.find_elements(By.CSS_SELECTOR, "#timeline .timeline-row"))
        tools = len(browser.find_elements(By.CSS_SELECTOR, "#chat details.tool"))
        tree = len(browser.find_elements(By.CSS_SELECTOR, "#tree .tree-node[data-turn]"))
        sessions = len(browser.find_elements(By.CSS_SELECTOR, "#sessions li"))
        shot = tmp_path / "workbench.png"
        browser.save_screenshot(str(shot))
        if os.environ.get("WORKBENCH_SCREENSHOT"):
            shutil.copy(shot, os.environ["WORKBENCH_SCREENSHOT"])
        print(f"screenshot: {shot}")
    finally:
        browser.quit()
    assert streamed_before_done
    assert answer.strip() and answer != "(empty answer)"
    assert len(routes) >= 2 and set(routes) <= {"A", "H", "S", "prefill"}, routes
    assert tools >= 1 and timeline == 1 and tree == 1 and sessions == 1
    assert shot.stat().st_size > 10_000


def test_each_assistant_answers_with_tools_and_the_follow_up_reuses_the_cache(
    proxy: ProxyThread, workbench: AppThread
) -> None:
    lines: list[str] = []
    outcomes = asyncio.run(verify_scenarios(proxy.url + "/v1", workbench.url, lines.append))
    print("\n".join(lines))
    assert [o.scenario for o in outcomes] == list(SCENARIOS)
    for outcome in outcomes:
        assert outcome.ok, outcome.line
        first, follow = outcome.turns
        assert first["final"].strip() and follow["final"].strip()
        assert first["tools"] and all(
            "error" not in json.loads(t["result"]) or t["name"] for t in first["tools"]
        )
        call = follow["calls"][0]
        assert call["cached_tokens"] > 0 and call["prompt_tokens"] > call["cached_tokens"] >= 0
        assert call["route"] in ("A", "H", "S") and call["server"] and call["slot"] is not None
        assert call["ttft_s"] is not None and call["prefilled_tokens"] is not None
    # The edge incident's tools read the service process: the status came back as data.
    incident = next(o for o in outcomes if o.scenario == "edge_incident").turns[0]
    assert any(
        t["name"] == "get_service_status" and "degraded" in t["result"] for t in incident["tools"]
    ) or any("error" not in t["result"] for t in incident["tools"])


def test_a_session_exports_a_manifest_that_replays_through_the_proxy(
    proxy: ProxyThread, workbench: AppThread
) -> None:
    sessions = get(workbench.url + "/api/sessions").body
    assert sessions, "run after the verify test, which made the sessions"
    sid = sessions[0]["id"]
    raw = get(workbench.url + f"/api/sessions/{sid}/manifest").body
    text = raw if isinstance(raw, str) else json.dumps(raw)
    lines = [json.loads(x) for x in text.splitlines() if x.strip()]
    assert lines and all(x["path"] == "/v1/chat/completions" and x["body"]["messages"] for x in lines)
    ndjson = {"Content-Type": "application/x-ndjson"}
    replay = post(workbench.url + "/api/replay?speed=50", None, raw=text.encode(), headers=ndjson)
    assert replay.status == 200, replay.body
    results = replay.body["results"]
    assert len(results) == len(lines) and all(r["status"] == 200 for r in results)
    assert max(r["cache_n"] or 0 for r in results) > 0  # replayed prompts are found in the cache
    bad = post(workbench.url + "/api/replay", None, raw=b"not json", headers=ndjson)
    assert bad.status == 400 and bad.body["error"]["type"] == "invalid_request_error"
    # A target elsewhere: "@evil.example/x" after the proxy's base URL names another host.
    away = json.dumps({**lines[0], "path": "@evil.example/x"}).encode()
    refused = post(workbench.url + "/api/replay", None, raw=away, headers=ndjson)
    assert refused.status == 400 and "completion paths" in refused.body["error"]["message"]


def test_a_page_elsewhere_cannot_drive_the_workbench(workbench: AppThread) -> None:
    # A cross-site page may post text/plain without a preflight: the body is not read as JSON.
    plain = post(
        workbench.url + "/api/sessions",
        None,
        raw=b'{"scenario": "edge_incident"}',
        headers={"Content-Type": "text/plain"},
    )
    assert plain.status == 415 and plain.body["error"]["code"] == 415
    replay = post(workbench.url + "/api/replay", None, raw=b"{}", headers={"Content-Type": "text/plain"})
    assert replay.status == 415
    # DNS rebinding: local by address, but the browser names the page's own host.
    rebound = request(workbench.url + "/api/sessions", headers={"Host": "evil.example"})
    assert rebound.status == 403 and "--allowed-host" in rebound.body["error"]["message"]
    assert get(workbench.url + "/api/sessions").status == 200


def test_health_and_bad_input(workbench: AppThread) -> None:
    health = get(workbench.url + "/health").body
    assert health["status"] == "ok" and health["incident"] == "ok"
    assert post(workbench.url + "/api/sessions", {"scenario": "nope"}).status == 400
    assert post(workbench.url + "/api/sessions/nope/turns", {"message": "hi"}).status == 404
    sid = post(workbench.url + "/api/sessions", {"scenario": "edge_incident"}).body["id"]
    assert post(workbench.url + f"/api/sessions/{sid}/turns", {"message": ""}).status == 400
    preview = post(workbench.url + f"/api/sessions/{sid}/preview", {"message": "Status?"}).body
    assert preview["body"]["messages"][-1] == {"role": "user", "content": "Status?"}
    assert preview["body"]["tool_choice"] == "required" and preview["url"].endswith("/v1/chat/completions")
