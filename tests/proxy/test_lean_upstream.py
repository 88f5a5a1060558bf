"""The HTTP/1.1 upstream client against an in-process TLS backend that writes raw bytes.

The backend here is scripted byte by byte, so framing edge cases (chunked,
Content-Length, read-until-close, a cut body, a second response, an oversized
head) are exact. The same client is proven against real kube-apiservers by the
sandbox tests in this folder (it is the default).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import pytest

from gatekeeper.certs.pki import FRONT_PROXY_CA, PKI
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import UpstreamSettings
from gatekeeper.proxy.upstream import lean
from gatekeeper.proxy.upstream.client import (
    BackendClient,
    BackendFailed,
    ClientBodyFailed,
    PoolTimeout,
    UpstreamTimeout,
)

Reply = Callable[[asyncio.StreamWriter, bytes, bytes], Awaitable[bool]]
"""Write a response for (head, body); return whether to keep the connection for another request."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    pki = PKI(tmp_path_factory.mktemp("pki"))
    pki.init()
    pki.issue_serving("backend", ips=["127.0.0.1"])
    pki.issue_client("front-proxy-client", user="front-proxy-client", ca=FRONT_PROXY_CA)
    return pki


def text(status: int = 200, body: bytes = b"ok", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n%b\r\n%b" % (status, len(body), extra, body)


class RawBackend:
    """Reads HTTP/1.1 requests (Content-Length or chunked bodies) and answers through ``reply``."""

    def __init__(self, pki: PKI, *, alpn: list[str] | None = None) -> None:
        self.pki = pki
        self.alpn = alpn
        """Protocols the server accepts in ALPN (None: it takes no part in ALPN)."""
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.peer_certs: list[object] = []
        self.reply: Reply = self.ok
        self.server: asyncio.Server | None = None

    @staticmethod
    async def ok(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        writer.write(text())
        return True

    async def start(self) -> str:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.pki.cert_path("backend"), self.pki.key_path("backend"))
        ctx.load_verify_locations(self.pki.cert_path(FRONT_PROXY_CA))
        ctx.verify_mode = ssl.CERT_OPTIONAL
        if self.alpn is not None:
            ctx.set_alpn_protocols(self.alpn)
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0, ssl=ctx)
        return f"https://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.peer_certs.append(writer.get_extra_info("peercert"))
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lower = head.lower()
                body = b""
                if b"transfer-encoding: chunked" in lower:
                    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                        body += await reader.readexactly(size)
                        await reader.readexactly(2)
                    await reader.readexactly(2)
                elif b"content-length: " in lower:
                    length = int(lower.split(b"content-length: ")[1].split(b"\r\n")[0])
                    body = await reader.readexactly(length)
                self.requests.append((head, body))
                keep = await self.reply(writer, head, body)
                await writer.drain()
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.fixture
async def backend(pki: PKI) -> AsyncIterator[tuple[RawBackend, BackendClient]]:
    be = RawBackend(pki)
    url = await be.start()
    client = BackendClient("backend-0", url, UpstreamSettings(
        ca_file=str(pki.cert_path("ca")), client_cert_file=str(pki.cert_path("front-proxy-client")),
        client_key_file=str(pki.key_path("front-proxy-client")), connect_timeout_seconds=2.0))
    yield be, client
    await client.close()
    await be.stop()


class Done:
    def __init__(self) -> None:
        self.calls: list[BaseException | None] = []

    def __call__(self, error: BaseException | None) -> None:
        self.calls.append(error)


def req(method: str, target: str, body: AsyncIterator[bytes] | None = None,
        headers: list[tuple[str, str]] | None = None) -> ProxyRequest:
    return ProxyRequest(method=method, target=target, headers=headers or [], body=body, protocol="h2")


async def send(client: BackendClient, request: ProxyRequest, *, watch: bool = False,
               done: Done | None = None, long_running: bool = False) -> ProxyResponse:
    return await client.send(request, request.headers, identity=False, swallow_body_errors=watch,
                             on_done=done or Done(), long_running=long_running)


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110 - connection state, no event to wait on
            await asyncio.sleep(0.01)


async def read_all(resp: ProxyResponse) -> bytes:
    return b"".join([c async for c in resp.body])


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def test_chunked_and_content_length_bodies_arrive_whole_and_the_connection_is_reused(backend) -> None:
    be, client = backend

    async def reply(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        if head.startswith(b"GET /chunked"):
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-a: 1\r\n\r\n"
                         b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        else:
            writer.write(text(body=b"x" * 100_000))
        return True

    be.reply = reply
    done = Done()
    resp = await send(client, req("GET", "/chunked"), done=done)
    assert resp.status == 200 and ("x-a", "1") in resp.headers
    assert "transfer-encoding" not in dict(resp.headers)
    assert await read_all(resp) == b"hello world"
    assert done.calls == [None]
    resp = await send(client, req("GET", "/length"))
    assert dict(resp.headers)["content-length"] == "100000"
    assert await read_all(resp) == b"x" * 100_000
    assert be.connections == 1 and len(be.requests) == 2
    assert client.connections() == 1


async def test_a_body_cut_mid_stream_is_an_error_for_a_list_and_a_clean_end_for_a_watch(backend) -> None:
    be, client = backend

    async def reply(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"y" * 10)
        await writer.drain()
        writer.transport.abort()
        return False

    be.reply = reply
    done = Done()
    resp = await send(client, req("GET", "/api/v1/pods"), done=done)
    with pytest.raises(BackendFailed, match="mid-stream"):
        await read_all(resp)
    assert len(done.calls) == 1 and done.calls[0] is not None
    watch_done = Done()
    watch = await send(client, req("GET", "/api/v1/pods?watch=1"), watch=True, done=watch_done,
                       long_running=True)
    assert await read_all(watch) == b"y" * 10  # ends cleanly: client-go re-watches
    assert watch_done.calls[0] is not None  # still counted as a mid-stream failure
    await until(lambda: client.connections() == 0)


async def test_a_body_framed_by_connection_close_is_complete(backend) -> None:
    be, client = backend

    async def reply(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        return False

    be.reply = reply
    done = Done()
    assert await read_all(await send(client, req("GET", "/x"), done=done)) == b"all of it"
    assert done.calls == [None]


async def test_head_and_204_and_304_have_no_body(backend) -> None:
    be, client = backend

    async def reply(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        if head.startswith(b"HEAD"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 42\r\n\r\n")
        elif b"/nc" in head:
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 304 Not Modified\r\ncontent-length: 7\r\n\r\n")
        return True

    be.reply = reply
    resp = await send(client, req("HEAD", "/h"))
    assert resp.status == 200 and dict(resp.headers)["content-length"] == "42"
    assert await read_all(resp) == b""
    await until(lambda: client.connections() == 0)  # a HEAD's connection is closed (llhttp cannot skip its body)
    for target, status in (("/nc", 204), ("/nm", 304), ("/nc", 204)):
        resp = await send(client, req("GET", target))
        assert resp.status == status and await read_all(resp) == b""
    assert be.connections == 2  # the three bodiless responses shared one connection


async def test_the_target_is_sent_byte_for_byte_and_bad_heads_are_never_sent(backend) -> None:
    be, client = backend
    target = "/api/v1/namespaces/a%2Fb/pods/%2E%2e?labelSelector=a%3Db&x=@evil:1&&y"
    await read_all(await send(client, req("GET", target, headers=[("x-a", "1"), ("connection", "keep-alive"),
                                                                   ("keep-alive", "1")])))
    head = be.requests[0][0]
    assert head.split(b"\r\n")[0] == f"GET {target} HTTP/1.1".encode()
    assert b"x-a: 1\r\n" in head and b"connection" not in head and b"keep-alive" not in head
    # A Connection naming a field the front stage would have dropped (auth.drop_connection_named) is refused.
    for bad in (req("GET", "/a b"), req("GET", "http://evil/"), req("GET", "/x", headers=[("x-a", "1\r\nx-b: 2")]),
                req("GE T", "/x"), req("GET", "/x", headers=[("connection", "x-drop"), ("x-drop", "2")])):
        with pytest.raises(ValueError):
            await send(client, bad)
    assert len(be.requests) == 1


async def test_request_bodies_stream_chunked_or_by_their_declared_length(backend) -> None:
    be, client = backend
    await read_all(await send(client, req("POST", "/c", body=chunks(b"abc", b"", b"defg"))))
    head, body = be.requests[-1]
    assert b"transfer-encoding: chunked" in head and body == b"abcdefg"
    await read_all(await send(client, req("PUT", "/l", body=chunks(b"ab", b"cd"),
                                          headers=[("content-length", "4")])))
    head, body = be.requests[-1]
    assert b"content-length: 4" in head and b"chunked" not in head and body == b"abcd"
    await read_all(await send(client, req("POST", "/empty")))
    assert b"content-length: 0" in be.requests[-1][0]
    count = len(be.requests)
    with pytest.raises(ClientBodyFailed):
        await send(client, req("PUT", "/over", body=chunks(b"abcd", b"SMUGGLED"), headers=[("content-length", "4")]))
    await asyncio.sleep(0)
    assert all(b"SMUGGLED" not in h + b for h, b in be.requests)
    assert len(be.requests) <= count + 1


async def test_a_request_is_never_resent_when_its_reused_connection_dies(backend) -> None:
    be, client = backend

    async def reply(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        if b"/die" in head:
            writer.transport.abort()
            return False
        writer.write(text())
        return True

    be.reply = reply
    await read_all(await send(client, req("GET", "/warm")))
    with pytest.raises(BackendFailed):
        await send(client, req("POST", "/die", body=chunks(b"{}"), headers=[("content-length", "2")]))
    assert [h.split(b" ")[1] for h, _ in be.requests] == [b"/warm", b"/die"]


async def test_pool_acquire_and_response_header_timeouts(pki: PKI, backend) -> None:
    be, client = backend
    client.settings = replace(client.settings, pool_acquire_timeout_seconds=0.2, response_header_timeout_seconds=0.3)
    client._pools[False] = lean.Pool(client.host, client.port, limit=1, connect_timeout=2.0)
    release = asyncio.Event()

    async def reply(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        if b"/slow" in head:
            await release.wait()
        writer.write(text())
        return True

    be.reply = reply
    held = await send(client, req("GET", "/held"))  # holds the only short-pool slot until read
    with pytest.raises(PoolTimeout):
        await send(client, req("GET", "/next"))
    await read_all(held)
    with pytest.raises(UpstreamTimeout):
        await send(client, req("GET", "/slow"))
    watch = await asyncio.wait_for(send(client, req("GET", "/quick?watch=1"), long_running=True), 2)
    await read_all(watch)
    release.set()
    assert await read_all(await send(client, req("GET", "/after"))) == b"ok"  # the slot came back


async def test_a_desynchronising_backend_never_gets_its_connection_reused(backend) -> None:
    be, client = backend

    async def reply(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        writer.write(text(body=b"first") + text(body=b"EXTRA"))  # two responses to one request
        return True

    be.reply = reply
    first = await read_all(await send(client, req("GET", "/a")))
    be.reply = RawBackend.ok
    second = await read_all(await send(client, req("GET", "/b")))
    assert first == b"first" and second == b"ok" and be.connections == 2


async def test_an_oversized_response_head_fails_the_request(backend) -> None:
    be, client = backend

    async def reply(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"x-big: " + b"a" * (lean.MAX_HEAD_BYTES + 10) + b"\r\n\r\n")
        return False

    be.reply = reply
    with pytest.raises(BackendFailed):
        await send(client, req("GET", "/big-head"))


async def test_identity_and_plain_requests_never_share_a_connection(backend) -> None:
    be, client = backend
    for identity in (True, False, True):
        r = req("GET", "/who")
        await read_all(await client.send(r, [], identity=identity, swallow_body_errors=False, on_done=Done()))
    assert be.connections == 2
    assert be.peer_certs[0] and not be.peer_certs[1]


async def test_a_reader_that_stops_pulling_pauses_the_backend_read(backend) -> None:
    be, client = backend
    total = 8 * lean.READ_HIGH

    async def reply(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // 65536):
            writer.write(b"z" * 65536)
            await writer.drain()
        return True

    be.reply = reply
    resp = await send(client, req("GET", "/huge"))
    conn = resp.body.conn  # type: ignore[attr-defined]
    await until(lambda: conn.reading_paused)
    await asyncio.sleep(0.2)
    assert conn.buffered < 2 * lean.READ_HIGH
    assert len(await read_all(resp)) == total


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!",
    b"HTTP/1.1 200 OK\r\ncontent-length: 5x\r\n\r\nhello",
    b"HTTP/1.1 200 OK\r\nx-a: 1\r\n\tfolded\r\ncontent-length: 0\r\n\r\n",
], ids=["length-and-chunked", "two-lengths", "bad-length", "obs-fold"])
async def test_ambiguous_response_framing_fails_the_request(backend, head: bytes) -> None:
    """A response whose length two parsers could read differently is an error, never a guess."""
    be, client = backend

    async def reply(writer: asyncio.StreamWriter, _head: bytes, body: bytes) -> bool:
        writer.write(head)
        return True

    be.reply = reply
    with pytest.raises(BackendFailed):
        async with asyncio.timeout(5):
            resp = await send(client, req("GET", "/ambiguous"))
            await read_all(resp)
    await until(lambda: client.connections() == 0)  # and the connection is never reused


class _ClosedTransport(asyncio.Transport):
    """A transport that takes writes and aborts and does nothing (the connection is already gone)."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def abort(self) -> None:
        pass


async def test_a_connection_lost_before_its_exchange_began_fails_the_exchange_at_once() -> None:
    """A new connection the backend closed between the connect and the request head: nothing fails it
    from the protocol side (no exchange was out when it was lost), and ``wait_head`` looks only at the
    error, so ``begin`` sets one; otherwise the consumer would wait out the response-header timeout, and a
    watch (no header timeout) would wait forever."""
    conn = lean.Conn(ssl.create_default_context(), on_lost=lambda _conn: None)
    conn.connection_made(_ClosedTransport())
    conn.connection_lost(None)
    conn.begin(b"GET / HTTP/1.1\r\n\r\n", head_only=False, header_timeout=None)
    async with asyncio.timeout(2):
        with pytest.raises(ConnectionResetError):
            await conn.wait_head()
