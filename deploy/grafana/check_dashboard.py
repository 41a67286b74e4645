"""Checks a Grafana dashboard file against the dashboard schema of the Grafana version that
deploy/docker-compose.yml pins, without Grafana (its image comes from Docker Hub only).

The schema is Grafana's own, for that version, from the npm registry (deploy/grafana/schema:
@grafana/schema, the TypeScript types Grafana generates from its CUE dashboard kind and from
each core panel's options and field config; the Prometheus query kind from @grafana/prometheus).
The dashboard is written out as a TypeScript object literal and compiled against those types
with `satisfies`, so the compiler reports every field the schema does not know (the kind's
structs are closed), every value of the wrong type and every enum value the version does not
have, with the JSON path it is at. On top of the types:

- a panel type must be one the version ships a panel schema for (or `row`);
- panel options and a panel's custom field config may be any subset of the panel's schema:
  Grafana merges them over the panel plugin's defaults when the panel loads;
- `schemaVersion` must not be newer than the version's (a newer dashboard is not migrated
  down, and its panels could be read wrongly);
- every datasource reference `${NAME}` must name a datasource variable of the dashboard;
- `__inputs`, `__requires` and `__elements`, the export envelope Grafana's import reads, are
  not part of the dashboard kind and are left out of the check.

    python deploy/grafana/check_dashboard.py [DASHBOARD.json ...]   # default: the project's

Exits 0 when every dashboard passes, 1 with the errors otherwise, 3 with a "skip:" line where
node or npm is missing. Needs the install of deploy/grafana/schema/install.sh (run by this
script, cached; `make grafana-schema`). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "llama-radix-proxy.json"
INSTALL = HERE / "schema" / "install.sh"
SKIP = 3
# The export envelope (Grafana's "Export for sharing externally"), read by its import only.
ENVELOPE = ("__inputs", "__requires", "__elements")
PANELCFG = "node_modules/@grafana/schema/dist/esm/raw/composable"

PRELUDE = """\
import type * as schema from "@grafana/schema";
import type { Prometheus } from "@grafana/prometheus";

// JSON has no enums: a string enum stands for its values.
type Json<T> = T extends string ? `${T}`
  : T extends number | boolean | null | undefined ? T
  : T extends readonly (infer U)[] ? Json<U>[]
  : T extends object ? { [K in keyof T]: Json<T[K]> }
  : T;
// Panel options and custom field config: merged over the plugin's defaults on load, so any
// subset of the schema, and nothing it does not know.
type Partially<T> = T extends string ? `${T}`
  : T extends number | boolean | null | undefined ? T
  : T extends readonly (infer U)[] ? Partially<U>[]
  : T extends object ? { [K in keyof T]?: Partially<T[K]> }
  : T;
type NoCustom = Record<string, never>;
type Query = Json<schema.DataQuery> & Record<string, unknown>;
type PanelOf<O, C, Q> = Omit<Json<schema.Panel>, "options" | "fieldConfig" | "targets"> & {
  options?: Partially<O>;
  fieldConfig?: Omit<Json<schema.FieldConfigSource>, "defaults"> & {
    defaults: Omit<Json<schema.FieldConfig>, "custom"> & { custom?: Partially<C> };
  };
  targets?: Q[];
};
type Row = Omit<Json<schema.RowPanel>, "panels"> & { panels: unknown[] };
type Envelope = Omit<Json<schema.Dashboard>, "panels"> & { panels?: unknown[] };
"""


class Literal:
    """A JSON value written as a TypeScript expression, remembering the JSON path of each line."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.paths: list[str] = []

    def emit(self, text: str, path: str) -> None:
        self.lines.append(text)
        self.paths.append(path)

    def value(self, value: Any, path: str, indent: int, lead: str, tail: str) -> None:
        pad = "  " * indent
        if isinstance(value, dict) and value:
            self.emit(f"{pad}{lead}{{", path)
            for i, (key, item) in enumerate(value.items()):
                comma = "," if i < len(value) - 1 else ""
                self.value(item, f"{path}.{key}" if path else key, indent + 1, f"{json.dumps(key)}: ", comma)
            self.emit(f"{pad}}}{tail}", path)
        elif isinstance(value, list) and value:
            self.emit(f"{pad}{lead}[", path)
            for i, item in enumerate(value):
                self.value(item, f"{path}[{i}]", indent + 1, "", "," if i < len(value) - 1 else "")
            self.emit(f"{pad}]{tail}", path)
        else:
            self.emit(f"{pad}{lead}{json.dumps(value, ensure_ascii=False)}{tail}", path)


def panelcfg(install: Path, panel_type: str) -> tuple[str, bool, bool] | None:
    """The module of a panel's schema in @grafana/schema: (module, has Options, has FieldConfig)."""
    if not re.fullmatch(r"[a-z0-9-]+", panel_type):
        return None
    found = sorted((install / PANELCFG / panel_type / "panelcfg" / "x").glob("*_types.gen.d.ts"))
    if not found:
        return None
    text = found[0].read_text()
    module = str(found[0].relative_to(install / "node_modules")).removesuffix(".d.ts")
    return module, "export interface Options" in text, "export interface FieldConfig" in text


def flatten(panels: list[Any], where: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for i, panel in enumerate(panels):
        out.append((f"{where}[{i}]", panel))
        if isinstance(panel, dict) and panel.get("type") == "row" and isinstance(panel.get("panels"), list):
            out += flatten(panel["panels"], f"{where}[{i}].panels")
    return out


def is_prometheus(panel: dict[str, Any], target: Any) -> bool:
    ds = target.get("datasource") if isinstance(target, dict) else None
    ds = ds if isinstance(ds, dict) else panel.get("datasource")
    return isinstance(ds, dict) and ds.get("type") == "prometheus"


def datasource_refs(value: Any, path: str) -> list[tuple[str, str]]:
    """Every datasource uid in the dashboard, with its path."""
    out: list[tuple[str, str]] = []
    if isinstance(value, dict):
        ds = value.get("datasource")
        if isinstance(ds, dict) and isinstance(ds.get("uid"), str):
            out.append((f"{path}.datasource.uid", ds["uid"]))
        for key, item in value.items():
            out += datasource_refs(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += datasource_refs(item, f"{path}[{i}]")
    return out


def generate(dash: dict[str, Any], install: Path) -> tuple[Literal, list[str]]:
    """The TypeScript program that type-checks `dash`, and the errors found before compiling."""
    errors: list[str] = []
    body = {k: v for k, v in dash.items() if k not in ENVELOPE}
    panels = body.get("panels", [])
    ts = Literal()
    for line in PRELUDE.splitlines():
        ts.emit(line, "")
    imports: dict[str, str] = {}
    checks: list[tuple[str, Any, str]] = []
    for path, panel in flatten(panels if isinstance(panels, list) else [], "panels"):
        kind = panel.get("type") if isinstance(panel, dict) else None
        if not isinstance(panel, dict) or not isinstance(kind, str):
            errors.append(f"{path}: a panel is an object with a string `type`")
            continue
        if kind == "row":
            checks.append((path, panel, "Row"))
            continue
        cfg = panelcfg(install, kind)
        if cfg is None:
            errors.append(f"{path}.type: {kind!r} is not a panel this Grafana version has a schema for")
            continue
        module, has_options, has_fields = cfg
        alias = imports.setdefault(module, f"P{len(imports)}")
        options = f"{alias}.Options" if has_options else "NoCustom"
        fields = f"{alias}.FieldConfig" if has_fields else "NoCustom"
        targets = panel.get("targets", [])
        prom = bool(targets) and isinstance(targets, list) and all(is_prometheus(panel, t) for t in targets)
        query = "Json<Prometheus>" if prom else "Query"
        checks.append((path, panel, f"PanelOf<{options}, {fields}, {query}>"))
    for module, alias in imports.items():
        ts.emit(f'import type * as {alias} from "{module}";', "")
    ts.emit("", "")
    ts.value(body, "", 0, "export const dashboard = ", " satisfies Envelope;")
    for i, (path, panel, type_) in enumerate(checks):
        ts.value(panel, path, 0, f"export const panel{i} = ", f" satisfies {type_};")
    variables = {
        v.get("name")
        for v in (body.get("templating") or {}).get("list") or []
        if isinstance(v, dict) and v.get("type") == "datasource"
    }
    for path, uid in datasource_refs(body, ""):
        for name in re.findall(r"\$\{(\w+)\}|\$(\w+)", uid):
            if (name[0] or name[1]) not in variables:
                errors.append(f"{path}: {uid!r} names no datasource variable of the dashboard")
    return ts, errors


def schema_version(install: Path) -> int:
    """The newest dashboard schemaVersion the pinned Grafana writes (its default dashboard's)."""
    out = subprocess.run(
        [
            "node",
            "-e",
            'process.stdout.write(String(require("@grafana/schema").defaultDashboard.schemaVersion))',
        ],
        cwd=install,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out)


def compile_errors(ts: Literal, install: Path) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="radix-dashboard-") as tmp:
        (Path(tmp) / "dashboard.ts").write_text("\n".join(ts.lines) + "\n")
        config = {
            "compilerOptions": {
                "strict": True,
                "noEmit": True,
                "skipLibCheck": True,
                "target": "es2022",
                "module": "commonjs",
                "moduleResolution": "node",
                "types": [],
                "baseUrl": ".",
                "paths": {"*": [str(install / "node_modules" / "*")]},
            },
            "files": ["dashboard.ts"],
        }
        (Path(tmp) / "tsconfig.json").write_text(json.dumps(config))
        tsc = install / "node_modules" / "typescript" / "bin" / "tsc"
        run = subprocess.run(
            ["node", str(tsc), "-p", tmp, "--pretty", "false"], capture_output=True, text=True, check=False
        )
    if run.returncode == 0:
        return []
    errors: list[str] = []
    for line in run.stdout.splitlines():
        match = re.match(r".*dashboard\.ts\((\d+),(\d+)\): error (TS\d+): (.*)", line)
        if match:
            n = int(match[1]) - 1
            where = ts.paths[n] if n < len(ts.paths) else "?"
            errors.append(f"{where or '(schema)'}: {match[4]} [{match[3]}]\n      {ts.lines[n].strip()}")
        elif errors and line.startswith(" "):
            errors[-1] += f"\n    {line.strip()}"
        elif line.strip():
            errors.append(line)
    return errors or [f"tsc exited {run.returncode}: {run.stdout}{run.stderr}"]


def check(path: Path, install: Path) -> list[str]:
    """Every way the dashboard at `path` does not fit the pinned Grafana's schema."""
    try:
        dash = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return [f"not a JSON file: {err}"]
    if not isinstance(dash, dict):
        return ["a dashboard is a JSON object"]
    ts, errors = generate(dash, install)
    newest = schema_version(install)
    version = dash.get("schemaVersion")
    if isinstance(version, int) and version > newest:
        errors.append(f"schemaVersion: {version} is newer than this Grafana's ({newest})")
    return errors + compile_errors(ts, install)


def install_schema() -> Path:
    if not shutil.which("node") or not shutil.which("npm"):
        print("skip: node and npm are needed for the Grafana dashboard schema check", file=sys.stderr)
        sys.exit(SKIP)
    run = subprocess.run([str(INSTALL)], capture_output=True, text=True, check=False)
    if run.returncode != 0:
        sys.stderr.write(run.stderr)
        sys.exit(SKIP if run.returncode == SKIP else 1)
    return Path(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dashboards", nargs="*", type=Path, default=[DASHBOARD])
    args = parser.parse_args()
    install = install_schema()
    version = json.loads((install / "node_modules/@grafana/schema/package.json").read_text())["version"]
    failed = 0
    for path in args.dashboards:
        errors = check(path, install)
        if errors:
            failed += 1
            print(f"{path}: {len(errors)} errors against the Grafana {version} dashboard schema:")
            for error in errors:
                print(f"  {error}")
        else:
            print(f"{path}: fits the Grafana {version} dashboard schema")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
