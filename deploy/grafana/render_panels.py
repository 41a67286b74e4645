"""Draws every panel of the Grafana dashboard from a real Prometheus, with matplotlib, so the
dashboard can be seen without Grafana (its image comes from Docker Hub only; docs/deploy.md).

Each panel's queries are sent as Grafana sends them: range queries over the chosen range, the
step Grafana picks (the range over the panel's data points, at least the data source's 15 s
default interval), `$__interval` that step, `$__rate_interval` max(step + 15 s, 60 s),
`$__range` the range, `$server` every server. Time series panels plot every series with its
legend (`legendFormat`) and unit, stacked where the panel stacks; stat panels show the last
value (Grafana's `lastNotNull`) with the sparkline under it. Field overrides and thresholds are
not drawn.

    python deploy/grafana/render_panels.py --prometheus http://127.0.0.1:9090 \
        --out DIR [--dashboard deploy/grafana/llama-radix-proxy.json] [--minutes 10 | --since UNIXTIME]

Writes DIR/panel-<id>.png for each panel, DIR/dashboard.png with all of them laid out on
Grafana's grid, and DIR/panels.json (per panel: title, queries, series drawn). Needs
matplotlib (`pip install -e '.[dashboard]'`); exits 3 with a "skip:" line without it, 1 when
a query fails.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SKIP = 3
MIN_INTERVAL_S = 15  # Grafana's default for a Prometheus data source without timeInterval
GRID_COLUMNS = 24
ROW_PX = 30  # Grafana's grid row height
COLUMN_PX = 60  # a 1440 px wide dashboard


@dataclass
class Series:
    name: str
    times: list[float]
    values: list[float]


@dataclass
class Panel:
    id: int
    kind: str
    title: str
    unit: str
    grid: dict[str, int]
    stacked: bool
    fill: float
    queries: list[str] = field(default_factory=list)
    legends: list[str] = field(default_factory=list)
    series: list[Series] = field(default_factory=list)


def grafana_vars(range_s: int, step_s: int) -> dict[str, str]:
    return {
        "__rate_interval": f"{max(step_s + MIN_INTERVAL_S, 60)}s",
        "__interval": f"{step_s}s",
        "__range": f"{range_s}s",
        "server": ".*",
    }


def substitute(expr: str, variables: dict[str, str]) -> str:
    """`$name` and `${name}` replaced by the variable's value; an unknown one is an error."""

    def value(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        if name not in variables:
            raise ValueError(f"unknown dashboard variable ${name} in {expr!r}")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def legend(fmt: str, labels: dict[str, str], expr: str) -> str:
    if not fmt:
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
        return f"{labels.get('__name__', expr)}{{{inner}}}" if inner else labels.get("__name__", expr)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), fmt)


def query_range(prometheus: str, expr: str, start: float, end: float, step_s: int) -> list[dict[str, Any]]:
    args = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step_s})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{args}", timeout=30) as reply:
        body = json.load(reply)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus rejected {expr!r}: {body}")
    return list(body["data"]["result"])


def load_panels(dashboard: Path) -> list[Panel]:
    dash = json.loads(dashboard.read_text())
    out: list[Panel] = []

    def walk(items: list[dict[str, Any]]) -> None:
        for item in items:
            if item.get("type") == "row":
                walk(item.get("panels", []))
                continue
            defaults = item.get("fieldConfig", {}).get("defaults", {})
            custom = defaults.get("custom", {})
            panel = Panel(
                id=int(item["id"]),
                kind=str(item["type"]),
                title=str(item.get("title", "")),
                unit=str(defaults.get("unit", "short")),
                grid=dict(item["gridPos"]),
                stacked=custom.get("stacking", {}).get("mode", "none") != "none",
                fill=float(custom.get("fillOpacity", 0)) / 100,
            )
            targets = [t for t in item.get("targets", []) if t.get("expr") and not t.get("hide")]
            panel.queries = [t["expr"] for t in targets]
            panel.legends = [t.get("legendFormat", "") for t in targets]
            out.append(panel)

    walk(dash.get("panels", []))
    return out


def fetch(panel: Panel, prometheus: str, start: float, end: float) -> None:
    range_s = int(end - start)
    width_px = panel.grid["w"] * COLUMN_PX
    step_s = max(MIN_INTERVAL_S, math.ceil(range_s / width_px))
    variables = grafana_vars(range_s, step_s)
    for expr, fmt in zip(panel.queries, panel.legends, strict=True):
        for result in query_range(prometheus, substitute(expr, variables), start, end, step_s):
            points = [(float(t), float(v)) for t, v in result["values"] if math.isfinite(float(v))]
            panel.series.append(
                Series(legend(fmt, result["metric"], expr), [p[0] for p in points], [p[1] for p in points])
            )


def num(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def si(value: float, suffix: str = "") -> str:
    for limit, mark in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g} {mark}{suffix}".rstrip()
    return f"{value:.3g} {suffix}".rstrip()


def fmt_unit(value: float, unit: str) -> str:
    """A value as Grafana shows it for the units the dashboard uses (others: a suffix)."""
    if unit == "percentunit":
        return f"{num(value * 100)}%"
    if unit == "percent":
        return f"{num(value)}%"
    if unit in ("bytes", "decbytes"):
        base, marks = (
            (1024, ("B", "KiB", "MiB", "GiB", "TiB"))
            if unit == "bytes"
            else (1000, ("B", "kB", "MB", "GB", "TB"))
        )
        i = 0
        while abs(value) >= base and i < len(marks) - 1:
            value, i = value / base, i + 1
        return f"{value:.3g} {marks[i]}"
    if unit == "s":
        return f"{value * 1000:.3g} ms" if 0 < abs(value) < 1 else f"{num(value)} s"
    if unit == "ms":
        return f"{num(value)} ms"
    if unit in ("short", "none", ""):
        return si(value)
    if unit == "reqps":
        return si(value, "req/s")
    return f"{si(value)} {unit}"


def clock(epoch: float, seconds: bool = False) -> str:
    return time.strftime("%H:%M:%S" if seconds else "%H:%M", time.gmtime(epoch))


def draw(panel: Panel, ax: Any, start: float, end: float) -> None:
    import matplotlib.ticker as ticker

    ax.set_title(panel.title, fontsize=9, loc="left")
    if panel.kind == "stat":
        last = [s.values[-1] for s in panel.series if s.values]
        text = (
            fmt_unit(sum(last), panel.unit)
            if len(last) == 1
            else " / ".join(fmt_unit(v, panel.unit) for v in last)
        )
        ax.text(
            0.5,
            0.5,
            text if last else "No data",
            ha="center",
            va="center",
            fontsize=18,
            transform=ax.transAxes,
        )
        for s in panel.series:
            ax.fill_between(s.times, s.values, alpha=0.15, color="tab:green")
        ax.set_xlim(start, end)
        ax.set_ylim(bottom=0)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    stacked: dict[float, float] = {}  # the running total at each time, when the panel stacks
    for s in panel.series:
        values = s.values
        if panel.stacked:
            lower = [stacked.get(t, 0.0) for t in s.times]
            values = [lo + v for lo, v in zip(lower, s.values, strict=True)]
            stacked.update(zip(s.times, values, strict=True))
        # Grafana's showPoints "auto": points where the series is sparse (a lone point shows).
        sparse = len(s.times) < 30
        (line,) = ax.plot(
            s.times, values, linewidth=1.2, label=s.name, marker="o" if sparse else None, markersize=3
        )
        if panel.stacked:
            ax.fill_between(s.times, lower, values, alpha=max(panel.fill, 0.1), color=line.get_color())
        elif panel.fill:
            ax.fill_between(s.times, values, alpha=panel.fill, color=line.get_color())
    if not panel.series:
        ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlim(start, end)
    short = end - start < 600  # under 10 min: ticks with seconds
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: clock(x, short)))
    ax.xaxis.set_major_locator(ticker.MaxNLocator(5))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: fmt_unit(y, panel.unit)))
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if panel.series:
        ax.legend(fontsize=6, loc="upper left", frameon=False, ncol=2 if len(panel.series) > 4 else 1)


def render(panels: list[Panel], out: Path, start: float, end: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for panel in panels:
        w, h = panel.grid["w"] * COLUMN_PX / 100, panel.grid["h"] * ROW_PX / 100
        fig, ax = plt.subplots(figsize=(max(w, 3.0), max(h, 1.6)), dpi=100)
        draw(panel, ax, start, end)
        fig.tight_layout()
        fig.savefig(out / f"panel-{panel.id}.png")
        plt.close(fig)
    # The whole dashboard on Grafana's grid: each panel's box, less room for its title and
    # axis labels (inches), at its place.
    rows = max(p.grid["y"] + p.grid["h"] for p in panels)
    width, header = GRID_COLUMNS * COLUMN_PX / 100, 0.5
    height = rows * ROW_PX / 100 + header
    fig = plt.figure(figsize=(width, height), dpi=80)
    left, right, top, bottom = 0.75, 0.15, 0.3, 0.35
    for panel in panels:
        g = panel.grid
        x0, y0 = g["x"] * COLUMN_PX / 100, height - header - (g["y"] + g["h"]) * ROW_PX / 100
        w, h = g["w"] * COLUMN_PX / 100, g["h"] * ROW_PX / 100
        ax = fig.add_axes(
            (
                (x0 + left) / width,
                (y0 + bottom) / height,
                (w - left - right) / width,
                (h - top - bottom) / height,
            )
        )
        draw(panel, ax, start, end)
    fig.suptitle(
        f"{title}: {clock(start)}-{clock(end)} UTC, from Prometheus, drawn without Grafana",
        fontsize=12,
        y=1 - 0.15 / height,
    )
    fig.savefig(out / "dashboard.png")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--dashboard", type=Path, default=Path(__file__).resolve().parent / "llama-radix-proxy.json"
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="the time range, ending now")
    parser.add_argument("--since", type=float, help="the time range's start (Unix time) instead of --minutes")
    args = parser.parse_args()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "skip: matplotlib is not installed (pip install -e '.[dashboard]'): no panel pictures",
            file=sys.stderr,
        )
        sys.exit(SKIP)
    end = time.time()
    start = args.since if args.since else end - args.minutes * 60
    panels = load_panels(args.dashboard)
    try:
        for panel in panels:
            fetch(panel, args.prometheus.rstrip("/"), start, end)
    except (OSError, RuntimeError, ValueError) as err:
        print(f"FAIL: {err}", file=sys.stderr)
        sys.exit(1)
    title = json.loads(args.dashboard.read_text()).get("title", "dashboard")
    render(panels, args.out, start, end, title)
    summary = [
        {
            "id": p.id,
            "title": p.title,
            "type": p.kind,
            "queries": p.queries,
            "series": [s.name for s in p.series],
        }
        for p in panels
    ]
    (args.out / "panels.json").write_text(json.dumps(summary, indent=2) + "\n")
    drawn = sum(1 for p in panels if p.series)
    print(f"{len(panels)} panels drawn ({drawn} with data) into {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
