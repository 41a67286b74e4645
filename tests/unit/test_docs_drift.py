"""Docs that cannot drift from the code: the metric tables of docs/observability.md against
the families the proxy registers, the Grafana dashboard's queries against the same families,
and the repository paths the docs, the README, pyproject.toml and the code's comments cite."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from prometheus_client import CollectorRegistry

from proxy.server.metrics import Metrics

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "docs" / "observability.md"
# Every JSON under deploy/ but npm's manifests (deploy/grafana/schema: the Grafana schema's install).
DASHBOARDS = sorted(
    p for p in (ROOT / "deploy").rglob("*.json") if p.name not in ("package.json", "package-lock.json")
)

# ---- metric names -------------------------------------------------------------------------------


def registered() -> dict[str, str]:
    """{family name as the docs write it: type}; a counter's samples are ``name_total``."""
    registry = CollectorRegistry()
    Metrics(registry, ("s0", "s1"))
    out = {}
    for family in registry.collect():
        name = f"{family.name}_total" if family.type == "counter" else family.name
        out[name] = family.type
    return out


def exposed() -> set[str]:
    """Every series name /metrics can show (a histogram's three, not the bare family)."""
    out: set[str] = set()
    for name, kind in registered().items():
        out |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return out


def table_rows(path: Path, header: str) -> Iterator[list[str]]:
    """The cells of every body row of the Markdown tables whose header line starts with
    ``header`` (an escaped ``\\|`` stays inside its cell)."""
    in_table = False
    for line in path.read_text().splitlines():
        if line.startswith(header):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("|---"):
            yield [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


def documented() -> set[str]:
    """Metric names in the first column of the metric tables of docs/observability.md."""
    out: set[str] = set()
    for cells in table_rows(OBSERVABILITY, "| metric |"):
        out |= set(re.findall(r"`([a-z_:]+)`", cells[0]))
    return out


def test_the_metric_tables_are_found() -> None:
    # Guards the parser: a reshaped table must not make the two tests below pass vacuously.
    assert len(documented()) > 40


def test_every_registered_metric_is_documented() -> None:
    missing = sorted(set(registered()) - documented())
    assert not missing, f"registered but not in docs/observability.md: {missing}"


def test_every_documented_metric_is_registered() -> None:
    stale = sorted(documented() - set(registered()))
    assert not stale, f"in docs/observability.md but not registered: {stale}"


# ---- dashboard queries ----------------------------------------------------------------------------

# Metrics the dashboard may query that llama-server exports itself (its `--metrics`, names
# `llamacpp:*`) rather than the proxy. None today: every panel reads the proxy's /metrics,
# which is the only target deploy/prometheus.yml scrapes. Add a name here with that target.
SERVER_METRICS: frozenset[str] = frozenset()

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
PROMQL_WORDS |= {"and", "or", "unless", "inf", "nan"}


def is_promql(node: dict[str, Any], key: str, value: Any) -> bool:
    # A variable's "query" is PromQL only for a query variable (a data source one names a type).
    wanted = key in ("expr", "definition") or (key == "query" and node.get("type") == "query")
    return wanted and isinstance(value, str)


def queries(node: Any) -> Iterator[str]:
    """Every PromQL expression of a dashboard: panel targets and query variables."""
    if isinstance(node, dict):
        for key, value in node.items():
            if is_promql(node, key, value):
                yield value
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads (label_values' label argument excluded)."""
    expr = re.sub(r"label_values\(\s*([^,)]+),[^)]*\)", r"\1", expr)
    expr = re.sub(r'"[^"]*"', "", expr)  # string literals (label values)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)  # label matchers, ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    words = re.findall(r"(?<![\w$.])([A-Za-z_:][\w:]*)\b(?!\s*\()", expr)
    return {w for w in words if w.lower() not in PROMQL_WORDS}


def test_metric_names_are_read_from_promql() -> None:
    expr = 'histogram_quantile(0.95, sum by (le, route) (rate(radix_ttft_seconds_bucket{server=~"$server"}[5m])))'
    assert metric_names(expr) == {"radix_ttft_seconds_bucket"}
    assert metric_names("label_values(radix_requests_total, server)") == {"radix_requests_total"}
    assert metric_names("a - b / clamp_min(c, 1) * 60") == {"a", "b", "c"}


def test_there_is_a_dashboard() -> None:
    assert DASHBOARDS, "no dashboard JSON under deploy/"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_dashboard_queries_only_metrics_that_exist(path: Path) -> None:
    found = list(queries(json.loads(path.read_text())))
    assert found, f"{path} has no query"
    used = set().union(*(metric_names(q) for q in found))
    unknown = sorted(used - exposed() - SERVER_METRICS)
    assert not unknown, f"{path.name} queries metrics nobody exports: {unknown}"


# ---- cited paths ----------------------------------------------------------------------------------

TOP = ("proxy", "tests", "docs", "deploy", "native", ".ci")
# A token that starts at a top-level folder; kept only when it ends in a file extension or "/".
TOPS = "|".join(re.escape(t) for t in TOP)
PATH_TOKEN = re.compile(rf"(?<![\w./-])((?:{TOPS})/[\w./*-]+)")
ROOT_DOC = re.compile(r"(?<![\w./-])([A-Z][A-Z_]*\.md)\b")  # README.md, CHANGELOG.md


def cited_in(text: str) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(text.splitlines(), 1):
        for match in PATH_TOKEN.finditer(line):
            path = match.group(1).rstrip(".,;:")
            if "*" not in path and (path.endswith("/") or Path(path).suffix):
                yield number, path
        for match in ROOT_DOC.finditer(line):
            yield number, match.group(1)


def citing_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md"))]
    return files + sorted((ROOT / "proxy").rglob("*.py"))


def test_cited_paths_are_found() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(list(cited_in(text))) > 20
    assert list(cited_in("see `docs/a.md`, deploy/k8s/ and proxy/core/radix.py.")) == [
        (1, "docs/a.md"),
        (1, "deploy/k8s/"),
        (1, "proxy/core/radix.py"),
    ]


def test_cited_repository_paths_exist() -> None:
    broken = []
    for path in citing_files():
        for number, cited in cited_in(path.read_text()):
            if not (ROOT / cited).exists() and not (path.parent / cited).exists():
                broken.append(f"{path.relative_to(ROOT)}:{number}: {cited}")
    assert not broken, "cited but not in the repository:\n" + "\n".join(broken)


def test_package_data_globs_match_files() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package, globs in project["tool"]["setuptools"]["package-data"].items():
        for pattern in globs:
            assert list((ROOT / package).glob(pattern)), f"package-data {package}: {pattern} matches nothing"


# ---- the module map -----------------------------------------------------------------------------


def layers_block() -> str:
    """The code block under "## Layers" of docs/design.md (the README points there)."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Layers", 1)[1]
    return section.split("```", 2)[1]


def test_the_layers_list_every_package_and_top_level_module() -> None:
    proxy = ROOT / "proxy"
    names = [f"proxy/{p.parent.name}/" for p in sorted(proxy.glob("*/__init__.py"))]
    names += [f"proxy/{p.name}" for p in sorted(proxy.glob("*.py")) if p.name != "__init__.py"]
    missing = [n for n in names if n not in layers_block()]
    assert not missing, f"not in docs/design.md's Layers: {missing}"


# ---- the README's options table -------------------------------------------------------------------

README = ROOT / "README.md"


def readme_options() -> dict[str, str]:
    """{flag: its default cell} of the README's options table (a row may name several flags)."""
    out: dict[str, str] = {}
    for cells in table_rows(README, "| option (`RADIX_*` env) |"):
        for flag in re.findall(r"`(--[a-z][a-z-]*)", cells[0]):
            out[flag] = cells[1]
    return out


def proxy_cli_options() -> dict[str, click.Option]:
    """{flag: option} of ``radixctl serve``: every option of the proxy itself."""
    from proxy.cli.serve import serve

    return {p.opts[0]: p for p in serve.params if isinstance(p, click.Option)}


def shown_default(option: click.Option) -> str | None:
    """The default as a reader of the table would write it; None when there is no value."""
    if option.is_flag:
        return "on" if option.default is True else "off"
    # No default is None, or click's own "unset" marker (not a plain value).
    return str(option.default) if isinstance(option.default, str | int | float) else None


def table_says(cell: str, default: str) -> bool:
    """The cell starts with the default: ``16`` for 16.0, ``on``, ``field,header,api-key``."""
    words = cell.replace("`", "").split()
    first = words[0] if words else ""
    try:
        return float(first) == float(default)
    except ValueError:
        return first == default


def test_the_options_table_is_found() -> None:
    assert len(readme_options()) > 40
    assert table_says("16", "16.0") and table_says("0 (auto: half the pool)", "0")
    assert table_says("`field,header,api-key`", "field,header,api-key") and not table_says("on", "off")


def test_every_proxy_option_is_in_the_readme_table_and_no_other() -> None:
    table, cli = set(readme_options()), set(proxy_cli_options())
    assert not cli - table, (
        f"options of radixctl serve missing from the README's table: {sorted(cli - table)}"
    )
    assert not table - cli, f"in the README's options table but not options of serve: {sorted(table - cli)}"


def test_the_readme_table_gives_each_option_its_default() -> None:
    table = readme_options()
    wrong = []
    for flag, option in proxy_cli_options().items():
        default = shown_default(option)
        if default is not None and not table_says(table[flag], default):
            wrong.append(f"{flag}: the CLI's default is {default}, the README says {table[flag]!r}")
    assert not wrong, "\n".join(wrong)


def test_the_reject_reasons_are_documented() -> None:
    from proxy.errors import RejectReason

    rows = [c for c in table_rows(OBSERVABILITY, "| metric |") if "`radix_rejected_requests_total`" in c[0]]
    assert len(rows) == 1
    assert set(re.findall(r"`([a-z_]+)`", rows[0][2])) == {r.value for r in RejectReason}
