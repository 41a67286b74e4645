"""The package's layers, checked: import direction, no cycles, every module importable alone.

The static check reads every ``import`` in every module, including those inside functions
(a lazy import hides a cycle from the interpreter, not from this test); only imports under
``if TYPE_CHECKING:`` are left out, since they never run.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "proxy"

# What every part of the serving path may import from outside it.
SERVER_BASE = ("proxy.errors", "proxy.config", "proxy.core", "proxy.tokenizer")
# proxy.server's packages, top to bottom: each may import only those after it.
SERVER_LAYERS = ("api", "ops", "http", "coordinator", "tiers", "dataplane", "metrics")

# Which parts of the package each part may import (besides itself). The most specific
# prefix of a module's name decides. Read top to bottom, this is the layer order.
ALLOWED: dict[str, set[str]] = {
    "proxy": set(),
    "proxy.config": set(),
    "proxy.errors": set(),
    "proxy.core": {"proxy.errors", "proxy.config"},
    "proxy.tokenizer": {"proxy.errors"},
    "proxy.native": {"proxy.errors"},
    "proxy.server": {"proxy.errors", "proxy.config", "proxy.core", "proxy.tokenizer"},
    # The serving path's own layers (proxy/server/__init__.py), top to bottom: the composition
    # root, the client APIs, operations, the HTTP path, the coordinator, the tiers below RAM,
    # the data plane (the backend client), metrics.
    "proxy.server.app": {*SERVER_BASE, *(f"proxy.server.{p}" for p in SERVER_LAYERS)},
    **{
        f"proxy.server.{part}": {*SERVER_BASE, *(f"proxy.server.{p}" for p in SERVER_LAYERS[i + 1 :])}
        for i, part in enumerate(SERVER_LAYERS)
    },
    "proxy.cli": {
        "proxy.errors",
        "proxy.config",
        "proxy.core",
        "proxy.tokenizer",
        "proxy.native",
        "proxy.server",
    },
    # Traffic the bench and the workbench share (text, fictional data, the runner and its
    # manifests): over HTTP only, below both.
    "proxy.traffic": set(),
    "proxy.bench": {
        "proxy.errors",
        "proxy.config",
        "proxy.core",
        "proxy.native",
        "proxy.server",
        "proxy.cli.common",
        "proxy.cli.options",
        "proxy.traffic",
    },
    # The simulator drives the pure core only (docs/scale.md).
    "proxy.sim": {"proxy.errors", "proxy.config", "proxy.core"},
    # An app on top of the proxy: it reaches the proxy only over HTTP, so it imports none of
    # the server; it shares the bench's traffic (text, data, manifests) through proxy.traffic.
    "proxy.workbench": {"proxy.traffic"},
    # The command line's root is the one place that puts the benchmarks in.
    "proxy.cli.main": {
        "proxy.errors",
        "proxy.config",
        "proxy.native",
        "proxy.cli",
        "proxy.bench",
        "proxy.sim",
        "proxy.workbench.cli",
    },
    "proxy.cli.__main__": {"proxy.cli.main"},
}
# Modules that import LangGraph (the optional ``workbench`` extra).
NEEDS_WORKBENCH_EXTRA = {"proxy.workbench.graph", "proxy.workbench.app"}
# The pure core: no event loop, HTTP or metrics library.
CORE_FORBIDDEN = ("asyncio", "aiohttp", "prometheus_client")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str) -> set[str]:
    """Every module ``name`` imports at run time, anywhere in its body."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for stmt in node.orelse:
                visit(stmt)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, node.level - 1 packages up
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            # `from pkg import sub` imports the submodule pkg.sub when there is one.
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


GRAPH = {name: {m for m in imports_of(name) if m in MODULES and m != name} for name in MODULES}


def part_of(name: str) -> str:
    return max((p for p in ALLOWED if name == p or name.startswith(p + ".")), key=len)


def allowed(importer: str, imported: str) -> bool:
    if part_of(importer) == part_of(imported) or imported.startswith(importer + "."):
        return True
    return any(imported == p or imported.startswith(p + ".") for p in ALLOWED[part_of(importer)])


def test_the_module_list_is_complete() -> None:
    for must in ("proxy.core.radix", "proxy.server.app", "proxy.server.coordinator", "proxy.cli.main"):
        assert must in MODULES


def test_every_server_module_is_in_a_layer() -> None:
    """Nothing in proxy.server outside its packages but the composition root (``app``)."""
    loose = sorted(
        name for name in MODULES if name.startswith("proxy.server.") and part_of(name) == "proxy.server"
    )
    assert not loose, f"modules of proxy.server in no layer: {loose}"
    for part in SERVER_LAYERS:
        assert f"proxy.server.{part}" in MODULES


def test_imports_go_down_the_layers() -> None:
    bad = sorted(f"{a} imports {b}" for a, deps in GRAPH.items() for b in deps if not allowed(a, b))
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_core_is_pure() -> None:
    bad = sorted(
        f"{name} imports {m}"
        for name in MODULES
        if part_of(name) == "proxy.core"
        for m in imports_of(name)
        if m.split(".")[0] in CORE_FORBIDDEN
    )
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components over the static import graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(GRAPH):
        if v not in index:
            strong(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def _import_alone(name: str) -> tuple[str, int, str]:
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", f"import {name}"], capture_output=True, text=True, timeout=120
    )
    return name, proc.returncode, proc.stderr[-2000:]


def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    """Each module first, in its own interpreter, with warnings as errors: an import-order
    dependency or a deprecation shows up here, whatever order the suite imports things in."""
    skip = {"proxy.cli.__main__"}  # runs the CLI when imported
    if importlib.util.find_spec("langgraph") is None:  # the optional workbench extra
        skip |= NEEDS_WORKBENCH_EXTRA
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(_import_alone, sorted(set(MODULES) - skip)))
    failed = [f"{name}:\n{err}" for name, code, err in results if code != 0]
    assert not failed, "\n".join(failed)
