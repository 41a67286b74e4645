"""The Grafana dashboard against the dashboard schema of the Grafana version the compose file
pins (deploy/grafana/check_dashboard.py: Grafana's own schema from the npm registry, compiled
with TypeScript), and the check failing on dashboards that do not fit it. Grafana itself is
not run: its image comes from Docker Hub only (docs/deploy.md)."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
GRAFANA = DEPLOY / "grafana"


def load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_dashboard", GRAFANA / "check_dashboard.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


checker = load_checker()


@pytest.fixture(scope="module")
def install() -> Path:
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("node and npm are not installed: the Grafana schema comes from the npm registry")
    run = subprocess.run(
        [str(GRAFANA / "schema" / "install.sh")], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, f"deploy/grafana/schema/install.sh failed:\n{run.stderr}"
    return Path(run.stdout.strip().splitlines()[-1])


def dashboard() -> dict[str, Any]:
    return json.loads((GRAFANA / "llama-radix-proxy.json").read_text())


def check(install: Path, dash: dict[str, Any], tmp_path: Path) -> list[str]:
    path = tmp_path / "dashboard.json"
    path.write_text(json.dumps(dash))
    errors: list[str] = checker.check(path, install)
    return errors


def pinned_grafana() -> str:
    compose = (DEPLOY / "docker-compose.yml").read_text()
    match = re.search(r"\$\{GRAFANA_IMAGE:-grafana/grafana-oss:([0-9.]+)\}", compose)
    assert match, "deploy/docker-compose.yml pins no grafana/grafana-oss version"
    return match[1]


def test_the_schema_is_the_pinned_grafanas(install: Path) -> None:
    version = pinned_grafana()
    env = (DEPLOY / ".env.example").read_text()
    assert f"GRAFANA_IMAGE=grafana/grafana-oss:{version}\n" in env
    wanted = json.loads((GRAFANA / "schema" / "package.json").read_text())["devDependencies"]
    assert wanted["@grafana/schema"] == version
    for package in ("@grafana/schema", "@grafana/prometheus"):
        got = json.loads((install / "node_modules" / package / "package.json").read_text())["version"]
        assert got == version, package


def test_the_dashboard_fits_the_schema(install: Path) -> None:
    errors = checker.check(GRAFANA / "llama-radix-proxy.json", install)
    assert errors == []


def panel(dash: dict[str, Any], kind: str) -> dict[str, Any]:
    found: dict[str, Any] = next(p for p in dash["panels"] if p["type"] == kind)
    return found


def set_key(
    where: Callable[[dict[str, Any]], dict[str, Any]], key: str, value: Any
) -> Callable[[dict[str, Any]], None]:
    def mutate(dash: dict[str, Any]) -> None:
        where(dash)[key] = value

    return mutate


def rename_expr(dash: dict[str, Any]) -> None:
    target = panel(dash, "timeseries")["targets"][0]
    target["exp"] = target.pop("expr")


# (what, mutation, the path the error names, a word of the error)
BROKEN = [
    ("unknown dashboard field", set_key(lambda d: d, "refrsh", "10s"), "refrsh:", "known properties"),
    (
        "unknown stat option",
        set_key(lambda d: panel(d, "stat")["options"], "colourMode", "value"),
        "options.colourMode:",
        "known properties",
    ),
    (
        "stat graph mode not in the enum",
        set_key(lambda d: panel(d, "stat")["options"], "graphMode", "areas"),
        "options.graphMode:",
        "not assignable",
    ),
    (
        "grid position as a string",
        set_key(lambda d: panel(d, "stat")["gridPos"], "h", "4"),
        "gridPos.h:",
        "not assignable",
    ),
    (
        "time series draw style not in the enum",
        set_key(
            lambda d: panel(d, "timeseries")["fieldConfig"]["defaults"].setdefault("custom", {}),
            "drawStyle",
            "lines",
        ),
        "custom.drawStyle:",
        "not assignable",
    ),
    ("Prometheus target without expr", rename_expr, "targets[0].exp:", "known properties"),
    ("unknown panel type", set_key(lambda d: d["panels"][5], "type", "timeserie"), "panels[5].type:", "no"),
    (
        "schemaVersion from a newer Grafana",
        set_key(lambda d: d, "schemaVersion", 99),
        "schemaVersion:",
        "newer",
    ),
    (
        "datasource variable that does not exist",
        set_key(lambda d: d["panels"][0]["datasource"], "uid", "${DS_PROM}"),
        "panels[0].datasource.uid:",
        "no datasource variable",
    ),
    (
        "variable option without text and value",
        set_key(lambda d: d["templating"]["list"][0], "current", {}),
        "templating.list[0].current:",
        "missing",
    ),
]


@pytest.mark.parametrize(("what", "mutate", "path", "word"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_dashboard_that_does_not_fit_fails(
    install: Path, tmp_path: Path, what: str, mutate: Callable[[dict[str, Any]], None], path: str, word: str
) -> None:
    dash = copy.deepcopy(dashboard())
    mutate(dash)
    errors = check(install, dash, tmp_path)
    assert errors, f"{what}: no error"
    assert any(path in e and word in e for e in errors), f"{what}: {errors}"
