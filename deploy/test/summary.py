"""Writes the summary of a passing `make deploy-test` (deploy/test/run.sh): what
check_stack.py saw (its --summary JSON) and the run's timings, as NAME.json and NAME.md in a
results directory (run.sh: last-pass-compose-v1 or -v2, by the compose version that ran). docs/deploy.md quotes these files instead of figures
written by hand.

    summary.py CHECK.json RESULTS_DIR --name last-pass-compose-v1 --set total_s=244 build_s=115 ...
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any


def markdown(data: dict[str, Any]) -> str:
    run = data["run"]
    prom = data.get("prometheus", {})
    lines = [
        "# Last passing `make deploy-test`",
        "",
        "Written by `deploy/test/run.sh` (via `deploy/test/summary.py`) when every check passed;"
        f" not edited by hand. The same figures as JSON: `{data['name']}.json`.",
        "",
        f"- finished: {data['finished']}",
        f"- host: {run.get('cores', '?')} cores, load average {run.get('load', '?')} at the end;"
        f" docker {run.get('engine', '?')}, compose `{run.get('compose', '?')}`",
        f"- knobs: SEED_FROM_HOST={run.get('seed_from_host', '0')}, SKIP_BUILD={run.get('skip_build', '0')};"
        f" base image `{run.get('base', '?')}` (local, debootstrap)",
        f"- build-time CA in the images: {run.get('ca_scan', '?')}",
        f"- wall time: {run.get('total_s', '?')} s in all; images {run.get('build_s', '?')} s;"
        f" model-volume race check {run.get('race_s', '?')} s"
        f" ({int(run.get('race_model_bytes', 0)) >> 20} MiB model, models-init then both servers"
        " healthy on a fresh volume); stack healthy"
        f" {run.get('healthy_s', '?')} s after `up`",
        "",
        "| request | route | server | prompt tokens | cached tokens |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    for r in data.get("requests", []):
        cached = r["cached_tokens"] if r["cached_tokens"] >= 0 else "(streamed)"
        lines.append(f"| {r['what']} | {r['route']} | {r['server']} | {r['prompt_tokens']} | {cached} |")
    cross = data.get("cross_server")
    lines.append("")
    if cross:
        lines.append(
            f"- restore across servers: KV exported by {cross['exporter']} restored on {cross['restorer']}"
            " through the shared payload volume"
        )
    lines += [
        f"- servers that served: {', '.join(data.get('servers_seen', []))}",
        f"- malformed request: HTTP {data.get('bad_request_status', '?')}",
        f"- Prometheus: {prom.get('cached_tokens_scraped', '?'):g} cached tokens scraped;"
        f" {prom.get('dashboard_queries_with_series', '?')} of {prom.get('dashboard_queries', '?')}"
        f" dashboard queries with series; servers {prom.get('servers', [])};"
        f" {prom.get('kv_imported_mb', '?')} MB of KV imported",
    ]
    lines.append(f"- dashboard: {run.get('dashboard_schema', '?')}")
    if run.get("panels", "0") != "0":
        lines += [
            f"- its {run['panels']} panels drawn from this Prometheus without Grafana into `panels/`"
            " (each passing run replaces them: they are the latest run's):"
            " [`panels/dashboard.png`](panels/dashboard.png), one `panels/panel-ID.png` per panel",
        ]
    if data.get("workbench"):
        lines += ["", "`radixctl workbench verify` against the workbench container:", ""]
        lines += [f"- {line}" for line in data["workbench"]]
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("check", type=Path, help="check_stack.py --summary output")
    parser.add_argument("results", type=Path, help="directory for NAME.json and NAME.md")
    parser.add_argument("--name", default="last-pass", help="the files' name (run.sh: last-pass-compose-vN)")
    parser.add_argument("--workbench", type=Path, help="`radixctl workbench verify` output")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="facts about the run")
    args = parser.parse_args()
    data: dict[str, Any] = json.loads(args.check.read_text())
    data["finished"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    data["run"] = dict(item.split("=", 1) for item in args.set)
    data["name"] = args.name
    if args.workbench and args.workbench.exists():
        data["workbench"] = [line.strip() for line in args.workbench.read_text().splitlines() if line.strip()]
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (args.results / f"{args.name}.md").write_text(markdown(data))


if __name__ == "__main__":
    main()
