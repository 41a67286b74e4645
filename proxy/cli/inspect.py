"""``radixctl routes|tree|slots|stats``: what a running proxy decided and holds.

They read the proxy's /radix admin API (``--url``, ``--admin-key``). Human tables by default,
``--json`` for scripts (one JSON object per decision for ``routes``, one document otherwise).
``radixctl doctor``, which checks a llama-server instead, is in :mod:`proxy.cli.doctor`.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import click

from proxy.cli.common import fail_cleanly
from proxy.cli.options import json_option, proxy_admin_key_option, url_option
from proxy.errors import ConfigError

# ---- talking to the proxy ------------------------------------------------------------------


def _fetch(url: str, path: str, key: str | None) -> Any:
    req = urllib.request.Request(
        url.rstrip("/") + path, headers={"Authorization": f"Bearer {key}"} if key else {}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        if err.code == 401:
            raise ConfigError(
                f"{url}{path} answered 401: the proxy has an admin key",
                fix="pass --admin-key (or set RADIX_ADMIN_KEY) to the proxy's --admin-key",
            ) from err
        raise ConfigError(
            f"{url}{path} answered {err.code}: {err.read()[:200].decode(errors='replace')}",
            fix="check --url: it must point at the proxy, not at a llama-server",
        ) from err
    except (urllib.error.URLError, OSError) as err:
        raise ConfigError(
            f"cannot reach the proxy at {url}: {err}", fix="start it (`make run`) or fix --url"
        ) from err


def _wait(seconds: float) -> None:
    """Between two polls of ``routes --follow`` (a seam for tests)."""
    time.sleep(seconds)


# ---- formatting ------------------------------------------------------------------------------


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def human_bytes(n: float | None) -> str | None:
    if n is None:
        return None
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return None  # unreachable


def snippet(text: str | None, width: int = 28, tail: bool = False) -> str:
    """Text on one line, quoted, cut to ``width`` characters (keeping its end when ``tail``)."""
    if text is None:
        return "-"
    flat = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    if len(flat) > width:
        flat = "…" + flat[-(width - 1) :] if tail else flat[: width - 1] + "…"
    return f'"{flat}"'


def _ms(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds * 1000:.0f}ms"


def why_text(d: dict[str, Any]) -> str:
    """Why no longer prefix was reused: where the best cached sequence and the request part."""
    if d.get("fallback"):
        return f"KV move failed ({d['fallback']}), prefilled"
    div = d.get("diverge") or {}
    at = div.get("at", max(d.get("host_match") or 0, d.get("best_slot_match") or 0))
    if div.get("complete"):
        return "whole prompt was cached"
    if not at:
        where = "nothing cached starts like it"
    else:
        where = div.get("source") or (
            "host" if (d.get("host_match") or 0) >= (d.get("best_slot_match") or 0) else "slot"
        )
    if "request" not in div:
        return f"@{at} ({where})"
    if not at:
        return f"@0 ({where}) ▸ {snippet(div.get('request'), 20)}"
    text = f"@{at} ({where}) {snippet(div.get('before'), 24, tail=True)} ▸ {snippet(div.get('request'), 20)}"
    if div.get("cached") is not None:
        text += f" | cached ▸ {snippet(div.get('cached'), 20)}"
    return text


ROUTE_HEADER = [
    "time",
    "request",
    "route",
    "predicted",
    "cached",
    "prefilled",
    "ttft",
    "server/slot",
    "why not longer (first divergent token)",
]


def route_rows(decisions: list[dict[str, Any]]) -> list[list[Any]]:
    return [
        [
            time.strftime("%H:%M:%S", time.localtime(d["time"])),
            d["request_id"],
            d["route"],
            d["predicted_cached"],
            d["cached"],
            d["prefilled"],
            _ms(d.get("ttft_s")),
            f"{d['server']}/{d['slot']}",
            why_text(d),
        ]
        for d in decisions
    ]


def _preview_text(p: dict[str, str] | None, width: int = 48) -> str:
    if not p or not (p.get("head") or p.get("tail")):
        return "-"
    if not p.get("tail"):
        return snippet(p["head"], width)
    half = width // 2
    return f"{snippet(p['head'], half)} … {snippet(p['tail'], half, tail=True)}"


def tier_lines(tiers: dict[str, Any] | None) -> list[tuple[str, str]]:
    """One line per tier of the host cache (RAM, disk with --cache-disk, remote with --cache-remote)."""
    if not tiers:
        return []
    r, d = tiers["ram"], tiers.get("disk")
    out = [
        (
            "tier ram",
            f"{r['entries']} nodes, {r['tokens']} tokens, {human_bytes(r['bytes'])} of {human_bytes(r['budget_bytes'])}",
        )
    ]
    remote = remote_line(tiers.get("remote"))
    if d is None:
        return out + [("tier disk", "off (--cache-disk)")] + remote
    problems = {
        **d.get("demotion_failures", {}),
        **{f"dropped {c}": n for c, n in d.get("dropped", {}).items()},
    }
    out.append(
        (
            "tier disk",
            f"{d['entries']} entries, {d['tokens']} tokens, {human_bytes(d['bytes'])} of "
            f"{human_bytes(d['budget_bytes'])} in {d['dir']}{'' if d.get('usable', True) else ' (unusable)'}; "
            f"promotions {d['promotions']} ({d['promoted_tokens']} tokens), demotions {d['demotions']}, "
            f"evictions {d['evictions']}"
            + ("; " + ", ".join(f"{k} {v}" for k, v in problems.items()) if problems else ""),
        )
    )
    return out + remote


def remote_line(r: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The remote tier's line (--cache-remote), none without it."""
    if not r:
        return []
    problems = {**r.get("fallbacks", {}), **{f"write {c}": n for c, n in r.get("write_dropped", {}).items()}}
    return [
        (
            "tier remote",
            f"{r['where']} {'up' if r.get('up') else 'down'}; lookups {r['lookups']}, promotions "
            f"{r['promotions']} ({r['promoted_tokens']} tokens), writes {r['writes']}"
            + ("; " + ", ".join(f"{k} {v}" for k, v in problems.items()) if problems else ""),
        )
    ]


def format_tree(data: dict[str, Any]) -> str:
    s = data["stats"]
    tiers = [f"{k}: {v}" for k, v in tier_lines(data.get("tiers"))]
    lines = [
        f"host tree: {s['nodes']} nodes ({s['leaves']} terminal), {human_bytes(s['bytes'])} of "
        f"{human_bytes(s['budget_bytes'])}, {s['unique_tokens']} unique / {s['logical_tokens']} logical tokens "
        f"(dedup {data.get('dedup_ratio', 0):.2f}x)",
        f"saves {s['saves']} ({s['saved_tokens']} tokens), loads {s['loads']} ({s['loaded_tokens']} tokens), "
        f"evictions {s['evictions']} ({s['evicted_tokens']} tokens), pinned nodes {s['pinned_nodes']}",
        *tiers,
        "",
    ]
    if not data["top"]:
        return "\n".join(lines + ["(the tree is empty)"])
    rows = [
        [p["length"], p["hits"], human_bytes(p["bytes"]), _preview_text(p.get("preview"), 70)]
        for p in data["top"]
    ]
    return "\n".join(lines) + table(rows, ["tokens", "hits", "size", "prefix (start … end)"])


def format_slots(data: dict[str, Any]) -> str:
    rows, resident_rows, pools, places, errors = [], [], [], [], []
    for srv in data["servers"]:
        for s in srv["slots"]:
            idle = f"{s['idle_s']:.0f}s" if s.get("idle_s") is not None else None
            rows.append(
                [
                    srv["server"],
                    s["id"],
                    "busy" if s["busy"] else "idle",
                    s["n_tokens"],
                    s.get("n_cells"),
                    idle,
                    _preview_text(s.get("preview"), 60),
                ]
            )
        for r in srv.get("residents", []):
            sharers = ",".join(f"{k}:{v}" for k, v in (r.get("sharers") or {}).items()) or None
            resident_rows.append(
                [
                    srv["server"],
                    r["owner"],
                    r["n_tokens"],
                    r.get("n_cells"),
                    r.get("hits"),
                    sharers,
                    _preview_text(r.get("preview"), 60),
                ]
            )
        if srv.get("kv"):
            places.append(f"{srv['server']}: {_kv_place(srv['kv'])}")
        pool = srv.get("pool")
        if pool:
            shared = int(pool.get("logical", 0)) - int(pool.get("used", 0))
            pools.append(
                f"{srv['server']} ({srv['url']}): {pool.get('used')} of {pool.get('n_cells')} cells used, "
                f"slots {pool.get('slot')}, owners {pool.get('owner')} ({pool.get('owner_only')} owner-only), "
                f"logical {pool.get('logical')} ({shared} shared)"
            )
        errors += srv.get("errors", [])
    out = table(rows, ["server", "slot", "state", "tokens", "cells", "idle", "holds (start … end)"])
    out += "\n\nresident entries: "
    out += (
        "\n"
        + table(
            resident_rows,
            ["server", "owner", "tokens", "cells", "hits", "slots:cells", "holds (start … end)"],
        )
        if resident_rows
        else "none"
    )
    if places:
        out += "\n\nKV location:\n" + "\n".join("  " + p for p in places)
    if pools:
        out += "\n\nKV pool:\n" + "\n".join("  " + p for p in pools)
    if errors:
        out += "\n\nunanswered: " + "; ".join(errors)
    return out


def _kv_place(kv: dict[str, Any]) -> str:
    """Where a server's KV lives and its learned move rates, for ``radixctl inspect slots``."""
    devices = ",".join(kv.get("kv_devices") or []) or "unknown"
    backends = ",".join(kv.get("kv_backends") or []) or "unknown"
    on_host = kv.get("kv_on_host")
    memory = "" if on_host is None else ", host memory" if on_host else ", device memory"
    where = f"KV on {devices} ({backends} backend{memory})"
    if kv.get("kv_unknown"):
        where += f": {kv['kv_unknown']}"
    if not kv.get("moves"):
        return where + "; moves off"
    learned = f"learned from {kv.get('moves_measured')} moves" if kv.get("moves_measured") else "prior"
    return (
        f"{where}; export (device-to-host) {kv.get('export_mb_s')} MB/s, "
        f"import (host-to-device) {kv.get('import_mb_s')} MB/s ({learned})"
    )


def format_stats(d: dict[str, Any]) -> str:
    t = d["tree"]
    routes = ", ".join(f"{r} {n}" for r, n in d["by_route"].items()) or "none yet"
    ttft = ", ".join(f"{r} {_ms(v)}" for r, v in d.get("ttft_mean_s_by_route", {}).items()) or "-"
    moves = ", ".join(
        f"{k} {human_bytes(v['bytes'])} in {v['seconds']:.2f}s" for k, v in d["kv_moves"].items()
    )
    fallbacks = ", ".join(f"{c} {n}" for c, n in d["fallbacks"].items() if n) or "none"
    lines = [
        ("uptime", f"{d['uptime_s']:.0f}s"),
        (
            "requests",
            f"{d['requests']} ({routes}); errors 4xx {d['errors']['4xx']}, 5xx {d['errors']['5xx']}",
        ),
        (
            "prompt tokens",
            f"{d['prompt_tokens']}: cached {d['cached_tokens']} "
            f"({d['hit_ratio']:.1%}), prefilled {d['prefilled_tokens']}, "
            f"predicted cached {d['predicted_cached_tokens']}",
        ),
        ("cached by route", ", ".join(f"{r} {n}" for r, n in d["cached_by_route"].items()) or "-"),
        ("mean TTFT", ttft),
        (
            "host tree",
            f"{t['nodes']} nodes ({t['leaves']} terminal), {human_bytes(t['bytes'])} of "
            f"{human_bytes(t['budget_bytes'])}, {t['unique_tokens']} unique / {t['logical_tokens']} "
            f"logical tokens (dedup {d['dedup_ratio']:.2f}x)",
        ),
        ("host traffic", f"saves {t['saves']}, loads {t['loads']}, evictions {t['evictions']}"),
        ("KV moves", moves),
        ("fallbacks", fallbacks),
        *tier_lines(d.get("tiers")),
    ]
    for server, pool in (d.get("pool") or {}).items():
        lines.append(
            (
                f"pool {server}",
                "unanswered"
                if pool is None
                else f"{pool.get('used')} of {pool.get('n_cells')} cells used, owners {pool.get('owner')}, "
                f"logical {pool.get('logical')}",
            )
        )
    for server, r in (d.get("resident") or {}).items():
        if r is not None:
            lines.append(
                (
                    f"resident {server}",
                    f"{r['entries']} entries ({r['tokens']} tokens, {r['pinned']} pinned), "
                    f"admitted {r['admitted']}, evicted {r['evicted']}, hits {r['hits']}",
                )
            )
    lines.append(("tokenizer", d["tokenizer"]))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)


# ---- the commands ------------------------------------------------------------------------------


@click.command()
@click.option("-n", "limit", default=20, show_default=True, help="How many of the last decisions.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new decisions (Ctrl-C stops).")
@click.option("--interval", default=1.0, show_default=True, help="Seconds between polls with --follow.")
@url_option
@proxy_admin_key_option
@json_option
@fail_cleanly
def routes(url: str, admin_key: str | None, as_json: bool, limit: int, follow: bool, interval: float) -> None:
    """The last routing decisions: route, predicted and delivered cached tokens, TTFT, and why no
    longer prefix was reused (the first divergent token and the text around it)."""
    since = 0.0
    seen: set[tuple[str, float]] = set()
    first = True
    try:
        while True:
            items = _fetch(url, f"/radix/routes?limit={limit}&since={since!r}", admin_key)["decisions"]
            new = [d for d in items if (d["request_id"], d["time"]) not in seen]
            if as_json:
                for item in new:
                    click.echo(json.dumps(item))
            elif new or first:
                text = table(route_rows(new), ROUTE_HEADER)
                click.echo(text if first else "\n".join(text.splitlines()[1:]))
            if items:
                since = max(d["time"] for d in items)
                seen = {(d["request_id"], d["time"]) for d in items if d["time"] >= since}
            first = False
            if not follow:
                return
            sys.stdout.flush()
            _wait(interval)
    except KeyboardInterrupt:
        return


@click.command()
@click.option("--top", default=10, show_default=True, help="How many prefixes, most hits first.")
@url_option
@proxy_admin_key_option
@json_option
@fail_cleanly
def tree(url: str, admin_key: str | None, as_json: bool, top: int) -> None:
    """The host radix tree: totals and the most used shared prefixes."""
    data = _fetch(url, f"/radix/tree?top={top}", admin_key)
    click.echo(json.dumps(data, indent=2) if as_json else format_tree(data))


@click.command()
@url_option
@proxy_admin_key_option
@json_option
@fail_cleanly
def slots(url: str, admin_key: str | None, as_json: bool) -> None:
    """Each server's slots, resident entries and KV pool."""
    data = _fetch(url, "/radix/slots", admin_key)
    click.echo(json.dumps(data, indent=2) if as_json else format_slots(data))


@click.command()
@url_option
@proxy_admin_key_option
@json_option
@fail_cleanly
def stats(url: str, admin_key: str | None, as_json: bool) -> None:
    """One screen of the key figures since the proxy started."""
    data = _fetch(url, "/radix/stats", admin_key)
    click.echo(json.dumps(data, indent=2) if as_json else format_stats(data))
