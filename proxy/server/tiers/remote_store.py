"""The remote tier's connection: the store's URL and password, and its asyncio client.

redis-py's ``redis.asyncio`` (pure Python, maintained with Redis's protocol and spoken by
Valkey, which forked Redis 7.2 and keeps its protocol), with one retry at most (a pooled connection the store closed): every call
is bounded by the tier's deadline and a failure falls back at once (docs/scale-out.md).
"""

from __future__ import annotations

import os
import ssl
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis import asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from proxy.errors import ConfigError

SCHEMES = {"valkey": "redis", "valkeys": "rediss", "redis": "redis", "rediss": "rediss"}
MAX_CONNECTIONS = 16  # past it a call fails at once (counted), it does not queue


@dataclass(frozen=True)
class StoreAddress:
    url: str  # as redis-py takes it (redis:// or rediss://), without a password
    where: str  # host:port/db, for logs

    @property
    def tls(self) -> bool:
        return self.url.startswith("rediss://")


def parse_store_url(url: str) -> StoreAddress:
    """``valkey://HOST:PORT[/DB]`` (also ``valkeys://``, ``redis://``, ``rediss://``) checked and
    rewritten for redis-py. A password in the URL is refused: it would show in process lists
    and logs (``--cache-remote-password-file``)."""
    parts = urlsplit(url.strip())
    scheme = SCHEMES.get(parts.scheme.lower())
    fix = "--cache-remote valkey://HOST:PORT[/DB] (or redis://, rediss:// for TLS)"
    if scheme is None or not parts.hostname:
        raise ConfigError(f"--cache-remote {url!r}: not a valkey://, redis:// or rediss:// URL", fix=fix)
    if parts.password is not None:
        raise ConfigError(
            "--cache-remote: a password in the URL is refused", fix="--cache-remote-password-file FILE"
        )
    db = parts.path.strip("/") or "0"
    if not db.isdigit():
        raise ConfigError(f"--cache-remote {url!r}: the database must be a number", fix=fix)
    try:
        port = parts.port or 6379
    except ValueError as exc:
        raise ConfigError(f"--cache-remote {url!r}: {exc}", fix=fix) from exc
    user = f"{parts.username}@" if parts.username else ""
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = f"{user}{host}:{port}"
    return StoreAddress(
        urlunsplit((scheme, netloc, f"/{db}", parts.query, "")), f"{scheme}://{host}:{port}/{db}"
    )


def _read_private(path: Path, what: str, limit: int) -> bytes:
    """A secret's file: a regular file of ours (not a link) that others cannot read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(
                f"{what} {path} must be a regular file of ours, mode 600", fix=f"chmod 600 {path}"
            )
        return f.read(limit)


def read_password(path: Path) -> str:
    """The store's password: a regular file of ours that others cannot read (one line)."""
    return _read_private(path, "the store's password file", 4096).decode().strip()


def read_passphrase(path: Path) -> str:
    """A key's passphrase: one line of a regular file of ours that others cannot read, kept as
    written but for the line's end (as openssl's ``-passout file:`` reads it)."""
    data = _read_private(path, "--cache-remote-client-key-password-file", 4096)
    return data.decode().split("\n", 1)[0].rstrip("\r")


@dataclass(frozen=True)
class ClientCert:
    """The certificate the proxy shows a store that asks for one (``tls-auth-clients yes``):
    a PEM chain, its private key (None: in the certificate's file) and the key's passphrase
    (None: the key is not encrypted)."""

    cert_file: Path
    key_file: Path | None = None
    key_password: str | None = field(default=None, repr=False)


def check_client_cert(address: StoreAddress, cert: ClientCert) -> None:
    """For TLS only; the key (in its own file or the certificate's) a file of ours, mode 600,
    not encrypted or opened by the passphrase given, and one that matches the certificate: a
    bad one is a startup error."""
    if not address.tls:
        raise ConfigError(
            f"--cache-remote-client-cert-file is for TLS, but {address.where} is not rediss:// or valkeys://",
            fix="--cache-remote rediss://HOST:PORT, or leave --cache-remote-client-cert-file unset",
        )
    key = cert.key_file or cert.cert_file
    try:
        _read_private(
            key, "--cache-remote-client-key-file" if cert.key_file else "the client certificate's key", 1
        )
        # Without a passphrase an encrypted key would make OpenSSL ask on the terminal: the
        # empty one fails instead.
        passphrase = (cert.key_password or "").encode()
        ssl.create_default_context().load_cert_chain(
            str(cert.cert_file), str(key), password=lambda: passphrase
        )
    except (OSError, ValueError, ssl.SSLError) as exc:  # ValueError: a passphrase too long for OpenSSL
        if cert.key_password is None:
            what, fix = (
                "unencrypted private key",
                "--cache-remote-client-key-password-file for an encrypted key",
            )
        else:
            what, fix = "private key, opened by the passphrase given", "check the key and its passphrase file"
        raise ConfigError(
            f"--cache-remote-client-cert-file {cert.cert_file} (key {key}): not a PEM certificate with its "
            f"{what}: {exc}",
            fix=f"a PEM certificate chain and its own key; {fix}",
        ) from exc


def check_ca_file(address: StoreAddress, path: Path) -> None:
    """A CA file only for TLS, and one that loads as PEM certificates: a bad one is a startup
    error, not a store that fails every call."""
    if not address.tls:
        raise ConfigError(
            f"--cache-remote-ca-file is for TLS, but {address.where} is not rediss:// or valkeys://",
            fix="--cache-remote rediss://HOST:PORT, or leave --cache-remote-ca-file unset",
        )
    try:
        ssl.create_default_context(cafile=str(path))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"--cache-remote-ca-file {path}: not readable as PEM CA certificates: {exc}",
            fix="a PEM file of the CA certificates the store's certificate chains to",
        ) from exc


def make_client(
    address: StoreAddress,
    password: str | None,
    timeout_s: float,
    ca_file: Path | None = None,
    client_cert: ClientCert | None = None,
) -> aioredis.Redis:
    """The client: connect and socket timeouts at the tier's deadline, one retry at most,
    at most MAX_CONNECTIONS connections, bytes in and out. With TLS the store's certificate
    must chain to ``ca_file`` (None: the system's CAs) and name its host; ``client_cert`` is
    shown to a store that asks for one."""
    tls: dict[str, Any] = {}
    if address.tls:
        tls = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
        if ca_file is not None:
            tls["ssl_ca_certs"] = str(ca_file)
        if client_cert is not None:
            tls["ssl_certfile"] = str(client_cert.cert_file)
            tls["ssl_keyfile"] = str(client_cert.key_file or client_cert.cert_file)
            tls["ssl_password"] = client_cert.key_password
    client: aioredis.Redis = aioredis.Redis.from_url(
        address.url,
        password=password,
        **tls,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),  # once, for a connection the store closed; within the deadline
        retry_on_timeout=False,
        max_connections=MAX_CONNECTIONS,
        decode_responses=False,
    )
    return client
