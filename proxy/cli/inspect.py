"""``radixctl routes|tree|slots|stats|doctor``.

``routes``, ``tree``, ``slots`` and ``stats`` read the proxy's /radix admin API (``--url``,
``--admin-key``); ``doctor`` checks a llama-server directly (``--backend-url``). Human
tables by default, ``--json`` for scripts (one JSON object per decision for ``routes``,
one document otherwise).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from proxy.errors import ConfigError, RadixError

# ---- talking to the proxy ------------------------------------------------------------------


def _fetch(url: str, path: str, key: str | None) -> Any:
    req = urllib.request.Request(url.rstrip("/") + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        if err.code == 401:
            raise ConfigError(f"{url}{path} answered 401: the proxy has an admin key",
                              fix="pass --admin-key (or set RADIX_ADMIN_KEY) to the proxy's --admin-key") from err
        raise ConfigError(f"{url}{path} answered {err.code}: {err.read()[:200].decode(errors='replace')}",
                          fix="check --url: it must point at the proxy, not at a llama-server") from err
    except (urllib.error.URLError, OSError) as err:
        raise ConfigError(f"cannot reach the proxy at {url}: {err}", fix="start it (`make run`) or fix --url") from err


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
        flat = "…" + flat[-(width - 1):] if tail else flat[: width - 1] + "…"
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
        where = div.get("source") or ("host" if (d.get("host_match") or 0) >= (d.get("best_slot_match") or 0)
                                      else "slot")
    if "request" not in div:
        return f"@{at} ({where})"
    if not at:
        return f"@0 ({where}) ▸ {snippet(div.get('request'), 20)}"
    text = f"@{at} ({where}) {snippet(div.get('before'), 24, tail=True)} ▸ {snippet(div.get('request'), 20)}"
    if div.get("cached") is not None:
        text += f" | cached ▸ {snippet(div.get('cached'), 20)}"
    return text


ROUTE_HEADER = ["time", "request", "route", "predicted", "cached", "prefilled", "ttft", "server/slot",
                "why not longer (first divergent token)"]


def route_rows(decisions: list[dict[str, Any]]) -> list[list[Any]]:
    return [[time.strftime("%H:%M:%S", time.localtime(d["time"])), d["request_id"], d["route"],
             d["predicted_cached"], d["cached"], d["prefilled"], _ms(d.get("ttft_s")),
             f"{d['server']}/{d['slot']}", why_text(d)] for d in decisions]


def _preview_text(p: dict[str, str] | None, width: int = 48) -> str:
    if not p or not (p.get("head") or p.get("tail")):
        return "-"
    if not p.get("tail"):
        return snippet(p["head"], width)
    half = width // 2
    return f"{snippet(p['head'], half)} … {snippet(p['tail'], half, tail=True)}"


def format_tree(data: dict[str, Any]) -> str:
    s = data["stats"]
    lines = [
        f"host tree: {s['nodes']} nodes ({s['leaves']} terminal), {human_bytes(s['bytes'])} of "
        f"{human_bytes(s['budget_bytes'])}, {s['unique_tokens']} unique / {s['logical_tokens']} logical tokens "
        f"(dedup {data.get('dedup_ratio', 0):.2f}x)",
        f"saves {s['saves']} ({s['saved_tokens']} tokens), loads {s['loads']} ({s['loaded_tokens']} tokens), "
        f"evictions {s['evictions']} ({s['evicted_tokens']} tokens), pinned nodes {s['pinned_nodes']}",
        "",
    ]
    if not data["top"]:
        return "\n".join(lines + ["(the tree is empty)"])
    rows = [[p["length"], p["hits"], human_bytes(p["bytes"]), _preview_text(p.get("preview"), 70)]
            for p in data["top"]]
    return "\n".join(lines) + table(rows, ["tokens", "hits", "size", "prefix (start … end)"])


def format_slots(data: dict[str, Any]) -> str:
    rows, resident_rows, pools, errors = [], [], [], []
    for srv in data["servers"]:
        for s in srv["slots"]:
            idle = f"{s['idle_s']:.0f}s" if s.get("idle_s") is not None else None
            rows.append([srv["server"], s["id"], "busy" if s["busy"] else "idle", s["n_tokens"],
                         s.get("n_cells"), idle, _preview_text(s.get("preview"), 60)])
        for r in srv.get("residents", []):
            sharers = ",".join(f"{k}:{v}" for k, v in (r.get("sharers") or {}).items()) or None
            resident_rows.append([srv["server"], r["owner"], r["n_tokens"], r.get("n_cells"), r.get("hits"),
                                  sharers, _preview_text(r.get("preview"), 60)])
        pool = srv.get("pool")
        if pool:
            shared = int(pool.get("logical", 0)) - int(pool.get("used", 0))
            pools.append(f"{srv['server']} ({srv['url']}): {pool.get('used')} of {pool.get('n_cells')} cells used, "
                         f"slots {pool.get('slot')}, owners {pool.get('owner')} ({pool.get('owner_only')} owner-only), "
                         f"logical {pool.get('logical')} ({shared} shared)")
        errors += srv.get("errors", [])
    out = table(rows, ["server", "slot", "state", "tokens", "cells", "idle", "holds (start … end)"])
    out += "\n\nresident entries: "
    out += ("\n" + table(resident_rows, ["server", "owner", "tokens", "cells", "hits", "slots:cells",
                                          "holds (start … end)"])
            if resident_rows else "none")
    if pools:
        out += "\n\nKV pool:\n" + "\n".join("  " + p for p in pools)
    if errors:
        out += "\n\nunanswered: " + "; ".join(errors)
    return out


def format_stats(d: dict[str, Any]) -> str:
    t = d["tree"]
    routes = ", ".join(f"{r} {n}" for r, n in d["by_route"].items()) or "none yet"
    ttft = ", ".join(f"{r} {_ms(v)}" for r, v in d.get("ttft_mean_s_by_route", {}).items()) or "-"
    moves = ", ".join(f"{k} {human_bytes(v['bytes'])} in {v['seconds']:.2f}s" for k, v in d["kv_moves"].items())
    fallbacks = ", ".join(f"{c} {n}" for c, n in d["fallbacks"].items() if n) or "none"
    lines = [
        ("uptime", f"{d['uptime_s']:.0f}s"),
        ("requests", f"{d['requests']} ({routes}); errors 4xx {d['errors']['4xx']}, 5xx {d['errors']['5xx']}"),
        ("prompt tokens", f"{d['prompt_tokens']}: cached {d['cached_tokens']} "
                          f"({d['hit_ratio']:.1%}), prefilled {d['prefilled_tokens']}, "
                          f"predicted cached {d['predicted_cached_tokens']}"),
        ("cached by route", ", ".join(f"{r} {n}" for r, n in d["cached_by_route"].items()) or "-"),
        ("mean TTFT", ttft),
        ("host tree", f"{t['nodes']} nodes ({t['leaves']} terminal), {human_bytes(t['bytes'])} of "
                      f"{human_bytes(t['budget_bytes'])}, {t['unique_tokens']} unique / {t['logical_tokens']} "
                      f"logical tokens (dedup {d['dedup_ratio']:.2f}x)"),
        ("host traffic", f"saves {t['saves']}, loads {t['loads']}, evictions {t['evictions']}"),
        ("KV moves", moves),
        ("fallbacks", fallbacks),
    ]
    for server, pool in (d.get("pool") or {}).items():
        lines.append((f"pool {server}", "unanswered" if pool is None else
                      f"{pool.get('used')} of {pool.get('n_cells')} cells used, owners {pool.get('owner')}, "
                      f"logical {pool.get('logical')}"))
    for server, r in (d.get("resident") or {}).items():
        if r is not None:
            lines.append((f"resident {server}", f"{r['entries']} entries ({r['tokens']} tokens, {r['pinned']} pinned), "
                          f"admitted {r['admitted']}, evicted {r['evicted']}, hits {r['hits']}"))
    lines.append(("tokenizer", d["tokenizer"]))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)


# ---- doctor ------------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str
    fix: str = ""


PINNED_COMMIT = "0c1e570"
SERVER_FLAGS = "-np 4 -kvu --cache-ram 0 -sps 0 --kvctl --kvctl-dir /dev/shm/radix"


async def doctor(url: str, kvctl_key: str | None, shm_dir: Path | None, tokenizer_cache: Path) -> list[Check]:
    """Check one llama-server for use behind the proxy; every problem comes with its fix."""
    import aiohttp

    from proxy.server.backend import Backend

    timeout = aiohttp.ClientTimeout(total=60, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        backend = Backend(url, session, kvctl_key)
        return await _doctor(backend, kvctl_key, shm_dir, tokenizer_cache)


async def _doctor(backend: Any, kvctl_key: str | None, shm_dir: Path | None, tokenizer_cache: Path) -> list[Check]:
    import aiohttp

    from proxy.core.payload import KvLayout

    checks: list[Check] = []
    add = checks.append
    # 1. reachable and loaded
    try:
        await backend.get_json("/health")
    except aiohttp.ClientError as exc:
        add(Check("reachable", "fail", f"cannot reach {backend.url}: {exc}",
                  "start llama-server, or fix --backend-url (scheme, host and port of the server itself)"))
        return checks
    except RadixError as exc:
        add(Check("reachable", "fail", f"/health: {exc.message}", "wait until the model is loaded, then rerun"))
        return checks
    add(Check("reachable", "ok", f"{backend.url} /health ok"))

    # 2. /props: build, slots, modalities
    try:
        props = await backend.get_json("/props")
    except RadixError as exc:
        add(Check("props", "fail", f"/props failed: {exc.message}", "point --backend-url at a llama-server"))
        return checks
    build = str(props.get("build_info", ""))
    if PINNED_COMMIT in build:
        add(Check("build", "ok", f"{build} (the commit the patch series targets)"))
    else:
        add(Check("build", "warn", f"build {build or '?'}, not the pinned llama.cpp commit {PINNED_COMMIT}",
                  "use the server `radixctl build` prints (pinned source plus the /kvctl patch series)"))
    n_slots = int(props.get("total_slots", 0))
    add(Check("slots", "ok" if n_slots > 1 else "warn", f"{n_slots} slot(s) (-np)",
              "" if n_slots > 1 else "start it with -np 4 (or more): one slot serves one request at a time"))
    media = [k for k, v in (props.get("modalities") or {}).items() if v]
    if media:
        add(Check("multimodal", "fail", f"a multimodal projector is loaded ({', '.join(media)})",
                  "drop --mmproj: KV that is moved or shared must come from text tokens only"))
    if props.get("is_sleeping"):
        add(Check("sleeping", "warn", "the server is sleeping (it dropped all KV)",
                  "remove --sleep-idle-seconds"))
    model_path = Path(str(props.get("model_path", "")))

    # 3. /kvctl: the patch, its flags and capabilities
    caps: dict[str, Any] | None = None
    try:
        caps = await backend.caps()
    except RadixError as exc:
        text, code = exc.message, getattr(exc, "backend_status", 0)
        if code == 401:
            add(Check("kvctl", "fail", "/kvctl/caps answered 401: the server wants a key",
                      "pass --kvctl-key: the server's --kvctl-key, or its --api-key when it has no --kvctl-key"))
        elif code == 404:
            add(Check("kvctl", "fail", "/kvctl/caps answered 404: a stock llama-server, or a patched one "
                      "started without --kvctl",
                      f"run the patched llama-server (`radixctl build` prints its path) with {SERVER_FLAGS}"))
        else:
            add(Check("kvctl", "fail", f"/kvctl/caps failed: {text}",
                      f"run the patched llama-server (`radixctl build`) with {SERVER_FLAGS}"))
    if caps is not None:
        add(Check("kvctl", "ok", "patched server, /kvctl on: -kvu, --cache-ram 0, -sps 0, no context shift, "
                  "--cache-reuse 0 and no SWA/recurrent/draft/multimodal are enforced by --kvctl at startup"))
        checks += _caps_checks(caps, shm_dir, KvLayout)
        for route in ("slots", "cells"):
            try:
                got = await backend.kv_get(route)
                detail = (f"{len(got.get('slots', []))} slots, {len(got.get('owners', []))} resident owners"
                          if route == "slots" else f"{got.get('used')} of {got.get('n_cells')} cells used")
                add(Check(f"/kvctl/{route}", "ok", detail))
            except RadixError as exc:
                add(Check(f"/kvctl/{route}", "fail", str(exc), "update the patch series (`radixctl build`)"))

    # 4. the chat path the proxy tokenizes through
    try:
        rendered = await backend.apply_template({"messages": [{"role": "user", "content": "hi"}]}, {})
        add(Check("chat template", "ok", f"/apply-template renders ({len(rendered)} chars)"))
    except (RadixError, KeyError) as exc:
        add(Check("chat template", "fail", f"/apply-template failed: {exc}",
                  "give the server a chat template (--chat-template or --jinja with a template file)"))

    # 5. tokenizer parity (add_special and parse_special, as the chat path tokenizes)
    checks.append(await _parity_check(backend, model_path, tokenizer_cache))
    return checks


def _caps_checks(caps: dict[str, Any], shm_dir: Path | None, layout_cls: Any) -> list[Check]:
    out: list[Check] = []
    version = caps.get("format_version")
    if version != 1:
        out.append(Check("payload format", "fail", f"payload format_version {version}, the proxy reads 1",
                         "use the patch series of this proxy version (`radixctl build`)"))
    try:
        layout = layout_cls.from_caps(dict(caps["compat"]))
        out.append(Check("KV layout", "ok", f"{layout.bytes_per_token} bytes per token, "
                         f"{caps['compat'].get('n_layer')} layers, v_trans {caps['compat'].get('v_trans')}"))
    except (KeyError, ValueError, TypeError, RadixError) as exc:
        out.append(Check("KV layout", "fail", f"the proxy cannot read this server's KV layout: {exc}",
                         "use f16 (default) or another K/V type the payload format supports (--cache-type-k/v)"))
    if caps.get("sharing"):
        owners = caps.get("owner_ids") or [0, 0]
        out.append(Check("sharing", "ok", f"resident sharing available ({owners[1] - owners[0]} owner sequences)"))
    else:
        out.append(Check("sharing", "warn", f"resident sharing off: {'; '.join(caps.get('reasons') or ['?'])}",
                         "drop --kvctl-owners 0 to allow route S (routes A and H work without it)"))
    n_ctx_slot = int(caps.get("n_ctx_slot") or 0)
    out.append(Check("context", "ok" if n_ctx_slot >= 2048 else "warn",
                     f"{n_ctx_slot} tokens per slot, {caps.get('n_cells')} cells in the pool",
                     "" if n_ctx_slot >= 2048 else "raise -c: prompts longer than a slot are refused"))
    theirs = caps.get("dir")
    if not theirs:
        out.append(Check("payload dir", "warn", "no --kvctl-dir: KV travels inline over HTTP (base64/msgpack, "
                         "at most 64 MiB per move, two extra copies)",
                         "start the server with --kvctl-dir /dev/shm/radix and the proxy with --shm-dir /dev/shm/radix"))
    elif shm_dir is not None and Path(theirs).resolve() != shm_dir.resolve():
        out.append(Check("payload dir", "warn", f"the server's --kvctl-dir is {theirs}, --shm-dir is {shm_dir}: "
                         "the proxy would fall back to inline payloads (slower)",
                         f"give the proxy --shm-dir {theirs} (or the server --kvctl-dir {shm_dir})"))
    elif not os.path.isdir(theirs) or not os.access(theirs, os.W_OK):
        out.append(Check("payload dir", "warn", f"the server's --kvctl-dir {theirs} is not a writable directory "
                         "here (another host?): payloads will go inline",
                         f"run the proxy on the server's host with --shm-dir {theirs}"))
    else:
        hint = "" if shm_dir is not None else f" (give the proxy --shm-dir {theirs})"
        out.append(Check("payload dir", "ok", f"payload files through {theirs}{hint}"))
    if caps.get("fault_injection"):
        out.append(Check("fault injection", "warn", "a test build with import fault injection",
                         "use the normal build (`radixctl build` without --fault-injection)"))
    return out


async def _parity_check(backend: Any, model_path: Path, cache: Path) -> Check:
    from proxy.tokenizer import (
        CORPUS,
        PromptTokenizer,
        UnsupportedTokenizerError,
        check_parity,
        load_tokenizer,
    )

    if not model_path.is_file():
        return Check("tokenizer", "warn", f"the model file {model_path} is not readable here: the proxy will "
                     "tokenize through the server's /tokenize (one more HTTP call per request)",
                     "run the proxy where the model file is at the same path")
    try:
        tokenizer = PromptTokenizer(await asyncio.to_thread(load_tokenizer, model_path, cache))
    except (OSError, ValueError, UnsupportedTokenizerError, RadixError) as exc:
        return Check("tokenizer", "warn", f"no local tokenizer for this model ({exc}): the proxy will use the "
                     "server's /tokenize (slower, same tokens)", "nothing to change; or report the model's tokenizer")

    async def remote(text: str) -> list[int]:
        return list(await backend.tokenize(text, add_special=True, parse_special=True))

    result = await check_parity(tokenizer, remote, CORPUS)
    if result.ok:
        return Check("tokenizer", "ok", f"local tokenizer identical to the server's on {result.checked} texts "
                     "(add_special, parse_special)")
    first = (f"first difference in {result.mismatches[0].text[:60]!r}: local {result.mismatches[0].local[:12]} "
             f"vs server {result.mismatches[0].remote[:12]}" if result.mismatches else "; ".join(result.errors[:2]))
    return Check("tokenizer", "fail", f"local tokenizer differs from the server's on {len(result.mismatches)} of "
                 f"{result.checked} texts ({len(result.errors)} errors); {first}",
                 "nothing breaks: the proxy then tokenizes through the server's /tokenize (slower); report the "
                 "mismatch with the model's name")


def format_doctor(url: str, checks: list[Check]) -> str:
    lines = [f"llama-server {url}"]
    width = max(len(c.name) for c in checks)
    for c in checks:
        lines.append(f"  {c.status.upper():4}  {c.name.ljust(width)}  {c.detail}")
        if c.fix:
            lines.append(f"        {' ' * width}  fix: {c.fix}")
    fails = sum(c.status == "fail" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    lines.append(f"result: {fails} problem(s), {warns} warning(s)" if fails or warns else "result: ready for the proxy")
    return "\n".join(lines)


# ---- the commands ------------------------------------------------------------------------------


def register(main: click.Group) -> None:
    from proxy.cli.common import fail_cleanly

    common = [
        click.option("--url", default="http://127.0.0.1:8080", show_default=True, envvar="RADIX_URL",
                     help="The proxy's base URL."),
        click.option("--admin-key", envvar="RADIX_ADMIN_KEY", help="The proxy's --admin-key, if it has one."),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable output."),
    ]

    def with_common(fn: Any) -> Any:
        for option in reversed(common):
            fn = option(fn)
        return fn

    @main.command()
    @click.option("-n", "limit", default=20, show_default=True, help="How many of the last decisions.")
    @click.option("--follow", "-f", is_flag=True, help="Keep printing new decisions (Ctrl-C stops).")
    @click.option("--interval", default=1.0, show_default=True, help="Seconds between polls with --follow.")
    @with_common
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

    @main.command()
    @click.option("--top", default=10, show_default=True, help="How many prefixes, most hits first.")
    @with_common
    @fail_cleanly
    def tree(url: str, admin_key: str | None, as_json: bool, top: int) -> None:
        """The host radix tree: totals and the most used shared prefixes."""
        data = _fetch(url, f"/radix/tree?top={top}", admin_key)
        click.echo(json.dumps(data, indent=2) if as_json else format_tree(data))

    @main.command()
    @with_common
    @fail_cleanly
    def slots(url: str, admin_key: str | None, as_json: bool) -> None:
        """Each server's slots, resident entries and KV pool."""
        data = _fetch(url, "/radix/slots", admin_key)
        click.echo(json.dumps(data, indent=2) if as_json else format_slots(data))

    @main.command()
    @with_common
    @fail_cleanly
    def stats(url: str, admin_key: str | None, as_json: bool) -> None:
        """One screen of the key figures since the proxy started."""
        data = _fetch(url, "/radix/stats", admin_key)
        click.echo(json.dumps(data, indent=2) if as_json else format_stats(data))

    @main.command("doctor")
    @click.option("--backend-url", "backends", multiple=True, required=True,
                  help="llama-server base URL to check (repeatable).")
    @click.option("--kvctl-key", envvar="RADIX_KVCTL_KEY", help="Key for the server's /kvctl API.")
    @click.option("--shm-dir", type=click.Path(file_okay=False, path_type=Path), envvar="RADIX_SHM_DIR",
                  help="The --shm-dir the proxy will be given (checked against the server's --kvctl-dir).")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    @fail_cleanly
    def doctor_cmd(backends: tuple[str, ...], kvctl_key: str | None, shm_dir: Path | None, as_json: bool) -> None:
        """Check llama-servers for use behind the proxy: flags, /kvctl capabilities, tokenizer parity.

        Every problem is printed with what to change. Exit status 1 when any check fails."""
        from proxy.native.fetch import cache_root

        results = {}
        for url in backends:
            results[url] = asyncio.run(doctor(url, kvctl_key, shm_dir, cache_root() / "tokenizers"))
        failed = any(c.status == "fail" for checks in results.values() for c in checks)
        if as_json:
            click.echo(json.dumps({"ok": not failed, "servers": [
                {"url": url, "ok": not any(c.status == "fail" for c in checks), "checks": [asdict(c) for c in checks]}
                for url, checks in results.items()]}, indent=2))
        else:
            click.echo("\n\n".join(format_doctor(url, checks) for url, checks in results.items()))
        if failed:
            sys.exit(1)
