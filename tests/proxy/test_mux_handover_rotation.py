"""A certificate rotation around a connection the HTTP/2 pool hands to the HTTP/1.1 pool (``lean.Pool.adopt``).

The HTTP/2 pool offers ``h2`` and ``http/1.1``; a backend that picks HTTP/1.1
has its connection kept by the HTTP/1.1 pool under the HTTP/1.1 context of the
same kind. The two contexts used to reload separately, each on its own check
schedule, so right after a rotation a connection made with the previous
front-proxy certificate could be kept under a context of the new one, and
carry requests as if it were current.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from edge_kit import make_pki
from test_lean_upstream import RawBackend
from test_mux_upstream import fetch, interval_passes

from gatekeeper.certs.pki import FRONT_PROXY_CA, PKI
from gatekeeper.proxy.settings import UpstreamSettings
from gatekeeper.proxy.upstream.client import BackendClient, make_ssl_context
from gatekeeper.proxy.upstream.lean import Pool


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    pki.issue_client("front-proxy-client-2", user="front-proxy-client-2", ca=FRONT_PROXY_CA)
    return pki


def common_name(peercert: object) -> str:
    assert isinstance(peercert, dict)
    return next(value for rdn in peercert["subject"] for key, value in rdn if key == "commonName")


def install(pki: PKI, name: str, cert: Path, key: Path) -> None:
    """Rotate in place, as cert-manager or kubeadm do; the mtimes move on even within one clock tick."""
    for source, target in ((pki.cert_path(name), cert), (pki.key_path(name), key)):
        stamp = target.stat().st_mtime_ns + 1_000_000 if target.exists() else None
        shutil.copyfile(source, target)
        if stamp is not None:
            os.utime(target, ns=(stamp, stamp))


async def test_a_connection_handed_over_after_a_rotation_presents_the_new_certificate(
        pki: PKI, tmp_path: Path) -> None:
    cert, key = tmp_path / "front-proxy.crt", tmp_path / "front-proxy.key"
    install(pki, "front-proxy-client", cert, key)
    raw = RawBackend(pki, alpn=["http/1.1"])
    url = await raw.start()
    client = BackendClient("rotating", url, UpstreamSettings(
        ca_file=str(pki.cert_path("ca")), client_cert_file=str(cert), client_key_file=str(key)))
    try:
        assert await fetch(client, "/before", identity=True) == b"ok"  # handed over, previous certificate
        install(pki, "front-proxy-client-2", cert, key)
        assert client.tls_identity is not None
        assert client.tls_identity.maybe_reload()  # the HTTP/1.1 side's check comes due first
        interval_passes(client)  # this request asks for HTTP/2 again: a new connection, handed over
        assert await fetch(client, "/after", identity=True) == b"ok"
        assert [common_name(c) for c in raw.peer_certs] == ["front-proxy-client", "front-proxy-client-2"]
    finally:
        await client.close()
        await raw.stop()


async def test_a_connection_offered_under_a_context_a_reload_replaced_is_closed(pki: PKI) -> None:
    """A reload that came while the HTTP/2 pool was connecting: the connection is stale before it is kept."""
    raw = RawBackend(pki, alpn=["http/1.1"])
    url = await raw.start()
    settings = UpstreamSettings(ca_file=str(pki.cert_path("ca")))
    stale, current = (make_ssl_context(settings, client_cert=False) for _ in range(2))
    port = int(url.rsplit(":", 1)[1])
    pool = Pool("127.0.0.1", port, limit=4, connect_timeout=5)
    try:
        transport, _ = await asyncio.get_running_loop().create_connection(
            asyncio.Protocol, "127.0.0.1", port, ssl=stale, server_hostname="127.0.0.1")
        pool.adopt(transport, stale, lambda: (None, current))
        assert transport.is_closing()
        assert pool.open == 0 and pool.idle.get(stale) is None
        assert pool.take_idle(current, lambda: (None, current)) is None
    finally:
        pool.close()
        await raw.stop()
