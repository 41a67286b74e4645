"""The remote store's address and TLS settings (proxy/server/tiers/remote_store.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.errors import ConfigError
from proxy.server.tiers.remote_store import check_ca_file, make_client, parse_store_url


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
