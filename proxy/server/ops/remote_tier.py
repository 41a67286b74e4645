"""Startup of the remote tier (``--cache-remote``, docs/scale-out.md): checks, key, client."""

from __future__ import annotations

import json

from proxy.config import Config
from proxy.core.arena import auto_chunk
from proxy.errors import ConfigError
from proxy.server.coordinator import ServerState
from proxy.server.dataplane.arena import Arena
from proxy.server.metrics import Metrics
from proxy.server.tiers.disk import compat_key
from proxy.server.tiers.disk_files import load_secret
from proxy.server.tiers.remote import RemoteSettings, RemoteTier
from proxy.server.tiers.remote_store import (
    ClientCert,
    check_ca_file,
    check_client_cert,
    make_client,
    parse_store_url,
    read_passphrase,
    read_password,
)


async def open_remote_tier(
    config: Config, servers: list[ServerState], metrics: Metrics, arena: Arena | None
) -> RemoteTier:
    """The remote tier for the servers' one model. A store that does not answer yet is not an
    error (it is asked again later); a bad URL, key or password file is."""
    assert config.cache_remote is not None
    if len({json.dumps(s.mover.compat, sort_keys=True) for s in servers}) > 1:
        raise ConfigError(
            "--cache-remote serves one model (one KV layout); the servers run several",
            fix="run one proxy per model with a remote tier, or leave --cache-remote unset",
        )
    server = servers[0]
    if server.mover.layout is None:
        raise ConfigError(
            f"--cache-remote needs KV moves, which are off for {server.name}: {'; '.join(server.moves_off)}",
            fix="leave --cache-remote unset for this model",
        )
    if config.cache_remote_key_file is None:
        raise ConfigError(
            "--cache-remote needs --cache-remote-key-file: the MAC key every proxy of the fleet shares",
            fix="--cache-remote-key-file FILE (the same 0600 file on every proxy; made if missing)",
        )
    address = parse_store_url(config.cache_remote)
    if config.cache_remote_ca_file is not None:
        check_ca_file(address, config.cache_remote_ca_file)
    client_cert = _client_cert(config)
    if client_cert is not None:
        check_client_cert(address, client_cert)
    try:
        secret = load_secret(config.cache_remote_key_file)
        password = (
            read_password(config.cache_remote_password_file)
            if config.cache_remote_password_file is not None
            else None
        )
    except OSError as exc:
        raise ConfigError(f"--cache-remote: {exc}", fix="check the key and password files") from exc
    settings = RemoteSettings(
        key_prefix=config.cache_remote_prefix,
        min_tokens=config.min_restore_tokens,
        queue_bytes=config.cache_remote_queue_mib << 20,
        timeout_s=config.cache_remote_timeout_s,
        backoff_s=config.cache_remote_backoff_s,
        ttl_s=config.cache_remote_ttl_s,
    )
    layout = server.mover.layout
    tier = RemoteTier(
        make_client(
            address, password, config.cache_remote_timeout_s, config.cache_remote_ca_file, client_cert
        ),
        compat_key(server.mover.compat),
        secret,
        layout,
        config.kv_arena_chunk or auto_chunk(layout.bytes_per_token),  # one size for the whole fleet
        metrics.remote,
        settings,
        arena=arena,
        on_arena_full=metrics.arena_full.labels("promote").inc,
        where=address.where,
    )
    await tier.open()
    return tier


def _client_cert(config: Config) -> ClientCert | None:
    if config.cache_remote_client_cert_file is None:
        for option, value in (
            ("--cache-remote-client-key-file", config.cache_remote_client_key_file),
            ("--cache-remote-client-key-password-file", config.cache_remote_client_key_password_file),
        ):
            if value is not None:
                raise ConfigError(
                    f"{option} needs --cache-remote-client-cert-file",
                    fix="give the certificate too, or leave the key's options unset",
                )
        return None
    password_file = config.cache_remote_client_key_password_file
    try:
        password = read_passphrase(password_file) if password_file is not None else None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"--cache-remote-client-key-password-file: {exc}", fix="check the passphrase file"
        ) from exc
    return ClientCert(config.cache_remote_client_cert_file, config.cache_remote_client_key_file, password)
