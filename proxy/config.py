"""The proxy's one configuration object, built by the CLI and passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

PayloadMode = Literal["auto", "shared", "inline"]
PAYLOAD_MODES: tuple[PayloadMode, ...] = ("auto", "shared", "inline")


@dataclass(frozen=True)
class BackendSpec:
    """One ``--backend-url`` value: ``[MODEL=]URL[#auto|#shared|#inline]``.

    ``model``: the name clients ask for in the request's ``model`` field ("" = the name the
    server reports in its /v1/models). ``payloads``: whether the server shares the proxy's
    payload directory (``shared``), does not (``inline``: KV travels in HTTP bodies), or
    ``auto``: shared when the server names the proxy's directory and is on this host."""

    url: str
    model: str = ""
    payloads: PayloadMode = "auto"


def parse_backend(spec: str) -> BackendSpec:
    """``[MODEL=]URL[#auto|#shared|#inline]`` -> BackendSpec (ValueError when malformed)."""
    text, _, mode = spec.strip().partition("#")
    model = ""
    head, sep, rest = text.partition("=")
    if sep and "://" not in head and "/" not in head:
        model, text = head.strip(), rest.strip()
        if not model:
            raise ValueError(f"empty model name in backend {spec!r}")
    mode = mode.strip() or "auto"
    if mode not in PAYLOAD_MODES:
        raise ValueError(f"backend {spec!r}: payload mode must be one of {', '.join(PAYLOAD_MODES)}")
    if not text.startswith(("http://", "https://")):
        raise ValueError(f"backend {spec!r}: the URL must start with http:// or https://")
    return BackendSpec(text.rstrip("/"), model, mode)


@dataclass(frozen=True)
class Config:
    backends: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    # Host radix tree budget (payload bytes plus metadata), MiB.
    cache_ram_mib: int = 4096
    # Disk tier under the host tree (docs/disk-tier.md): segments evicted from RAM go here and
    # survive restarts. None: RAM only. Budget in GiB; demotions waiting to be written are
    # bounded in MiB; each disk read or write has a deadline.
    cache_disk: Path | None = None
    cache_disk_gib: float = 16.0
    cache_disk_queue_mib: int = 256
    cache_disk_timeout_s: float = 30.0
    # The disk entries' MAC key (outside the directory). None: <cache_disk>.key, made on first use.
    cache_disk_key_file: Path | None = None
    # Remote tier under RAM and disk, shared by a fleet of proxies (docs/scale-out.md):
    # valkey://, redis:// or rediss:// (TLS) HOST:PORT[/DB]; None: off. Its entries' MAC key is
    # required (the same file on every proxy of the fleet); the store's password from a file.
    # Chunks waiting to be written are bounded in MiB; every store call has a deadline; after a
    # failure the store is not asked for backoff seconds; entries expire after ttl (0: never,
    # the store's maxmemory-policy evicts).
    cache_remote: str | None = None
    cache_remote_key_file: Path | None = None
    cache_remote_password_file: Path | None = None
    # TLS (rediss://): the CA certificates (PEM) the store's certificate must chain to; None:
    # the system's CAs. The host name is always checked against the certificate.
    cache_remote_ca_file: Path | None = None
    # TLS: the certificate (PEM chain) shown to a store that asks for one (tls-auth-clients), and
    # its private key, a 0600 file of ours (None: in the certificate's file).
    cache_remote_client_cert_file: Path | None = None
    cache_remote_client_key_file: Path | None = None
    cache_remote_client_key_password_file: Path | None = None
    cache_remote_queue_mib: int = 256
    cache_remote_timeout_s: float = 2.0
    cache_remote_backoff_s: float = 5.0
    cache_remote_ttl_s: int = 0
    cache_remote_prefix: str = "radix"
    # Payload files live here when the server shares the host (normally under /dev/shm).
    shm_dir: Path | None = None
    # The host tree's KV in one shared-memory arena of --cache-ram bytes in --shm-dir, made and
    # faulted in at startup; moves are one copy (docs/design.md, "The arena"). Off: payload files.
    kv_arena: bool = True
    # Exports are cut into blobs at positions that are multiples of this (arena blocks);
    # 0: about 16 MiB of KV per block (proxy/core/arena.py auto_chunk).
    kv_arena_chunk: int = 0
    # A host restore shorter than this is not worth a KV move (prefill it instead).
    min_restore_tokens: int = 64
    kvctl_key: str | None = None
    # The servers' own API key (llama-server --api-key-file), sent on every call but /kvctl.
    server_api_key: str | None = None
    admin_key: str | None = None
    # A second port (on --host) serving /metrics only, with no key: for a scraper that is not on
    # this host. 0: none; /metrics is then under the admin rule on the client port.
    metrics_port: int = 0
    tokenizer_cache: Path | None = None
    log_level: str = "info"
    # Resident sharing (route S); off by default like the reference design.
    kv_share: bool = False
    kv_share_min_tokens: int = 32
    kv_share_max_entries: int = 0  # 0: min(64, owner ids the server offers)
    kv_share_cells: int = 0  # owner cell budget B; 0: half the pool
    kv_share_headroom: int = 0  # free cells R kept for requests; 0: min(n_ubatch, max(1, pool/8))
    kv_share_route: Literal["longest", "share"] = "longest"
    # After a slot's answer is saved to the host tree, erase the slot's KV from the server's
    # pool (as stock llama-server's --cache-idle-slots does): a unified pool's used range is
    # what every ubatch attends over, so idle KV makes everyone else's compute dearer; the
    # slot's next turn is then a host restore instead of its own prefix. On by default: side
    # by side it was faster on restore, agents and prefix-tiers (docs/results/2026-12-02-release).
    idle_release: bool = True
    # Append every completion request, as received, to this manifest (radixctl bench replay).
    record_path: Path | None = None
    # The periodic cache summary log line (logged only when it changed).
    summary_interval_s: float = 60.0
    # Largest request body accepted, MiB (aiohttp's client_max_size).
    max_body_mib: int = 8
    # Client connections: a request head (and the idle time between requests) within
    # idle_timeout_s, a body within body_timeout_s; at most max_connections open (0: no cap), of
    # which max_connections_per_client from one address (0: no cap; behind a balancer every
    # client has the balancer's address).
    idle_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096
    max_connections_per_client: int = 256
    # Most log-probabilities per token a request may ask for (n_probs, top_logprobs,
    # logprobs): the server caps only at the vocabulary, and each one is ~100 bytes a token.
    max_logprobs: int = 20
    # Largest answer the proxy holds for a client: a whole non-streamed answer, a pass-through
    # answer, one SSE event line. Past it the answer is cut with a 502.
    max_answer_bytes: int = 64 << 20
    # The read-only pass-through (/tokenize, /apply-template, ...) runs on the server's few HTTP
    # threads, which its /health shares: a body bound, and at most this many at once per
    # server (the rest wait up to queue_timeout_s, then 503), so a flood cannot starve /health.
    max_passthrough_body_bytes: int = 1 << 20
    max_passthrough: int = 1
    # The server parses grammars and converts JSON schemas recursively: bound what reaches it.
    # Bytes of a grammar or schema, nesting (grammar parentheses, schema JSON levels), rules.
    max_grammar_bytes: int = 256 << 10
    max_grammar_depth: int = 128
    max_grammar_rules: int = 4096
    # Where a request's cache-isolation key comes from: "field" (body "cache_salt"),
    # "header" (X-Cache-Salt), "api-key" (Authorization: Bearer). Empty: no isolation.
    cache_isolation: tuple[str, ...] = ("field", "header", "api-key")
    # Tell clients how much of their prompt was cached (X-Radix-* headers, timings).
    cache_info: bool = True
    # Prompt text (previews, divergence) in /radix admin answers; token counts only when off.
    admin_show_text: bool = False
    # Admission: requests waiting for a slot (0: four per slot), and how long one may wait.
    max_queue: int = 0
    queue_timeout_s: float = 60.0
    # The longest a request waits for another request holding its prefix (fan-out, next turn).
    fanout_wait_s: float = 30.0
    # Deadline of the save after an answer; the slot is released (emptied if unknown) after it.
    finish_timeout_s: float = 30.0
    # How long startup waits for the first server to answer (the others are taken in later).
    startup_timeout_s: float = 60.0
    # Health checks of every server (GET /health and /kvctl/caps), seconds between rounds.
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    # A streamed answer is read from the server into this buffer, so a slow client does not hold
    # the slot; a client that falls further behind is cut.
    stream_buffer_bytes: int = 8 << 20
    # A completion with no byte from the server for this long is cut (a long prefill sends none).
    backend_read_timeout_s: float = 600.0
    # On the first SIGTERM/SIGINT, in-flight requests get this long to finish.
    shutdown_grace_s: float = 30.0
    # The event loop: "auto" (uvloop when installed), "uvloop" or "asyncio" (proxy/server/ops/eventloop.py).
    event_loop: str = "auto"

    @property
    def backend_specs(self) -> tuple[BackendSpec, ...]:
        return tuple(parse_backend(b) for b in self.backends)

    @property
    def cache_bytes(self) -> int:
        return self.cache_ram_mib * 1024 * 1024

    @property
    def cache_disk_bytes(self) -> int:
        return int(self.cache_disk_gib * 1024**3)
