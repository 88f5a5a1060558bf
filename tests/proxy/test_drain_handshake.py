"""A drain lets connections already accepted finish their TLS handshake, then answers them or sends them away.

Before, ``ProxyServer.shutdown`` cancelled every handshake in progress: a client that connected just before a
SIGTERM (or before the supervisor ended a worker's hand-off) read a TLS EOF in the middle of its handshake,
which it cannot tell from a crash. Now HTTP/1.1 gets its request answered with ``Connection: close`` and h2 a
GOAWAY after our preface; only a handshake still unfinished when the drain ends is cut, and counted.
"""

from __future__ import annotations

import asyncio

import h2.events
import pytest

from gatekeeper.certs.pki import PKI
from gatekeeper.proxy.listen import conn_metrics
from gatekeeper.proxy.listen.server import ProxyServer
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import ListenerSettings, ProtocolSettings, ProxySettings
from gatekeeper.sandbox.testing import HalfHandshake


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    pki = PKI(tmp_path_factory.mktemp("pki"))
    pki.init()
    pki.issue_serving("proxy", dns=["localhost"], ips=["127.0.0.1"])
    return pki


def settings(pki: PKI, handshake_timeout: float = 10.0) -> ProxySettings:
    listener = ListenerSettings(address="127.0.0.1", port=0, cert_file=str(pki.cert_path("proxy")),
                                key_file=str(pki.key_path("proxy")), tls_handshake_timeout_seconds=handshake_timeout)
    return ProxySettings(listener=listener, protocol=ProtocolSettings())


async def ok(req: ProxyRequest) -> ProxyResponse:
    async def body():
        yield b"served"
    return ProxyResponse(200, [("content-type", "text/plain")], body())


def client(pki: PKI, server: ProxyServer, alpn: str) -> HalfHandshake:
    import ssl

    return HalfHandshake(server.port, ssl.create_default_context(cafile=str(pki.cert_path("ca"))), alpn=alpn,
                         timeout=10)


async def test_an_http11_handshake_begun_before_the_drain_is_answered_with_connection_close(pki: PKI) -> None:
    server = ProxyServer(settings(pki), ok, close_delay=0.05)
    await server.start()
    c = client(pki, server, "http/1.1")
    try:
        await asyncio.to_thread(c.begin)
        drain = asyncio.create_task(server.shutdown(drain_seconds=5))
        await asyncio.sleep(0.2)  # the drain has begun: before, the handshake was cancelled right here
        await asyncio.to_thread(c.finish)
        got = await asyncio.to_thread(c.exchange, b"GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n")
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), got
        assert b"connection: close" in head.lower() and b"served" in body, got
        await asyncio.wait_for(drain, 10)  # and the drain ends once it is answered, well before its deadline
    finally:
        c.close()


async def test_an_h2_handshake_begun_before_the_drain_gets_a_goaway_after_the_preface(pki: PKI) -> None:
    server = ProxyServer(settings(pki), ok, close_delay=0.05)
    await server.start()
    c = client(pki, server, "h2")
    try:
        await asyncio.to_thread(c.begin)
        drain = asyncio.create_task(server.shutdown(drain_seconds=5))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(c.finish)
        assert c.tls.selected_alpn_protocol() == "h2"
        events = await asyncio.to_thread(c.h2_events)
        assert any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events), events  # our preface first
        ended = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
        assert ended and ended[0].error_code == 0, events  # a graceful GOAWAY, NO_ERROR
        await asyncio.wait_for(drain, 10)
    finally:
        c.close()


async def test_a_handshake_still_unfinished_when_the_drain_ends_is_cut_and_counted(pki: PKI) -> None:
    server = ProxyServer(settings(pki, handshake_timeout=30), ok, close_delay=0.05)
    await server.start()
    cut = conn_metrics.DRAIN_CUT.labels(stage="handshake")
    before = cut._value.get()
    c = client(pki, server, "http/1.1")
    try:
        await asyncio.to_thread(c.begin)
        await asyncio.wait_for(server.shutdown(drain_seconds=0.2), 10)  # the client never finishes
        assert cut._value.get() == before + 1
    finally:
        c.close()
