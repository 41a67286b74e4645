"""The remote tier over TLS (``rediss://``, ``--cache-remote-ca-file``) on a real Valkey (or
Redis) with a certificate of a CA made here (openssl), and two proxies, each in front of its
own patched llama-server with the default model.

With the CA file, a prompt computed behind proxy 1 is written to the store over TLS and
restored behind proxy 2 (route H) with the answer a full prefill gives. Without it the store's
certificate does not verify against the system's CAs: every request is still answered right
(prefill), the failures are counted, and nothing reaches the store. A certificate for another
host name fails the same way even with the CA file.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.native.launch import ServerProcess, free_port
from proxy.native.store import store_binary
from proxy.server.ops.admin import tiers as tiers_of
from tests.helpers import ProxyThread, ServerFactory, assert_same_answer, proxy_config
from tests.integration.test_proxy import convo, document
from tests.integration.test_remote_tier import CHUNK, Store, ask, reference

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(store_binary() is None, reason="no valkey-server or redis-server (make valkey)"),
]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path, name: str, san: str) -> Path:
    """A CA (ca.pem) once, and a certificate ``name``.pem / ``name``.key it signed for ``san``."""
    if not (d / "ca.pem").exists():
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
                 "-days", "2", "-subj", "/CN=radix test CA", cwd=d)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=d)  # fmt: skip
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return d / f"{name}.pem"


class TlsStore(Store):
    """The store on a plain loopback port (the tests' own client and the readiness ping) and a
    TLS port with the certificate ``cert``; with ``auth_clients`` TLS clients must show a
    certificate of the same CA (tls-auth-clients yes)."""

    def __init__(self, directory: Path, cert: Path, auth_clients: bool = False) -> None:
        super().__init__(directory)
        self.cert = cert
        self.auth_clients = auth_clients
        self.tls_port = free_port()

    @property
    def tls_url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0"

    def argv(self) -> list[str]:
        tls = ["--tls-port", str(self.tls_port), "--tls-cert-file", str(self.cert)]
        tls += ["--tls-key-file", str(self.cert.with_suffix(".key"))]
        tls += ["--tls-auth-clients", "yes" if self.auth_clients else "no"]
        tls += ["--tls-ca-cert-file", str(self.cert.parent / "ca.pem")]
        return super().argv() + tls


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="radix-tls-") as tmp:
        os.chmod(tmp, 0o700)
        yield Path(tmp)


@pytest.fixture(scope="module")
def servers(start_server: ServerFactory, patched_bin: Path) -> list[ServerProcess]:
    return [start_server(patched_bin, n_parallel=2) for _ in range(2)]


def _proxy(
    server: ServerProcess,
    url: str,
    workdir: Path,
    ca: Path | None,
    client: Path | None = None,
    passphrase: Path | None = None,
) -> ProxyThread:
    """A proxy on the tier at ``url``; ``client`` names a certificate whose key is beside it
    (``.key``; ``.enc.key`` when ``passphrase`` names the file of its passphrase)."""
    key = client.with_suffix(".enc.key" if passphrase else ".key") if client else None
    over = {
        "cache_remote": url,
        "cache_remote_key_file": workdir / "remote.key",
        "cache_remote_ca_file": ca,
        "cache_remote_client_cert_file": client,
        "cache_remote_client_key_file": key,
        "cache_remote_client_key_password_file": passphrase,
        "cache_remote_timeout_s": 2.0,
        "cache_remote_backoff_s": 0.5,
        "kv_arena_chunk": CHUNK,
    }
    return ProxyThread(proxy_config(server, **over)).start()


def _remote(proxy: ProxyThread) -> dict[str, object]:
    return dict(proxy.call(lambda rt: tiers_of(rt)["remote"]))


def test_the_tier_over_tls_with_a_ca_file_is_shared(
    servers: list[ServerProcess], stock_server: ServerProcess, workdir: Path
) -> None:
    certs = workdir / "certs"
    certs.mkdir()
    store = TlsStore(workdir / "store", make_certs(certs, "store", "IP:127.0.0.1"))
    store.start()
    proxies = [_proxy(s, store.tls_url, workdir, certs / "ca.pem") for s in servers]
    try:
        messages = convo(document(61, 160), "What is the first word?")
        first = ask(proxies[0], messages)
        assert first.headers["X-Radix-Route"] == "prefill"
        assert store.client().dbsize() > 0  # written over TLS
        second = ask(proxies[1], messages)
        assert second.headers["X-Radix-Route"] == "H", second.headers
        assert int(second.headers["X-Radix-Cached-Tokens"]) >= CHUNK
        assert_same_answer(second, reference(stock_server, messages))
    finally:
        for p in proxies:
            p.stop()
        store.stop()


@pytest.mark.parametrize("case", ["no-ca-file", "wrong-host"])
def test_a_store_whose_certificate_does_not_verify_is_not_used(
    servers: list[ServerProcess], stock_server: ServerProcess, workdir: Path, case: str
) -> None:
    certs = workdir / f"certs-{case}"
    certs.mkdir()
    san = "DNS:cache.example.org" if case == "wrong-host" else "IP:127.0.0.1"
    store = TlsStore(workdir / f"store-{case}", make_certs(certs, "store", san))
    store.start()
    ca = certs / "ca.pem" if case == "wrong-host" else None
    proxy = _proxy(servers[0], store.tls_url, workdir, ca)
    try:
        for i in range(2):
            messages = convo(document(70 + i, 160), "What is the first word?")
            reply = ask(proxy, messages)
            assert reply.headers["X-Radix-Route"] == "prefill"
            assert_same_answer(reply, reference(stock_server, messages))
        assert store.client().dbsize() == 0  # nothing reached the store
        remote = _remote(proxy)
        assert remote["writes"] == 0 and remote["promotions"] == 0, remote
        assert remote["fallbacks"] or remote["write_dropped"], remote  # the failures are counted
    finally:
        proxy.stop()
        store.stop()


def test_a_store_that_asks_for_client_certificates_is_shared_by_proxies_that_show_one(
    servers: list[ServerProcess], stock_server: ServerProcess, workdir: Path
) -> None:
    """tls-auth-clients yes: proxies with a certificate of the store's CA share the tier (route
    H behind the second, whose key is encrypted, opened by its passphrase file); a proxy without
    one gets nothing from the store and answers right."""
    certs = workdir / "certs-mtls"
    certs.mkdir()
    store = TlsStore(workdir / "store-mtls", make_certs(certs, "store", "IP:127.0.0.1"), auth_clients=True)
    client = make_certs(certs, "proxy", "DNS:proxy.internal")
    os.chmod(client.with_suffix(".key"), 0o600)
    passphrase = certs / "proxy.passphrase"
    passphrase.write_text("correct horse\n")
    os.chmod(passphrase, 0o600)
    _openssl(
        "pkey",
        "-in",
        "proxy.key",
        "-out",
        "proxy.enc.key",
        "-aes256",
        "-passout",
        "file:proxy.passphrase",
        cwd=certs,
    )
    os.chmod(certs / "proxy.enc.key", 0o600)
    assert b"ENCRYPTED" in (certs / "proxy.enc.key").read_bytes()
    store.start()
    proxies = [
        _proxy(servers[0], store.tls_url, workdir, certs / "ca.pem", client),
        _proxy(servers[1], store.tls_url, workdir, certs / "ca.pem", client, passphrase),
    ]
    try:
        messages = convo(document(81, 160), "What is the first word?")
        first = ask(proxies[0], messages)
        assert first.headers["X-Radix-Route"] == "prefill"
        assert store.client().dbsize() > 0  # written over TLS with the client's certificate
        second = ask(proxies[1], messages)
        assert second.headers["X-Radix-Route"] == "H", second.headers
        assert_same_answer(second, reference(stock_server, messages))
    finally:
        for p in proxies:
            p.stop()
    anonymous = _proxy(servers[0], store.tls_url, workdir, certs / "ca.pem")
    try:
        keys = store.client().dbsize()
        messages = convo(document(82, 160), "What is the first word?")
        reply = ask(anonymous, messages)
        assert reply.headers["X-Radix-Route"] == "prefill"
        assert_same_answer(reply, reference(stock_server, messages))
        assert store.client().dbsize() == keys  # the store refused the connection
        remote = _remote(anonymous)
        assert remote["writes"] == 0 and remote["promotions"] == 0, remote
        assert remote["fallbacks"] or remote["write_dropped"], remote
    finally:
        anonymous.stop()
        store.stop()
