"""Listener limits over real sockets on 127.0.0.1: connection cap, TLS handshake timeout, a client that never reads.

An in-process ``ProxyServer`` with a trivial handler (no backend is involved in
these attacks); blocking client sockets run in threads so the server's event
loop keeps running.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import AsyncIterator

import pytest
from edge_kit import rejected
from h2.events import StreamEnded
from h2_raw import RawH2, tls_context
from hyperframe.frame import PingFrame

from gatekeeper.certs.pki import PKI
from gatekeeper.proxy.listen.server import ProxyServer
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import ListenerSettings, ProtocolSettings, ProxySettings
from gatekeeper.sandbox.testing import is_cut


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    pki = PKI(tmp_path_factory.mktemp("pki"))
    pki.init()
    pki.issue_serving("proxy", dns=["localhost"], ips=["127.0.0.1"])
    return pki


async def _ok(req: ProxyRequest) -> ProxyResponse:
    async def body() -> AsyncIterator[bytes]:
        yield b"ok"
    return ProxyResponse(200, [], body())


def _server(pki: PKI, listener: dict[str, object] | None = None, **protocol: object) -> ProxyServer:
    lst = ListenerSettings(address="127.0.0.1", port=0, cert_file=str(pki.cert_path("proxy")),
                           key_file=str(pki.key_path("proxy")), **listener or {})  # type: ignore[arg-type]
    settings = ProxySettings(listener=lst, protocol=ProtocolSettings(**protocol))  # type: ignore[arg-type]
    return ProxyServer(settings, _ok, close_delay=0.1)


def _get(port: int, ca: str) -> int | None:
    client = RawH2(port, ca=ca)
    try:
        sid = client.request("/version")
        client.read_until(lambda ev: any(isinstance(e, StreamEnded) and e.stream_id == sid for e in ev), 10)
        return sid if not client.closed else None
    finally:
        client.close()


async def test_connections_over_the_cap_are_closed_and_counted(pki: PKI) -> None:
    server = _server(pki, {"max_client_connections": 2})
    port = await server.start()
    ca = str(pki.cert_path("ca"))
    before = rejected("connection_cap")
    try:
        held = [await asyncio.to_thread(RawH2, port, ca=ca) for _ in range(2)]
        raw = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 5)
        assert await asyncio.to_thread(is_cut, raw, 5), "a connection over the cap must be closed at accept"
        raw.close()
        assert rejected("connection_cap") == before + 1
        for c in held:
            c.close()
        # Seats come back once clients leave.
        async with asyncio.timeout(10):
            while server.connections or server._open:  # noqa: ASYNC110 - counters, no event to wait on
                await asyncio.sleep(0.01)
        assert await asyncio.to_thread(_get, port, ca) is not None
    finally:
        await server.shutdown(1)


async def test_silent_client_is_cut_at_the_tls_handshake_timeout(pki: PKI) -> None:
    server = _server(pki, {"tls_handshake_timeout_seconds": 0.5})
    port = await server.start()
    before = rejected("handshake_timeout")
    try:
        raw = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 5)
        start = time.monotonic()
        assert await asyncio.to_thread(is_cut, raw, 5)
        assert time.monotonic() - start < 3
        raw.close()
        async with asyncio.timeout(5):
            while rejected("handshake_timeout") < before + 1:  # noqa: ASYNC110 - a counter, no event
                await asyncio.sleep(0.01)
    finally:
        await server.shutdown(1)


def _flood_pings_without_reading(port: int, seconds: float) -> tuple[bool, int]:
    """Send PINGs and never read the ACKs; (cut by the server, bytes we got to send)."""
    ctx = tls_context()
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock = ctx.wrap_socket(raw, server_hostname="localhost")
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    chunk = b"".join(PingFrame(0, opaque_data=i.to_bytes(8, "big")).serialize() for i in range(1000))
    sent = 0
    deadline = time.monotonic() + seconds
    sock.settimeout(0.5)
    try:
        while time.monotonic() < deadline:
            try:
                sock.sendall(chunk)
                sent += len(chunk)
            except TimeoutError:
                continue  # the server stopped reading us: keep trying until it cuts us
    except (ConnectionError, ssl.SSLError, OSError):
        return True, sent
    finally:
        sock.close()
    return False, sent


async def test_never_reading_flooder_is_paused_then_cut_with_bounded_output(pki: PKI) -> None:
    """PINGs under no rate limit: reading stops at the high-water mark, the write stall cuts the client."""
    server = _server(pki, h2_max_pings_per_interval=10**9, response_stall_timeout_seconds=1.0,
                     write_buffer_high_bytes=65536, write_buffer_low_bytes=16384)
    port = await server.start()
    before = rejected("write_stall")

    try:
        cut, sent = await asyncio.to_thread(_flood_pings_without_reading, port, 20)
        assert cut, "a client that never reads must be cut after responseStallTimeoutSeconds"
        assert rejected("write_stall") >= before + 1
        # Every 17-byte PING we read costs a 17-byte ACK we cannot send: what we read is bounded
        # by the high-water mark (plus one read), so the client could not push much either.
        print(f"flooder pushed {sent} bytes before the cut")
        assert sent < 32 * 1024 * 1024, f"the server kept reading: {sent} bytes of PINGs accepted"
    finally:
        await server.shutdown(1)


@pytest.mark.parametrize("bad", [
    {"tls_handshake_timeout_seconds": 0}, {"max_client_connections": 0},
])
def test_limit_settings_that_disable_a_defence_are_refused(pki: PKI, bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        _server(pki, bad)


@pytest.mark.parametrize("cap", [0.2, -1.0])
def test_a_handshake_cap_under_the_handshake_timeout_is_refused_naming_the_key(pki: PKI, cap: float) -> None:
    with pytest.raises(ValueError, match="tlsHandshakeMaxSeconds must be 0"):
        _server(pki, {"tls_handshake_timeout_seconds": 0.5, "tls_handshake_max_seconds": cap})


@pytest.mark.parametrize("bad", [
    {"response_stall_timeout_seconds": 0}, {"h2_max_resets_per_interval": 0},
    {"write_buffer_low_bytes": 1 << 20}, {"h1_upgrade_idle_timeout_seconds": 0}, {"h1_max_header_fields": 0},
])
def test_protocol_limits_that_disable_a_defence_are_refused(pki: PKI, bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be"):
        _server(pki, **bad)


def test_a_zero_upgrade_idle_timeout_is_refused_naming_the_key() -> None:
    from gatekeeper.proxy.settings import ProtocolSettings

    with pytest.raises(ValueError, match="h1UpgradeIdleTimeoutSeconds must be a positive number of seconds"):
        ProtocolSettings(h1_upgrade_idle_timeout_seconds=0).validate()
