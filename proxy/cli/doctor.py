"""``radixctl doctor``: is a llama-server fit to run behind the proxy, and if not, what to change.

It talks to the server directly (``--backend-url``), not to a proxy: flags, build, /kvctl
capabilities, the chat template and tokenizer parity (the same probe the proxy runs at startup).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from proxy.cli.common import fail_cleanly
from proxy.cli.options import (
    json_option,
    kvctl_key_file_option,
    kvctl_key_option,
    server_api_key_file_option,
    server_api_key_option,
    take_kvctl_key_file,
)
from proxy.core.payload import FORMAT_VERSION
from proxy.errors import RadixError
from proxy.native.launch import PROXY_SERVER_ARGS
from proxy.native.pins import LLAMA_CPP

# ---- the checks ------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str
    fix: str = ""


PINNED_COMMIT = LLAMA_CPP.commit
SERVER_FLAGS = " ".join(
    ["-np 4", *PROXY_SERVER_ARGS, "--kvctl --kvctl-key-file KEYFILE --kvctl-dir /dev/shm/radix"]
)


async def check_server(
    url: str,
    kvctl_key: str | None,
    shm_dir: Path | None,
    tokenizer_cache: Path,
    api_key: str | None = None,
) -> list[Check]:
    """Check one llama-server for use behind the proxy; every problem comes with its fix."""
    import aiohttp

    from proxy.server.dataplane.backend import ServerClient

    timeout = aiohttp.ClientTimeout(total=60, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        backend = ServerClient(url, session, kvctl_key, api_key=api_key)
        return await _doctor(backend, kvctl_key, shm_dir, tokenizer_cache)


async def _doctor(
    backend: Any, kvctl_key: str | None, shm_dir: Path | None, tokenizer_cache: Path
) -> list[Check]:
    import aiohttp

    from proxy.core.payload import KvLayout

    checks: list[Check] = []
    add = checks.append
    # 1. reachable and loaded
    try:
        await backend.get_json("/health")
    except aiohttp.ClientError as exc:
        add(
            Check(
                "reachable",
                "fail",
                f"cannot reach {backend.url}: {exc}",
                "start llama-server, or fix --backend-url (scheme, host and port of the server itself)",
            )
        )
        return checks
    except RadixError as exc:
        add(
            Check(
                "reachable", "fail", f"/health: {exc.message}", "wait until the model is loaded, then rerun"
            )
        )
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
        add(
            Check(
                "build",
                "warn",
                f"build {build or '?'}, not the pinned llama.cpp commit {PINNED_COMMIT}",
                "use the server `radixctl build` prints (pinned source plus the /kvctl patch series)",
            )
        )
    n_slots = int(props.get("total_slots", 0))
    add(
        Check(
            "slots",
            "ok" if n_slots > 1 else "warn",
            f"{n_slots} slot(s) (-np)",
            "" if n_slots > 1 else "start it with -np 4 (or more): one slot serves one request at a time",
        )
    )
    media = [k for k, v in (props.get("modalities") or {}).items() if v]
    if media:
        add(
            Check(
                "multimodal",
                "ok",
                f"a multimodal projector is loaded ({', '.join(media)}): requests with media are "
                "served (whether media moves: 'media moves')",
                "",
            )
        )
    if props.get("is_sleeping"):
        add(
            Check(
                "sleeping",
                "warn",
                "the server is sleeping (it dropped all KV)",
                "remove --sleep-idle-seconds",
            )
        )
    model_path = Path(str(props.get("model_path", "")))

    # 3. /kvctl: the patch, its flags and capabilities
    from proxy.server.dataplane.kvctl import Caps, KvRoute

    caps: dict[str, Any] | None = None
    try:
        caps = await backend.kv_get(KvRoute.CAPS, adopt=True)
    except RadixError as exc:
        text, code = exc.message, getattr(exc, "backend_status", 0)
        if code == 401:
            add(
                Check(
                    "kvctl",
                    "fail",
                    "/kvctl/caps answered 401: the server wants a key",
                    "pass --kvctl-key: the server's --kvctl-key, or its --api-key when it has no --kvctl-key",
                )
            )
        elif code == 404:
            add(
                Check(
                    "kvctl",
                    "fail",
                    "/kvctl/caps answered 404: a stock llama-server, or a patched one "
                    "started without --kvctl",
                    f"run the patched llama-server (`radixctl build` prints its path) with {SERVER_FLAGS}",
                )
            )
        else:
            add(
                Check(
                    "kvctl",
                    "fail",
                    f"/kvctl/caps failed: {text}",
                    f"run the patched llama-server (`radixctl build`) with {SERVER_FLAGS}",
                )
            )
    if caps is not None:
        add(
            Check(
                "kvctl",
                "ok",
                f"patched server, /kvctl on: {' '.join(PROXY_SERVER_ARGS)}, no context shift, "
                "--cache-reuse 0 and no prompt cache are enforced by --kvctl at startup",
            )
        )
        try:  # what the proxy reads of it, parsed as the proxy parses it
            Caps.parse(caps)
        except RadixError as exc:
            add(
                Check(
                    "kvctl reply",
                    "fail",
                    exc.message,
                    "use the patch series of this proxy version (`radixctl build`)",
                )
            )
        checks += _caps_checks(caps, shm_dir, KvLayout)
        for route in (KvRoute.SLOTS, KvRoute.CELLS):
            try:
                got = await backend.kv_get(route)
                detail = (
                    f"{len(got.get('slots', []))} slots, {len(got.get('owners', []))} resident owners"
                    if route == "slots"
                    else f"{got.get('used')} of {got.get('n_cells')} cells used"
                )
                add(Check(f"/kvctl/{route}", "ok", detail))
            except RadixError as exc:
                add(Check(f"/kvctl/{route}", "fail", str(exc), "update the patch series (`radixctl build`)"))

    # 4. the chat path the proxy tokenizes through
    try:
        rendered = await backend.apply_template({"messages": [{"role": "user", "content": "hi"}]}, {})
        add(Check("chat template", "ok", f"/apply-template renders ({len(rendered)} chars)"))
    except (RadixError, KeyError) as exc:
        add(
            Check(
                "chat template",
                "fail",
                f"/apply-template failed: {exc}",
                "give the server a chat template (--chat-template or --jinja with a template file)",
            )
        )

    checks.append(await _template_check(backend))

    # 5. tokenizer parity (add_special and parse_special, as the chat path tokenizes)
    checks.append(await _parity_check(backend, model_path, tokenizer_cache))
    return checks


def _media_checks(mm: dict[str, Any]) -> list[Check]:
    """With a projector: whether its media chunks move with the text (patch 0027), or why not."""
    if not mm.get("on"):
        return []
    if mm.get("media_moves"):
        return [Check("media moves", "ok", "media is keyed by content and moves with the text around it")]
    why = mm.get("media_fixed") or "a patch before 0027"
    return [
        Check(
            "media moves",
            "warn",
            f"media does not move ({why}): the text before it moves, the server reuses media "
            "only on the slot that holds it",
            "" if "M-RoPE" in why else "see docs/architectures.md (--mmproj)",
        )
    ]


def _caps_checks(caps: dict[str, Any], shm_dir: Path | None, layout_cls: Any) -> list[Check]:
    out: list[Check] = []
    version = caps.get("format_version")
    if version != FORMAT_VERSION:
        out.append(
            Check(
                "payload format",
                "fail",
                f"payload format_version {version}, the proxy reads {FORMAT_VERSION}",
                "use the patch series of this proxy version (`radixctl build`)",
            )
        )
    try:
        layout = layout_cls.from_caps(dict(caps["compat"]))
        out.append(
            Check(
                "KV layout",
                "ok",
                f"{layout.bytes_per_token} bytes per token, "
                f"{caps['compat'].get('n_layer')} layers, v_trans {caps['compat'].get('v_trans')}",
            )
        )
    except (KeyError, ValueError, TypeError, RadixError) as exc:
        out.append(
            Check(
                "KV layout",
                "fail",
                f"the proxy cannot read this server's KV layout: {exc}",
                "use f16 (default) or another K/V type the payload format supports (--cache-type-k/v)",
            )
        )
    if caps.get("sharing"):
        owners = caps.get("owner_ids") or [0, 0]
        out.append(
            Check("sharing", "ok", f"resident sharing available ({owners[1] - owners[0]} owner sequences)")
        )
    else:
        out.append(
            Check(
                "sharing",
                "warn",
                f"resident sharing off: {'; '.join(caps.get('reasons') or ['?'])}",
                "drop --kvctl-owners 0 to allow route S (routes A and H work without it)",
            )
        )
    out.extend(_media_checks(caps.get("multimodal") or {}))
    n_ctx_slot = int(caps.get("n_ctx_slot") or 0)
    out.append(
        Check(
            "context",
            "ok" if n_ctx_slot >= 2048 else "warn",
            f"{n_ctx_slot} tokens per slot, {caps.get('n_cells')} cells in the pool",
            "" if n_ctx_slot >= 2048 else "raise -c: prompts longer than a slot are refused",
        )
    )
    theirs = caps.get("dir")
    if not theirs:
        out.append(
            Check(
                "payload dir",
                "warn",
                "no --kvctl-dir: KV travels inline over HTTP (base64/msgpack, "
                "at most 64 MiB per move, two extra copies)",
                "start the server with --kvctl-dir /dev/shm/radix and the proxy with --shm-dir /dev/shm/radix",
            )
        )
    elif shm_dir is not None and Path(theirs).resolve() != shm_dir.resolve():
        out.append(
            Check(
                "payload dir",
                "warn",
                f"the server's --kvctl-dir is {theirs}, --shm-dir is {shm_dir}: "
                "the proxy would fall back to inline payloads (slower)",
                f"give the proxy --shm-dir {theirs} (or the server --kvctl-dir {shm_dir})",
            )
        )
    elif not os.path.isdir(theirs) or not os.access(theirs, os.W_OK):
        out.append(
            Check(
                "payload dir",
                "warn",
                f"the server's --kvctl-dir {theirs} is not a writable directory "
                "here (another host?): payloads will go inline",
                f"run the proxy on the server's host with --shm-dir {theirs}",
            )
        )
    else:
        hint = "" if shm_dir is not None else f" (give the proxy --shm-dir {theirs})"
        out.append(Check("payload dir", "ok", f"payload files through {theirs}{hint}"))
    if caps.get("fault_injection"):
        out.append(
            Check(
                "fault injection",
                "warn",
                "a test build with import fault injection",
                "use the normal build (`radixctl build` without --fault-injection)",
            )
        )
    return out


async def _template_check(backend: Any) -> Check:
    """Whether the proxy will render chat templates itself (the startup probe, as a check)."""
    from proxy.server.ops.startup import probe_chat_template

    try:
        found = await probe_chat_template(backend)
    except (RadixError, KeyError) as exc:
        return Check("chat template parity", "warn", f"could not probe: {exc}")
    if found.template is not None:
        checked = found.parity.checked if found.parity else 0
        return Check(
            "chat template parity",
            "ok",
            f"rendered in the proxy: identical to /apply-template on {checked} chats",
        )
    return Check(
        "chat template parity",
        "warn",
        f"rendered by the server's /apply-template ({found.reason}): one more HTTP call per request",
        "nothing to change (same prompts, slower); or report the template",
    )


async def _parity_check(backend: Any, model_path: Path, cache: Path) -> Check:
    """The proxy's own startup probe (:func:`proxy.tokenizer.probe`), told as a check with its fix."""
    from proxy.tokenizer import probe

    if not model_path.is_file():
        return Check(
            "tokenizer",
            "warn",
            f"the model file {model_path} is not readable here: the proxy will "
            "tokenize through the server's /tokenize (one more HTTP call per request)",
            "run the proxy where the model file is at the same path",
        )

    async def remote(text: str) -> list[int]:
        return list(await backend.tokenize(text, add_special=True, parse_special=True))

    found = await probe(model_path, cache, remote)
    if found.parity is None:
        return Check(
            "tokenizer",
            "warn",
            f"no local tokenizer for this model ({found.error}): the proxy will use "
            "the server's /tokenize (slower, same tokens)",
            "nothing to change; or report the model's tokenizer",
        )
    result = found.parity
    if result.ok:
        return Check(
            "tokenizer",
            "ok",
            f"local tokenizer identical to the server's on {result.checked} texts "
            "(add_special, parse_special)",
        )
    first = (
        f"first difference in {result.mismatches[0].text[:60]!r}: local {result.mismatches[0].local[:12]} "
        f"vs server {result.mismatches[0].remote[:12]}"
        if result.mismatches
        else "; ".join(result.errors[:2])
    )
    return Check(
        "tokenizer",
        "fail",
        f"local tokenizer differs from the server's on {len(result.mismatches)} of "
        f"{result.checked} texts ({len(result.errors)} errors); {first}",
        "nothing breaks: the proxy then tokenizes through the server's /tokenize (slower); report the "
        "mismatch with the model's name",
    )


def format_doctor(url: str, checks: list[Check]) -> str:
    lines = [f"llama-server {url}"]
    width = max(len(c.name) for c in checks)
    for c in checks:
        lines.append(f"  {c.status.upper():4}  {c.name.ljust(width)}  {c.detail}")
        if c.fix:
            lines.append(f"        {' ' * width}  fix: {c.fix}")
    fails = sum(c.status == "fail" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    lines.append(
        f"result: {fails} problem(s), {warns} warning(s)" if fails or warns else "result: ready for the proxy"
    )
    return "\n".join(lines)


# ---- the command -------------------------------------------------------------------------------


@click.command()
@click.option(
    "--backend-url",
    "backends",
    multiple=True,
    required=True,
    help="llama-server base URL to check (repeatable).",
)
@kvctl_key_option
@kvctl_key_file_option
@server_api_key_option
@server_api_key_file_option
@click.option(  # not shm_dir_option: the directory is the proxy's, only compared here
    "--shm-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="RADIX_SHM_DIR",
    help="The --shm-dir the proxy will be given (checked against the server's --kvctl-dir).",
)
@json_option
@fail_cleanly
def doctor(
    backends: tuple[str, ...],
    kvctl_key: str | None,
    kvctl_key_file: Path | None,
    server_api_key: str | None,
    server_api_key_file: Path | None,
    shm_dir: Path | None,
    as_json: bool,
) -> None:
    """Check llama-servers for use behind the proxy: flags, /kvctl capabilities, tokenizer parity.

    Every problem is printed with what to change. Exit status 1 when any check fails."""
    from proxy.native.fetch import cache_root

    keys: dict[str, Any] = {
        "kvctl_key": kvctl_key,
        "kvctl_key_file": kvctl_key_file,
        "server_api_key": server_api_key,
        "server_api_key_file": server_api_key_file,
    }
    take_kvctl_key_file(keys)
    kvctl_key, server_api_key = keys["kvctl_key"], keys["server_api_key"]

    results = {}
    for url in backends:
        results[url] = asyncio.run(
            check_server(url, kvctl_key, shm_dir, cache_root() / "tokenizers", server_api_key)
        )
    failed = any(c.status == "fail" for checks in results.values() for c in checks)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "ok": not failed,
                    "servers": [
                        {
                            "url": url,
                            "ok": not any(c.status == "fail" for c in checks),
                            "checks": [asdict(c) for c in checks],
                        }
                        for url, checks in results.items()
                    ],
                },
                indent=2,
            )
        )
    else:
        click.echo("\n\n".join(format_doctor(url, checks) for url, checks in results.items()))
    if failed:
        sys.exit(1)
