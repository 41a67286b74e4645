"""The remote store's address and TLS settings (proxy/server/tiers/remote_store.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from proxy.errors import ConfigError
from proxy.server.tiers.remote_store import (
    ClientCert,
    check_ca_file,
    check_client_cert,
    make_client,
    parse_store_url,
    read_passphrase,
)


@pytest.mark.parametrize(
    ("url", "redis_url", "tls"),
    [
        ("valkey://cache:6380/2", "redis://cache:6380/2", False),
        ("valkeys://cache", "rediss://cache:6379/0", True),
        ("rediss://user@10.0.0.5:7000", "rediss://user@10.0.0.5:7000/0", True),
        ("redis://[::1]:6379/1", "redis://[::1]:6379/1", False),
    ],
)
def test_store_urls_are_rewritten_for_redis_py(url: str, redis_url: str, tls: bool) -> None:
    address = parse_store_url(url)
    assert (address.url, address.tls) == (redis_url, tls)


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("http://cache:6379", "not a valkey://"),
        ("valkey://:secret@cache", "password in the URL"),
        ("valkey://cache/x", "must be a number"),
    ],
)
def test_bad_store_urls_are_config_errors(url: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_store_url(url)


def test_a_ca_file_needs_tls_and_must_load(tmp_path: Path) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="is for TLS"):
        check_ca_file(parse_store_url("valkey://cache"), bad)
    with pytest.raises(ConfigError, match="not readable as PEM"):
        check_ca_file(parse_store_url("rediss://cache"), bad)
    with pytest.raises(ConfigError, match="not readable as PEM"):
        check_ca_file(parse_store_url("rediss://cache"), tmp_path / "missing.pem")


def test_the_client_verifies_the_certificate_and_the_host_name(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    client = make_client(parse_store_url("rediss://cache"), None, 1.0, ca)
    kw = client.connection_pool.connection_kwargs
    assert (kw["ssl_cert_reqs"], kw["ssl_check_hostname"], kw["ssl_ca_certs"]) == ("required", True, str(ca))
    plain = make_client(parse_store_url("valkey://cache"), None, 1.0).connection_pool.connection_kwargs
    assert not any(k.startswith("ssl_") for k in plain)


def _key_and_cert(d: Path, name: str, *extra: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", f"/CN={name}", *extra],
        check=True, capture_output=True,
    )  # fmt: skip
    os.chmod(key, 0o600)
    return key, cert


def test_a_client_certificate_needs_tls_a_private_key_of_ours_and_its_own_key(tmp_path: Path) -> None:
    key, cert = _key_and_cert(tmp_path, "proxy", "-nodes")
    tls = parse_store_url("rediss://cache")
    check_client_cert(tls, ClientCert(cert, key))
    with pytest.raises(ConfigError, match="is for TLS"):
        check_client_cert(parse_store_url("valkey://cache"), ClientCert(cert, key))
    os.chmod(key, 0o644)
    with pytest.raises(ConfigError, match="mode 600"):
        check_client_cert(tls, ClientCert(cert, key))
    with pytest.raises(ConfigError, match="mode 600"):  # the key in the certificate's file
        check_client_cert(tls, ClientCert(cert))
    os.chmod(key, 0o600)
    other, _ = _key_and_cert(tmp_path, "other", "-nodes")
    with pytest.raises(ConfigError, match="unencrypted private key"):  # not this certificate's key
        check_client_cert(tls, ClientCert(cert, other))
    locked, locked_cert = _key_and_cert(tmp_path, "locked", "-passout", "pass:secret")
    with pytest.raises(ConfigError, match="unencrypted private key"):  # never a passphrase prompt
        check_client_cert(tls, ClientCert(locked_cert, locked))
    check_client_cert(
        tls, ClientCert(locked_cert, locked, "secret")
    )  # --cache-remote-client-key-password-file
    with pytest.raises(ConfigError, match="opened by the passphrase given"):
        check_client_cert(tls, ClientCert(locked_cert, locked, "wrong"))
    assert "secret" not in repr(ClientCert(locked_cert, locked, "secret"))  # kept out of logs
    with pytest.raises(ConfigError, match="opened by the passphrase given"):  # longer than OpenSSL takes
        check_client_cert(tls, ClientCert(locked_cert, locked, "x" * 2000))
    locked_client = make_client(tls, None, 1.0, None, ClientCert(locked_cert, locked, "secret"))
    assert locked_client.connection_pool.connection_kwargs["ssl_password"] == "secret"
    client = make_client(tls, None, 1.0, None, ClientCert(cert, key))
    kw = client.connection_pool.connection_kwargs
    assert (kw["ssl_certfile"], kw["ssl_keyfile"]) == (str(cert), str(key))


def test_a_passphrase_is_its_file_s_first_line_as_written(tmp_path: Path) -> None:
    """As openssl -passout file: writes and reads it: spaces kept, the line's end dropped."""
    path = tmp_path / "passphrase"
    path.write_bytes(b" two words \r\nignored\n")
    path.chmod(0o600)
    assert read_passphrase(path) == " two words "
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 600"):
        read_passphrase(path)
