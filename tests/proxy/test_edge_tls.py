"""Certificate rotation with real files rewritten on disk: the listener's serving certificate and
client CA, the upstream CA and the front-proxy client certificate. New connections use the new
material; connections already open keep working."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import ssl
from pathlib import Path

from edge_kit import EchoBackend, make_pki, proxy_settings, status_of

from gatekeeper.certs.pki import FRONT_PROXY_CA, PKI, load_cert
from gatekeeper.proxy.listen.server import ProxyServer
from gatekeeper.proxy.messages import ProxyRequest
from gatekeeper.proxy.pipeline.stages import build

ADMIN = {"subject": ((("organizationName", "system:masters"),), (("commonName", "admin"),))}


def copy(src: Path, dst: Path) -> str:
    """Replace ``dst`` atomically, as kubelet/cert-manager do (write aside, rename over)."""
    tmp = dst.with_suffix(".tmp")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)
    return str(dst)


async def get(port: int, ctx: ssl.SSLContext) -> tuple[int, int]:
    """(status, serial of the proxy's certificate) of one HTTP/1.1 request on a new connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")
    try:
        serial = int(writer.get_extra_info("peercert")["serialNumber"], 16)
        writer.write(b"GET /api/v1/pods HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        return status_of(await reader.read()), serial
    finally:
        writer.close()


async def test_listener_certificate_and_client_ca_rotate_without_cutting_open_connections(tmp_path: Path) -> None:
    old = make_pki(tmp_path / "old")
    new = make_pki(tmp_path / "new")  # another cluster CA: new serving cert, new client CA
    live = tmp_path / "live"
    live.mkdir()
    cert, key, client_ca = live / "tls.crt", live / "tls.key", live / "client-ca.crt"
    copy(old.cert_path("proxy"), cert)
    copy(old.key_path("proxy"), key)
    copy(old.cert_path("ca"), client_ca)
    backend = EchoBackend(old)
    url = await backend.start()
    settings = proxy_settings(old, [url])
    settings = dataclasses.replace(settings, listener=dataclasses.replace(
        settings.listener, cert_file=str(cert), key_file=str(key), client_ca_file=str(client_ca)))
    pipeline = build(settings)
    server = ProxyServer(settings, pipeline.handler, close_delay=0.05)
    port = await server.start()

    def client(pki: PKI, trust: PKI) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(trust.cert_path("ca")))
        ctx.set_alpn_protocols(["http/1.1"])
        ctx.load_cert_chain(str(pki.cert_path("admin")), str(pki.key_path("admin")))
        return ctx

    try:
        status, serial = await get(port, client(old, old))
        assert status == 200 and serial == load_cert(old.cert_path("proxy")).serial_number
        # an open keep-alive connection from before the rotation
        r, w = await asyncio.open_connection("127.0.0.1", port, ssl=client(old, old), server_hostname="localhost")
        w.write(b"GET /api/v1/pods HTTP/1.1\r\nhost: x\r\n\r\n")
        await r.readuntil(b"\r\n\r\n")

        copy(new.cert_path("proxy"), cert)
        copy(new.key_path("proxy"), key)
        copy(new.cert_path("ca"), client_ca)

        status, serial = await get(port, client(new, new))
        assert status == 200, "a client certificate from the new client CA was not accepted"
        assert serial == load_cert(new.cert_path("proxy")).serial_number, "still serving the old certificate"
        try:  # the old CA is no longer trusted for client certificates (TLS 1.3: fails on first read)
            refused, _ = await get(port, client(old, new))
        except (ssl.SSLError, ConnectionError):
            refused = 0
        assert refused == 0, "a client certificate from the retired client CA was still accepted"
        # the connection opened before the rotation still serves requests
        w.write(b"GET /api/v1/pods HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        rest = await r.read()
        assert rest.count(b"HTTP/1.1 200") == 1
        w.close()
    finally:
        await server.shutdown(drain_seconds=0.5)
        await pipeline.close()
        await backend.stop()


async def test_upstream_ca_and_front_proxy_certificate_rotate_for_new_connections(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    other = make_pki(tmp_path / "other")  # the backends' new CA and the new front-proxy CA
    live = tmp_path / "live"
    live.mkdir()
    ca, fp_cert, fp_key = live / "ca.crt", live / "fp.crt", live / "fp.key"
    copy(pki.cert_path("ca"), ca)
    copy(pki.cert_path("front-proxy-client"), fp_cert)
    copy(pki.key_path("front-proxy-client"), fp_key)
    backend = EchoBackend(pki, front_proxy_ca=tmp_path / "fp-bundle.crt")
    (tmp_path / "fp-bundle.crt").write_bytes(pki.cert_path(FRONT_PROXY_CA).read_bytes()
                                             + other.cert_path(FRONT_PROXY_CA).read_bytes())
    url = await backend.start()
    settings = proxy_settings(pki, [url])
    settings = dataclasses.replace(settings, upstream=dataclasses.replace(
        settings.upstream, ca_file=str(ca), client_cert_file=str(fp_cert), client_key_file=str(fp_key)))
    pipeline = build(settings)

    async def call() -> int:
        resp = await pipeline.handler(ProxyRequest(method="GET", target="/api/v1/pods", headers=[], body=None,
                                                   protocol="h2", peer="127.0.0.1:1", peer_cert=ADMIN))
        async for _ in resp.body:
            pass
        resp.finish(None)
        return resp.status

    try:
        assert await call() == 200
        old_serial = load_cert(pki.cert_path("front-proxy-client")).serial_number
        # One connection, or two (an h2 attempt, then HTTP/1.1 for a backend without h2).
        assert set(backend.client_serials) == {old_serial}

        copy(other.cert_path("front-proxy-client"), fp_cert)
        copy(other.key_path("front-proxy-client"), fp_key)
        assert await call() == 200
        assert backend.client_serials[-1] == load_cert(other.cert_path("front-proxy-client")).serial_number

        # The upstream CA: trust only the other CA now, and the backend (old CA) no longer verifies.
        copy(other.cert_path("ca"), ca)
        assert await call() == 503
    finally:
        await pipeline.close()
        await backend.stop()
