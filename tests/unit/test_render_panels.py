"""deploy/grafana/render_panels.py: the dashboard's queries sent as Grafana sends them, and every
panel drawn, against a stand-in Prometheus (make deploy-test runs it against the real one)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.unit

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
SCRIPT = GRAFANA / "render_panels.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_panels", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["render_panels"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


render = load()


def test_variables_are_grafanas() -> None:
    variables = render.grafana_vars(600, 15)
    assert variables["__rate_interval"] == "60s"  # max(step + 15 s, 60 s)
    assert render.grafana_vars(3600, 90)["__rate_interval"] == "105s"
    expr = 'sum(increase(x{server=~"$server"}[$__range])) / rate(y[$__rate_interval])'
    assert render.substitute(expr, variables) == 'sum(increase(x{server=~".*"}[600s])) / rate(y[60s])'
    with pytest.raises(ValueError, match="unknown dashboard variable"):
        render.substitute("rate(x[$__interval_ms])", variables)


def test_legends_and_units() -> None:
    assert render.legend("p95 {{route}}", {"route": "H"}, "e") == "p95 H"
    assert render.legend("", {"__name__": "up", "job": "j"}, "e") == 'up{job="j"}'
    assert render.fmt_unit(0.5, "percentunit") == "50%"
    assert render.fmt_unit(3 * 1024**2, "bytes") == "3 MiB"
    assert render.fmt_unit(0.25, "s") == "250 ms"
    assert render.fmt_unit(12_500, "short") == "12.5 k"
    assert render.fmt_unit(2, "x") == "2 x"


def test_every_panel_of_the_dashboard_has_queries() -> None:
    panels = render.load_panels(GRAFANA / "llama-radix-proxy.json")
    dash = json.loads((GRAFANA / "llama-radix-proxy.json").read_text())
    assert [p.id for p in panels] == [p["id"] for p in dash["panels"]]
    assert all(p.queries and len(p.queries) == len(p.legends) for p in panels)


class FakePrometheus(BaseHTTPRequestHandler):
    """Answers every range query with two series of made-up values; remembers the queries."""

    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:
        url = urllib.parse.urlparse(self.path)
        args = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
        FakePrometheus.seen.append(args)
        start, end, step = float(args["start"]), float(args["end"]), float(args["step"])
        times = [start + i * step for i in range(int((end - start) / step) + 1)]
        result: list[dict[str, Any]] = [
            {
                "metric": {
                    "route": route,
                    "server": "s0",
                    "direction": "import",
                    "tier": "host",
                    "cause": "c",
                },
                "values": [[t, str(k + i % 7)] for i, t in enumerate(times)],
            }
            for k, route in enumerate(("H", "prefill"))
        ]
        body = json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def prometheus() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakePrometheus)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakePrometheus.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_every_panel_is_drawn(prometheus: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[dashboard]')")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--prometheus", prometheus, "--out", str(tmp_path), "--minutes", "10"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    dash = json.loads((GRAFANA / "llama-radix-proxy.json").read_text())
    n_queries = sum(len(p["targets"]) for p in dash["panels"])
    assert len(FakePrometheus.seen) == n_queries
    assert not [q["query"] for q in FakePrometheus.seen if "$" in q["query"]]
    assert {q["step"] for q in FakePrometheus.seen} == {"15"}  # 600 s over >= 240 px: Grafana's 15 s floor
    drawn = json.loads((tmp_path / "panels.json").read_text())
    assert [p["id"] for p in drawn] == [p["id"] for p in dash["panels"]]
    assert all(len(p["series"]) == 2 * len(p["queries"]) for p in drawn)
    for p in dash["panels"]:
        assert (tmp_path / f"panel-{p['id']}.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
