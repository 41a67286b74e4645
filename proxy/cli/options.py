"""Options shared by more than one radixctl command, defined once (decorate a command with ``@host_option``).

One object per option keeps the name, default, ``RADIX_*`` variable and help text identical
wherever the option appears: ``serve`` and ``up`` take every proxy option, the inspect commands
share how they reach the proxy, ``up`` and the bench arms pick the model and start llama-server
the same way. Options that only one command has stay next to that command.

A proxy option's destination is its ``Config`` field and its default is that field's default
(``default=Config.<field>``, in the option's unit where the option is in KiB or MiB):
``tests/unit/test_options.py`` checks both, and the README's options table against them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from proxy.config import Config
from proxy.native.build import BACKENDS, BuildSpec
from proxy.server.ops.eventloop import EVENT_LOOPS

#: Backends ``radixctl build`` can compile llama-server for.
BUILD_BACKENDS = list(BACKENDS)

_Fn = Callable[..., Any]  # a command function, before or after an option decorates it

KIB = 1 << 10
MIB = 1 << 20


def _on_off(ctx: click.Context, param: click.Parameter, value: str) -> bool:
    """``on``/``off`` on the command line (and in ``RADIX_*``), a bool in the config."""
    return value == "on"


def _on_off_option(flag: str, dest: str, default: bool, envvar: str, help: str) -> Any:
    """An ``on``/``off`` option (a bool in the config)."""
    return click.option(
        flag,
        dest,
        type=click.Choice(["on", "off"]),
        default="on" if default else "off",
        show_default=True,
        envvar=envvar,
        callback=_on_off,
        help=help,
    )


# ---- the proxy (serve, up) -------------------------------------------------------------------

host_option = click.option(
    "--host",
    default=Config.host,
    show_default=True,
    envvar="RADIX_HOST",
    help="Address the proxy listens on.",
)
port_option = click.option(
    "--port", default=Config.port, show_default=True, envvar="RADIX_PORT", help="Proxy port."
)
cache_ram_option = click.option(
    "--cache-ram",
    "cache_ram_mib",
    default=Config.cache_ram_mib,
    show_default=True,
    envvar="RADIX_CACHE_RAM",
    help="Host radix tree budget in MiB (payload plus metadata).",
)
cache_disk_option = click.option(
    "--cache-disk",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="RADIX_CACHE_DISK",
    help="Directory of the disk tier: KV evicted from RAM is kept there and survives restarts "
    "(created owner-only). Unset: RAM only.",
)
cache_disk_size_option = click.option(
    "--cache-disk-size",
    "cache_disk_gib",
    type=click.FloatRange(min=0, min_open=True),
    default=Config.cache_disk_gib,
    show_default=True,
    envvar="RADIX_CACHE_DISK_SIZE",
    help="Disk tier budget in GiB (segment files, headers included).",
)
cache_disk_key_file_option = click.option(
    "--cache-disk-key-file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="RADIX_CACHE_DISK_KEY_FILE",
    help="The disk tier's MAC key, outside its directory (a 0600 file of ours; made with 32 "
    "random bytes if missing). Default: <cache-disk>.key.",
)
cache_remote_option = click.option(
    "--cache-remote",
    envvar="RADIX_CACHE_REMOTE",
    help="Remote tier shared by many proxies: valkey://HOST:PORT[/DB] (also redis://, rediss:// "
    "with TLS). Needs --cache-remote-key-file. Unset: local tiers only.",
)
cache_remote_key_file_option = click.option(
    "--cache-remote-key-file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="RADIX_CACHE_REMOTE_KEY_FILE",
    help="The remote entries' MAC key, the same file on every proxy that shares the store (a 0600 "
    "file of ours; made with 32 random bytes if missing).",
)
cache_remote_password_file_option = click.option(
    "--cache-remote-password-file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="RADIX_CACHE_REMOTE_PASSWORD_FILE",
    help="The store's AUTH password (a 0600 file of ours); a password in the URL is refused.",
)
cache_remote_ca_file_option = click.option(
    "--cache-remote-ca-file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="RADIX_CACHE_REMOTE_CA_FILE",
    help="With rediss://: the CA certificates (PEM) the store's certificate must chain to "
    "(default: the system's CAs); the host name is checked against it either way.",
)
cache_remote_client_cert_file_option = click.option(
    "--cache-remote-client-cert-file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="RADIX_CACHE_REMOTE_CLIENT_CERT_FILE",
    help="With rediss://: the certificate (PEM chain) shown to a store that asks for one "
    "(tls-auth-clients); its key in --cache-remote-client-key-file or in this file.",
)
cache_remote_client_key_file_option = click.option(
    "--cache-remote-client-key-file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="RADIX_CACHE_REMOTE_CLIENT_KEY_FILE",
    help="The client certificate's private key (PEM; a 0600 file of ours).",
)
cache_remote_client_key_password_file_option = click.option(
    "--cache-remote-client-key-password-file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="RADIX_CACHE_REMOTE_CLIENT_KEY_PASSWORD_FILE",
    help="The passphrase of an encrypted client key (a 0600 file of ours, one line); "
    "without it an encrypted key is refused at startup.",
)
cache_remote_timeout_option = click.option(
    "--cache-remote-timeout",
    "cache_remote_timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=Config.cache_remote_timeout_s,
    show_default=True,
    envvar="RADIX_CACHE_REMOTE_TIMEOUT",
    help="Deadline of one remote store call, seconds; past it the request goes on without the store.",
)
shm_dir_option = click.option(
    "--shm-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="RADIX_SHM_DIR",
    help="Shared-memory directory for KV payload files (same host as the server).",
)
kv_arena_option = _on_off_option(
    "--kv-arena",
    "kv_arena",
    Config.kv_arena,
    "RADIX_KV_ARENA",
    "Keep the host tree's KV in one shared-memory arena of --cache-ram bytes in --shm-dir, "
    "allocated at startup; same-host moves are then one copy. Off: payload files per move.",
)
kv_arena_chunk_option = click.option(
    "--kv-arena-chunk",
    "kv_arena_chunk",
    type=click.IntRange(0, 65536),
    default=Config.kv_arena_chunk,
    show_default=True,
    envvar="RADIX_KV_ARENA_CHUNK",
    help="Tokens per arena block: exports are cut at multiples of it, imports read whole blocks "
    "(0: about 16 MiB of KV per block).",
)
min_restore_tokens_option = click.option(
    "--min-restore-tokens",
    default=Config.min_restore_tokens,
    show_default=True,
    envvar="RADIX_MIN_RESTORE_TOKENS",
    help="A host restore shorter than this is prefilled instead.",
)
kvctl_key_option = click.option(
    "--kvctl-key",
    envvar="RADIX_KVCTL_KEY",
    help="Key for the servers' /kvctl API.",
)
kvctl_key_file_option = click.option(
    "--kvctl-key-file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="RADIX_KVCTL_KEY_FILE",
    help="Read the /kvctl key from the first line of this file (keeps it out of argv and the environment).",
)


server_api_key_option = click.option(
    "--server-api-key",
    envvar="RADIX_SERVER_API_KEY",
    help="The servers' own API key (llama-server --api-key): sent on every call but /kvctl.",
)
server_api_key_file_option = click.option(
    "--server-api-key-file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="RADIX_SERVER_API_KEY_FILE",
    help="Read the servers' API key from the first line of this file (as llama-server's --api-key-file).",
)


def take_kvctl_key_file(kw: dict[str, Any]) -> None:
    """Replace ``kw["kvctl_key_file"]`` by the key it holds, in ``kw["kvctl_key"]`` (and the
    same for ``server_api_key_file``, when the command has it).

    Same reading as llama-server's --kvctl-key-file: the first line, trailing whitespace off."""
    _take_key_file(kw, "kvctl_key")
    if "server_api_key_file" in kw:
        _take_key_file(kw, "server_api_key")


def _take_key_file(kw: dict[str, Any], name: str) -> None:
    path: Path | None = kw.pop(f"{name}_file", None)
    flag = "--" + name.replace("_", "-")
    if path is None:
        return
    if kw.get(name):
        raise click.UsageError(f"give {flag} or {flag}-file, not both")
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint=f"{flag}-file") from exc
    key = lines[0].rstrip() if lines else ""
    if not key:
        raise click.BadParameter(f"{path} holds an empty key", param_hint=f"{flag}-file")
    kw[name] = key


kv_share_option = _on_off_option(
    "--cache-kv-share",
    "kv_share",
    Config.kv_share,
    "RADIX_CACHE_KV_SHARE",
    "Resident KV sharing (route S): prefixes held once in the server's pool.",
)
idle_release_option = _on_off_option(
    "--cache-idle-release",
    "idle_release",
    Config.idle_release,
    "RADIX_CACHE_IDLE_RELEASE",
    "Erase a slot's KV from the server once the host tree holds it (each next turn is a "
    "host restore): a smaller KV pool makes every other request's compute cheaper; off keeps "
    "it for the slot's own next turn (route A).",
)
kv_share_min_tokens_option = click.option(
    "--cache-kv-share-min-tokens",
    "kv_share_min_tokens",
    default=Config.kv_share_min_tokens,
    show_default=True,
    envvar="RADIX_CACHE_KV_SHARE_MIN_TOKENS",
    help="Shortest prefix recorded or attached.",
)
kv_share_max_entries_option = click.option(
    "--cache-kv-share-max-entries",
    "kv_share_max_entries",
    default=Config.kv_share_max_entries,
    show_default=True,
    envvar="RADIX_CACHE_KV_SHARE_MAX_ENTRIES",
    help="Resident entries (0: min(64, owner ids)).",
)
kv_share_cells_option = click.option(
    "--cache-kv-share-cells",
    "kv_share_cells",
    default=Config.kv_share_cells,
    show_default=True,
    envvar="RADIX_CACHE_KV_SHARE_CELLS",
    help="Owner cell budget B (0: half the pool).",
)
kv_share_headroom_option = click.option(
    "--cache-kv-share-headroom",
    "kv_share_headroom",
    default=Config.kv_share_headroom,
    show_default=True,
    envvar="RADIX_CACHE_KV_SHARE_HEADROOM",
    help="Free cells R kept for requests (0: min(n_ubatch, max(1, pool/8))).",
)
kv_share_route_option = click.option(
    "--cache-kv-share-route",
    "kv_share_route",
    type=click.Choice(["longest", "share"]),
    default=Config.kv_share_route,
    show_default=True,
    envvar="RADIX_CACHE_KV_SHARE_ROUTE",
    help="longest: longest executable prefix (ties A > S > H); share: A or S first.",
)
admin_key_option = click.option(
    "--admin-key",
    envvar="RADIX_ADMIN_KEY",
    help="Key for the proxy's /radix admin API.",
)
metrics_port_option = click.option(
    "--metrics-port",
    default=Config.metrics_port,
    show_default=True,
    envvar="RADIX_METRICS_PORT",
    type=click.IntRange(0, 65535),
    help="Also serve /metrics, with no key, on this port of --host (for a scraper elsewhere; "
    "0: none). On the client port /metrics answers local clients or --admin-key only.",
)
record_option = click.option(
    "--record",
    "record_path",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="RADIX_RECORD",
    help="Append every completion request to this manifest (replay: radixctl bench replay).",
)
max_body_option = click.option(
    "--max-body",
    "max_body_mib",
    default=Config.max_body_mib,
    show_default=True,
    envvar="RADIX_MAX_BODY",
    type=click.IntRange(1, 1024),
    help="Largest request body in MiB (larger ones get 413).",
)


def _times(factor: int) -> Callable[[click.Context, click.Parameter, int], int]:
    """A size given in KiB or MiB on the command line, in bytes in the config."""
    return lambda ctx, param, value: value * factor


idle_timeout_option = click.option(
    "--idle-timeout",
    "idle_timeout_s",
    default=Config.idle_timeout_s,
    show_default=True,
    envvar="RADIX_IDLE_TIMEOUT",
    type=click.FloatRange(0.1),
    help="Seconds a client connection may be idle, or take to send a request's head; then it is closed.",
)
body_timeout_option = click.option(
    "--body-timeout",
    "body_timeout_s",
    default=Config.body_timeout_s,
    show_default=True,
    envvar="RADIX_BODY_TIMEOUT",
    type=click.FloatRange(0.1),
    help="Seconds a client may take to send a request's body; then 408 and the connection is closed.",
)
max_connections_option = click.option(
    "--max-connections",
    default=Config.max_connections,
    show_default=True,
    envvar="RADIX_MAX_CONNECTIONS",
    type=click.IntRange(0),
    help="Client connections open at once; more are closed as they are accepted (0: no cap). "
    "The open-file limit is raised to fit them at start.",
)
max_connections_per_client_option = click.option(
    "--max-connections-per-client",
    default=Config.max_connections_per_client,
    show_default=True,
    envvar="RADIX_MAX_CONNECTIONS_PER_CLIENT",
    type=click.IntRange(0),
    help="Client connections open at once from one address (0: no cap; behind a balancer every "
    "client has its address: raise it or use 0 there).",
)
max_answer_option = click.option(
    "--max-answer",
    "max_answer_bytes",
    default=Config.max_answer_bytes // MIB,
    show_default=True,
    envvar="RADIX_MAX_ANSWER",
    type=click.IntRange(1),
    callback=_times(MIB),
    help="Largest answer the proxy holds for a client, MiB: a non-streamed or pass-through answer, "
    "one event of a stream (a larger one is cut with a 502).",
)
max_passthrough_body_option = click.option(
    "--max-passthrough-body",
    "max_passthrough_body_bytes",
    default=Config.max_passthrough_body_bytes // KIB,
    show_default=True,
    envvar="RADIX_MAX_PASSTHROUGH_BODY",
    type=click.IntRange(1),
    callback=_times(KIB),
    help="Largest body in KiB of a read-only pass-through request (/tokenize, /apply-template, "
    "/detokenize, the token counters); larger ones get 413.",
)
max_passthrough_option = click.option(
    "--max-passthrough",
    default=Config.max_passthrough,
    show_default=True,
    envvar="RADIX_MAX_PASSTHROUGH",
    type=click.IntRange(1),
    help="Read-only pass-through requests at once per server (the rest wait, then 503): they "
    "share the server's HTTP threads with its /health.",
)
max_logprobs_option = click.option(
    "--max-logprobs",
    default=Config.max_logprobs,
    show_default=True,
    envvar="RADIX_MAX_LOGPROBS",
    type=click.IntRange(0),
    help="Most log-probabilities per token a request may ask for (n_probs, top_logprobs, logprobs); "
    "more get 400. 20 is OpenAI's limit.",
)
max_grammar_option = click.option(
    "--max-grammar",
    "max_grammar_bytes",
    default=Config.max_grammar_bytes // KIB,
    show_default=True,
    envvar="RADIX_MAX_GRAMMAR",
    type=click.IntRange(1),
    callback=_times(KIB),
    help="Largest grammar or JSON schema (json_schema, response_format) in KiB; larger get 400.",
)
max_grammar_depth_option = click.option(
    "--max-grammar-depth",
    default=Config.max_grammar_depth,
    show_default=True,
    envvar="RADIX_MAX_GRAMMAR_DEPTH",
    type=click.IntRange(1),
    help="Deepest nesting of a grammar's groups or of a JSON schema (json_schema, response_format, "
    "tools); deeper get 400 (the server's parsers recurse).",
)
max_grammar_rules_option = click.option(
    "--max-grammar-rules",
    default=Config.max_grammar_rules,
    show_default=True,
    envvar="RADIX_MAX_GRAMMAR_RULES",
    type=click.IntRange(1),
    help="Most rules in a grammar; more get 400 (a long chain of rules overflows the server's stack).",
)


def _isolation_sources(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    sources = tuple(s.strip() for s in value.split(",") if s.strip() and s.strip() != "none")
    unknown = [s for s in sources if s not in ("field", "header", "api-key")]
    if unknown:
        raise click.BadParameter(f"unknown source {unknown[0]!r}: use field, header, api-key or none")
    return sources


cache_isolation_option = click.option(
    "--cache-isolation",
    "cache_isolation",
    default=",".join(Config.cache_isolation),
    show_default=True,
    envvar="RADIX_CACHE_ISOLATION",
    callback=_isolation_sources,
    help="Where a request's cache-isolation key comes from (comma list): field (body cache_salt), header "
    "(X-Cache-Salt), api-key (Authorization: Bearer); none: one cache for all. Requests with different "
    "keys never reuse each other's KV.",
)
cache_info_option = _on_off_option(
    "--cache-info",
    "cache_info",
    Config.cache_info,
    "RADIX_CACHE_INFO",
    "Tell clients how much of their prompt was cached (X-Radix-* headers, timings). Turn off when "
    "clients do not trust each other: it is an exact oracle for other tenants' prompts.",
)
max_queue_option = click.option(
    "--max-queue",
    "max_queue",
    default=Config.max_queue,
    show_default=True,
    envvar="RADIX_MAX_QUEUE",
    type=click.IntRange(0),
    help="Requests that may wait for a slot; more get 429 with Retry-After (0: four per slot).",
)
queue_timeout_option = click.option(
    "--queue-timeout",
    "queue_timeout_s",
    default=Config.queue_timeout_s,
    show_default=True,
    envvar="RADIX_QUEUE_TIMEOUT",
    type=click.FloatRange(0.1),
    help="Seconds a request may wait for a slot before a 503 with Retry-After.",
)
backend_read_timeout_option = click.option(
    "--backend-read-timeout",
    "backend_read_timeout_s",
    default=Config.backend_read_timeout_s,
    show_default=True,
    envvar="RADIX_BACKEND_READ_TIMEOUT",
    type=click.FloatRange(1),
    help="Seconds without a byte from llama-server before a completion is cut (a long prefill sends none).",
)
shutdown_grace_option = click.option(
    "--shutdown-grace",
    "shutdown_grace_s",
    default=Config.shutdown_grace_s,
    show_default=True,
    envvar="RADIX_SHUTDOWN_GRACE",
    type=click.FloatRange(0),
    help="On SIGTERM/Ctrl-C, seconds in-flight requests get to finish (a second signal exits at once).",
)
admin_show_text_option = click.option(
    "--admin-show-text",
    is_flag=True,
    default=Config.admin_show_text,
    envvar="RADIX_ADMIN_SHOW_TEXT",
    help="Show prompt text (previews, divergences) in the /radix admin API; token counts only otherwise.",
)
event_loop_option = click.option(
    "--event-loop",
    default=Config.event_loop,
    show_default=True,
    envvar="RADIX_EVENT_LOOP",
    type=click.Choice(EVENT_LOOPS),
    help="The proxy's event loop: auto is uvloop when installed (less time added per request), else asyncio's.",
)
log_level_option = click.option(
    "--log-level",
    default=Config.log_level,
    show_default=True,
    envvar="RADIX_LOG_LEVEL",
    type=click.Choice(["debug", "info", "warning", "error"]),
)

# ---- a llama-server to start (up, the bench arms, soak) ----------------------------------------
# Factories: ``up`` gives each its RADIX_* variable; the bench commands keep click's automatic
# RADIX_BENCH_<COMMAND>_* names. What no --threads means differs (up: llama-server's own
# choice; the bench arms: every core; soak: 2), so each command says so in its help.

parallel_option = functools.partial(
    click.option, "--parallel", "-np", "n_parallel", default=4, show_default=True, help="Slots per server."
)
ctx_size_option = functools.partial(
    click.option,
    "--ctx-size",
    "-c",
    default=16384,
    show_default=True,
    help="Total KV pool in tokens (shared by all slots).",
)
threads_option = functools.partial(click.option, "--threads", "-t", type=int)


def build_backend_option(flag: str = "--build-backend", **kw: Any) -> Callable[[_Fn], _Fn]:
    """Which llama-server build (``radixctl build --backend``; ``--build-backend`` elsewhere)."""
    return click.option(
        flag, type=click.Choice(BUILD_BACKENDS), default=BuildSpec.backend, show_default=True, **kw
    )


# ---- a model to serve (up, bench arms) --------------------------------------------------------

model_option = click.option(
    "--model",
    "-m",
    "model_arg",
    default=None,
    envvar="RADIX_MODEL",
    help="GGUF path, or shape:NAME[:QUANT] for a random-weight model of a real shape "
    "(radixctl model shapes; written once) (default: SmolLM2-135M-Instruct from its wheel).",
)

# ---- reaching a running proxy (routes, tree, slots, stats) -----------------------------------

url_option = click.option(
    "--url",
    default=f"http://{Config.host}:{Config.port}",
    show_default=True,
    envvar="RADIX_URL",
    help="The proxy's base URL.",
)
proxy_admin_key_option = click.option(
    "--admin-key",
    envvar="RADIX_ADMIN_KEY",
    help="The proxy's --admin-key, if it has one.",
)

# ---- output (inspect commands, doctor) ----------------------------------------------------------

json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def proxy_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Every option of the proxy itself, in --help order (serve and up)."""
    for option in reversed(PROXY_OPTIONS):
        fn = option(fn)
    return fn


PROXY_OPTIONS = [
    host_option,
    port_option,
    cache_ram_option,
    cache_disk_option,
    cache_disk_size_option,
    cache_disk_key_file_option,
    cache_remote_option,
    cache_remote_key_file_option,
    cache_remote_password_file_option,
    cache_remote_ca_file_option,
    cache_remote_client_cert_file_option,
    cache_remote_client_key_file_option,
    cache_remote_client_key_password_file_option,
    cache_remote_timeout_option,
    shm_dir_option,
    kv_arena_option,
    kv_arena_chunk_option,
    min_restore_tokens_option,
    kvctl_key_option,
    kvctl_key_file_option,
    server_api_key_option,
    server_api_key_file_option,
    kv_share_option,
    idle_release_option,
    kv_share_min_tokens_option,
    kv_share_max_entries_option,
    kv_share_cells_option,
    kv_share_headroom_option,
    kv_share_route_option,
    admin_key_option,
    admin_show_text_option,
    metrics_port_option,
    cache_isolation_option,
    cache_info_option,
    max_body_option,
    idle_timeout_option,
    body_timeout_option,
    max_connections_option,
    max_connections_per_client_option,
    max_answer_option,
    max_logprobs_option,
    max_passthrough_body_option,
    max_passthrough_option,
    max_grammar_option,
    max_grammar_depth_option,
    max_grammar_rules_option,
    max_queue_option,
    queue_timeout_option,
    backend_read_timeout_option,
    shutdown_grace_option,
    record_option,
    event_loop_option,
    log_level_option,
]
