"""``radixctl routes|tree|slots|stats``: read the proxy's /radix admin API."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import click

from proxy.errors import ConfigError


def _fetch(url: str, path: str, key: str | None) -> Any:
    req = urllib.request.Request(url.rstrip("/") + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raise ConfigError(f"{url}{path} answered {err.code}", fix="check --url and --admin-key") from err
    except (urllib.error.URLError, OSError) as err:
        raise ConfigError(f"cannot reach the proxy at {url}: {err}", fix="start it (`make run`) or fix --url") from err


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _route_rows(decisions: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for d in decisions:
        ttft = f"{d['ttft_s'] * 1000:.0f}ms" if d.get("ttft_s") is not None else None
        rows.append([time.strftime("%H:%M:%S", time.localtime(d["time"])), d["request_id"], d["route"],
                     d["predicted_cached"], d["cached"], d["prefilled"], ttft, f"{d['server']}/{d['slot']}",
                     d.get("fallback") or "", f"host={d['host_match']} slot={d['best_slot_match']}"])
    return rows


_ROUTE_HEADER = ["time", "request", "route", "predicted", "cached", "prefilled", "ttft", "server/slot",
                 "fallback", "longest known prefix"]


def register(main: click.Group) -> None:
    common = [
        click.option("--url", default="http://127.0.0.1:8080", show_default=True, envvar="RADIX_URL"),
        click.option("--admin-key", envvar="RADIX_ADMIN_KEY"),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable output."),
    ]

    def with_common(fn: Any) -> Any:
        for option in reversed(common):
            fn = option(fn)
        return fn

    @main.command()
    @click.option("-n", "limit", default=20, show_default=True)
    @click.option("--follow", "-f", is_flag=True, help="Keep printing new decisions.")
    @with_common
    def routes(url: str, admin_key: str | None, as_json: bool, limit: int, follow: bool) -> None:
        """The last routing decisions and what each reused."""
        after = 0.0
        first = True
        while True:
            items = _fetch(url, f"/radix/routes?limit={limit}&after={after}", admin_key)["decisions"]
            if as_json:
                for item in items:
                    click.echo(json.dumps(item))
            elif items or first:
                text = _table(_route_rows(items), _ROUTE_HEADER)
                click.echo(text if first else "\n".join(text.splitlines()[1:]))
            after = max([after] + [d["time"] for d in items])
            first = False
            if not follow:
                return
            time.sleep(1)

    @main.command()
    @click.option("--top", default=10, show_default=True)
    @with_common
    def tree(url: str, admin_key: str | None, as_json: bool, top: int) -> None:
        """The host radix tree: totals and the most used shared prefixes."""
        data = _fetch(url, f"/radix/tree?top={top}", admin_key)
        if as_json:
            click.echo(json.dumps(data, indent=2))
            return
        click.echo(_table([[k, v] for k, v in data["stats"].items()], ["stat", "value"]))
        click.echo()
        click.echo(_table([[p["length"], p["hits"], p["bytes"], " ".join(map(str, p["head"][:8]))]
                           for p in data["top"]], ["tokens", "hits", "bytes", "first token ids"]))

    @main.command()
    @with_common
    def slots(url: str, admin_key: str | None, as_json: bool) -> None:
        """Each server's slots as the proxy sees them."""
        data = _fetch(url, "/radix/slots", admin_key)
        if as_json:
            click.echo(json.dumps(data, indent=2))
            return
        rows = [[s["server"], s["url"], slot["id"], "busy" if slot["busy"] else "idle", slot["n_tokens"]]
                for s in data["servers"] for slot in s["slots"]]
        click.echo(_table(rows, ["server", "url", "slot", "state", "tokens"]))

    @main.command()
    @with_common
    def stats(url: str, admin_key: str | None, as_json: bool) -> None:
        """One screen of the key figures."""
        data = _fetch(url, "/radix/stats", admin_key)
        if as_json:
            click.echo(json.dumps(data, indent=2))
            return
        tree_stats = data.pop("tree")
        rows = [[k, v] for k, v in data.items()] + [[f"tree.{k}", v] for k, v in tree_stats.items()]
        click.echo(_table(rows, ["figure", "value"]))
