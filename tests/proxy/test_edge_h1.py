"""HTTP/1.1 clients that stall or smuggle: each is cut within its setting and holds nothing afterwards."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time

import h11
import pytest
from edge_kit import Bench, bench, make_pki, rejected, status_of

from gatekeeper.certs.pki import PKI
from gatekeeper.proxy.listen import h1


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def until(predicate, limit: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(limit):
        while not predicate():  # noqa: ASYNC110 - state spread over the proxy's objects
            await asyncio.sleep(0.02)


async def test_content_length_with_transfer_encoding_is_a_400(pki: PKI) -> None:
    async with bench(pki) as b:
        before = rejected("length_and_chunked")
        raw = await b.raw(b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
                          b"transfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n")
        assert status_of(raw) == 400, raw[:200]
        assert b"Transfer-Encoding" in raw
        assert b.backend.paths() == []
        assert rejected("length_and_chunked") == before + 1


async def test_half_sent_request_head_is_cut_at_the_header_timeout(pki: PKI) -> None:
    """``GET / HTTP/1.1\\r\\n`` and silence: the connection closes at the header timeout, not the idle one."""
    async with bench(pki, protocol={"h1_header_timeout_seconds": 0.5, "idle_timeout_seconds": 60}) as b:
        before = rejected("header_timeout")
        reader, writer = await b.open()
        writer.write(b"GET /api/v1/pods HTTP/1.1\r\n")
        await writer.drain()
        started = time.monotonic()
        data = b"?"
        async with asyncio.timeout(5):
            # a slowloris trickles a header byte now and then; the deadline counts from the first byte
            try:
                for ch in b"x-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa: 1\r\n":
                    writer.write(bytes([ch]))
                    await writer.drain()
                    await asyncio.sleep(0.1)
                data = await reader.read()
            except ConnectionError:
                data = b""
        assert data == b""
        assert time.monotonic() - started < 2.0
        assert rejected("header_timeout") == before + 1
        await until(lambda: b.server.connections == 0)
        writer.close()


async def test_idle_request_body_fails_the_request_without_ejecting_the_backend(pki: PKI) -> None:
    async with bench(pki, protocol={"h1_body_idle_timeout_seconds": 0.5}) as b:
        before = rejected("body_timeout")
        reader, writer = await b.open()
        writer.write(b"PUT /api/v1/namespaces/a/configmaps/c HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n"
                     b"0123456789")
        await writer.drain()
        async with asyncio.timeout(5):
            data = await reader.read()
        assert status_of(data) == 400, data[:200]
        assert rejected("body_timeout") == before + 1
        be = b.pipeline.balancer.backends[0]
        assert be.ejections_total == 0 and be.in_flight == 0
        writer.close()


async def test_client_that_stops_reading_is_aborted_and_releases_the_backend(pki: PKI) -> None:
    async with bench(pki, protocol={"h1_write_stall_timeout_seconds": 0.5}) as b:
        before = rejected("response_stall")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", b.port))
        reader, writer = await asyncio.open_connection(sock=sock, ssl=b.client_ctx(),
                                                       server_hostname="localhost")
        writer.write(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        await reader.read(1000)  # the head arrived; now never read again
        reader._transport.pause_reading()  # type: ignore[attr-defined]
        be = b.pipeline.balancer.backends[0]
        await until(lambda: rejected("response_stall") == before + 1)
        await until(lambda: be.in_flight == 0 and b.server.connections == 0)
        assert b.pipeline.clients[be.name].connections() <= 1  # the pooled connection was closed or freed
        writer.close()


async def test_default_header_timeout_is_the_apiservers() -> None:
    from gatekeeper.proxy.settings import ProtocolSettings

    assert ProtocolSettings().h1_header_timeout_seconds == 32.0


SMUGGLED = b"GET /smuggled HTTP/1.1\r\nhost: x\r\nx-remote-user: system:admin\r\n\r\n"


async def one_response(b: Bench, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; the bytes of the first complete response (keep-alive or not)."""
    reader, writer = await b.open()
    writer.write(data)
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))  # only to expect a response
    client.send(h11.EndOfMessage())
    out = b""
    try:
        async with asyncio.timeout(10):
            while True:
                event = client.next_event()
                if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    return out
                if event is h11.NEED_DATA:
                    chunk = await reader.read(65536)
                    out += chunk
                    client.receive_data(chunk)
    finally:
        writer.close()


async def test_chunked_body_of_an_upgrade_request_reaches_the_backend_as_one_chunked_body(pki: PKI) -> None:
    """An upgrade request's chunked body is forwarded chunked: its bytes cannot become a second request.

    Before, the splice path dropped ``Transfer-Encoding`` (hop-by-hop) and wrote the decoded body raw,
    so a backend that refused the upgrade read the body as the next request, on the connection that
    carries the front-proxy certificate: any tenant could assert any identity (x-remote-user) and skip
    the target check and flow control.
    """
    async with bench(pki) as b:
        raw = await one_response(b, b"POST /api/v1/namespaces/a/pods HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\n"
                          b"connection: upgrade\r\ntransfer-encoding: chunked\r\n\r\n"
                          b"%x\r\n%b\r\n0\r\n\r\n" % (len(SMUGGLED), SMUGGLED))
        assert status_of(raw) == 200, raw[:200]
        assert b.backend.paths() == [b"/api/v1/namespaces/a/pods"]
        seen = b.backend.seen[-1]
        assert seen.body == SMUGGLED
        assert (b"transfer-encoding", b"chunked") in seen.headers


async def test_content_length_body_of_an_upgrade_request_keeps_its_length(pki: PKI) -> None:
    async with bench(pki) as b:
        raw = await one_response(b, b"POST /api/v1/namespaces/a/pods HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\n"
                          b"connection: upgrade\r\ncontent-length: %d\r\n\r\n%b" % (len(SMUGGLED), SMUGGLED))
        assert status_of(raw) == 200, raw[:200]
        assert b.backend.paths() == [b"/api/v1/namespaces/a/pods"]
        assert b.backend.seen[-1].body == SMUGGLED


@pytest.mark.parametrize(("head", "code"), [
    (b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd", 400),
    (b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: +3\r\n\r\nabc", 400),
    (b"POST /a HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked, identity\r\n\r\n0\r\n\r\n", 501),
    (b"POST /a HTTP/1.1\r\nhost: x\r\ntransfer-encoding: xchunked\r\n\r\n0\r\n\r\n", 501),
    (b"POST /a HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", 501),
    (b"GET /a HTTP/1.1\r\nhost: x\r\ntransfer-encoding : chunked\r\n\r\n", 400),
    (b"GET /a HTTP/1.1\r\nhost: x\rx-remote-user: admin\r\n\r\n", 400),
    (b"GET /a HTTP/1.1\r\nhost: x\r\nhost: y\r\n\r\n", 400),
    (b"GET /a HTTP/1.1\r\n\r\n", 400),
    (b"GET /a\r\n\r\n", 400),
], ids=["two-lengths", "signed-length", "chunked-identity", "xchunked", "two-encodings", "space-before-colon",
        "bare-cr", "two-hosts", "no-host", "http-0.9"])
async def test_ambiguous_framing_is_refused_before_any_backend_call(pki: PKI, head: bytes, code: int) -> None:
    """Heads two parsers could frame differently never reach a backend (h11's rules, locked in here)."""
    async with bench(pki) as b:
        before = rejected("h1_malformed")
        raw = await b.raw(head + b"GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n")
        assert status_of(raw) == code, raw[:200]
        assert b.backend.paths() == []
        assert rejected("h1_malformed") == before + 1


@pytest.mark.parametrize(("head", "body"), [
    (b"content-length: 3\r\ncontent-length: 3\r\n", b"abc"),
    (b"content-length: 003\r\n", b"abc"),
    (b"transfer-encoding: CHUNKED\r\n", b"3\r\nabc\r\n0\r\n\r\n"),
    (b"transfer-encoding:\r\n chunked\r\n", b"3\r\nabc\r\n0\r\n\r\n"),
    (b"transfer-encoding: chunked\r\n", b"3;ext=\"x\"\r\nabc\r\n0\r\n\r\n"),
    (b"transfer-encoding: chunked\r\n", b"3\r\nabc\r\n0\r\ntrailer: x\r\n\r\n"),
], ids=["same-length-twice", "leading-zeros", "upper-case", "obs-fold", "chunk-extension", "trailer"])
async def test_tolerated_framing_is_forwarded_reframed_as_one_request(pki: PKI, head: bytes, body: bytes) -> None:
    """What h11 tolerates is forwarded in the proxy's own framing: one request, the decoded body, and the
    bytes after it read as the client's next request (answered by the proxy, classified as any other)."""
    async with bench(pki) as b:
        raw = await b.raw(b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\nhost: x\r\n" + head + b"\r\n" + body +
                          b"GET /api/v1/namespaces/b/pods HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert raw.count(b"HTTP/1.1 200 ") == 2, raw[:300]
        assert b.backend.paths() == [b"/api/v1/namespaces/a/configmaps", b"/api/v1/namespaces/b/pods"]
        assert b.backend.seen[0].body == b"abc"


async def test_client_that_leaves_before_the_101_frees_the_backend_and_its_slot(pki: PKI) -> None:
    """An upgrade to a backend that does not answer, then the client leaves: nothing stays held."""
    async with bench(pki) as b:
        b.backend.slow_seconds = 3600
        _reader, writer = await b.open()
        writer.write(b"GET /slow/api/v1/namespaces/a/pods/p/portforward HTTP/1.1\r\nhost: x\r\n"
                     b"upgrade: websocket\r\nconnection: upgrade\r\n\r\n")
        await writer.drain()
        be = b.pipeline.balancer.backends[0]
        await until(lambda: be.in_flight == 1)
        writer.close()
        await until(lambda: be.in_flight == 0 and b.server.connections == 0)  # lease and client slot freed


@pytest.mark.parametrize("leave", ["fin", "rst"])
async def test_client_that_pipelines_past_the_read_ahead_then_leaves_frees_the_backend_and_its_slot(
        pki: PKI, monkeypatch: pytest.MonkeyPatch, leave: str) -> None:
    """An idle watch, 256 KiB of pipelined requests behind it, then the client goes (FIN, or RST as a killed
    client with unread bytes): the watch, its backend connection and the client slot are freed.

    Before, past the 64 KiB read-ahead nothing read the client any more, so neither was seen until the
    watch's next event (an RST was missed even without pipelining: the watcher's read raised).
    """
    monkeypatch.setattr(h1, "HANGUP_CHECK_SECONDS", 0.05)
    async with bench(pki) as b:
        reader, writer = await b.open()
        writer.write(b"GET /api/v1/pods?watch=1 HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(5):
            await reader.readuntil(b"ADDED")
        one = b"GET /api/v1/namespaces/a/pods HTTP/1.1\r\nhost: x\r\n\r\n"
        writer.write(one * (256 * 1024 // len(one)))
        be = b.pipeline.balancer.backends[0]
        async with asyncio.timeout(5):
            await writer.drain()
        await asyncio.sleep(0.3)  # the proxy read its 64 KiB ahead and stopped
        assert be.in_flight == 1
        sock = writer.transport.get_extra_info("socket")
        if leave == "rst":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            with socket.socket(fileno=os.dup(sock.fileno())) as dup:
                dup.shutdown(socket.SHUT_WR)
        writer.transport.abort()
        await until(lambda: be.in_flight == 0 and b.server.connections == 0)
        assert b.backend.paths() == [b"/api/v1/pods?watch=1"]  # nothing pipelined was sent on
