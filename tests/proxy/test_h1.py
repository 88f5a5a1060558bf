"""HTTP/1.1 adapter over real asyncio sockets on 127.0.0.1 (h11 on the client side to parse)."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import h11
import orjson
import pytest
from edge_kit import rejected

from gatekeeper.proxy.adapter import ClientGone
from gatekeeper.proxy.listen import h1
from gatekeeper.proxy.listen.h1 import H1Connection
from gatekeeper.proxy.messages import Handler, ProxyRequest, ProxyResponse, Upgraded
from gatekeeper.proxy.settings import ProtocolSettings


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    raw_headers: list[tuple[bytes, bytes]] = field(default_factory=list)


class Client:
    """Raw socket + client-side h11, so the test sees exactly what the proxy put on the wire."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h11.Connection(h11.CLIENT)

    def send(self, *events: h11.Event) -> None:
        for e in events:
            self.writer.write(self.conn.send(e) or b"")

    async def _event(self) -> h11.Event:
        while True:
            ev = self.conn.next_event()
            if ev is h11.NEED_DATA:
                self.conn.receive_data(await self.reader.read(65536))
                continue
            return ev  # type: ignore[return-value]

    async def reply(self) -> Reply:
        async with asyncio.timeout(5):
            ev = await self._event()
            while isinstance(ev, h11.InformationalResponse):
                ev = await self._event()
            assert isinstance(ev, h11.Response), ev
            body = b""
            while True:
                nxt = await self._event()
                if isinstance(nxt, h11.Data):
                    body += nxt.data
                elif isinstance(nxt, h11.EndOfMessage):
                    break
                else:
                    raise AssertionError(nxt)
        raw = list(ev.headers.raw_items())
        return Reply(ev.status_code, {k.decode().lower(): v.decode() for k, v in raw}, body, raw)

    async def get(self, target: str = "/api/v1/pods", method: str = "GET") -> Reply:
        self.send(h11.Request(method=method, target=target, headers=[("host", "proxy.test")]),
                  h11.EndOfMessage())
        await self.writer.drain()
        reply = await self.reply()
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return reply

    async def closed_by_server(self) -> bool:
        async with asyncio.timeout(5):
            return await self.reader.read(1) == b""


class Server:
    def __init__(self, handler: Handler, settings: ProtocolSettings, rng=random.random) -> None:
        self.handler, self.settings, self.rng = handler, settings, rng
        self.connections: list[H1Connection] = []
        self.port = 0

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conn = H1Connection(self.handler, self.settings, r, w, peer="127.0.0.1", rng=self.rng,
                            connection_id=len(self.connections) + 1)
        self.connections.append(conn)
        await conn.run()

    async def client(self) -> Client:
        return Client(*await asyncio.open_connection("127.0.0.1", self.port))


@pytest.fixture
async def serve() -> AsyncGenerator:
    servers: list[asyncio.Server] = []
    clients: list[Client] = []
    made: list[Server] = []

    async def start(handler: Handler, settings: ProtocolSettings | None = None, **kw) -> Server:
        s = Server(handler, settings or ProtocolSettings(), **kw)
        made.append(s)
        srv = await asyncio.start_server(s._serve, "127.0.0.1", 0)
        s.port = srv.sockets[0].getsockname()[1]
        servers.append(srv)
        orig = s.client

        async def client() -> Client:
            c = await orig()
            clients.append(c)
            return c

        s.client = client  # type: ignore[method-assign]
        return s

    yield start
    for c in clients:
        c.writer.close()
    for srv in servers:
        srv.close()
    async with asyncio.timeout(5):  # every connection must wind down once its client is gone
        for s in made:
            for conn in s.connections:
                await conn.closed.wait()


EXPECT_HEAD = b"POST /api/v1/x HTTP/1.1\r\nHost: p\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"


async def echo_handler(req: ProxyRequest) -> ProxyResponse:
    total = 0
    if req.body is not None:
        async for chunk in req.body:
            total += len(chunk)
    body = orjson.dumps({"method": req.method, "target": req.target, "bytes": total,
                         "conn": req.connection_id, "protocol": req.protocol})
    return ProxyResponse(200, [("content-type", "application/json")], _chunks(body))


async def test_keepalive_serves_several_requests_on_one_connection(serve):
    server = await serve(echo_handler)
    client = await server.client()
    replies = [await client.get(f"/api/v1/namespaces/ns{i}/pods") for i in range(3)]
    targets = [orjson.loads(r.body)["target"] for r in replies]
    assert targets == [f"/api/v1/namespaces/ns{i}/pods" for i in range(3)]
    assert {orjson.loads(r.body)["conn"] for r in replies} == {1}
    assert {orjson.loads(r.body)["protocol"] for r in replies} == {"http/1.1"}
    # no content-length from the pipeline: streamed with chunked encoding
    assert all(r.headers.get("transfer-encoding") == "chunked" for r in replies)
    assert len(server.connections) == 1


async def test_content_length_response_is_sent_as_is(serve):
    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(200, [("content-length", "10")], _chunks(b"01234", b"56789"))

    client = await (await serve(handler)).client()
    r = await client.get()
    assert r.body == b"0123456789" and r.headers["content-length"] == "10"
    assert "transfer-encoding" not in r.headers


async def test_chunked_and_content_length_request_bodies_stream_to_handler(serve):
    seen_chunks: list[int] = []

    async def handler(req: ProxyRequest) -> ProxyResponse:
        assert req.body is not None
        total = 0
        async for chunk in req.body:
            seen_chunks.append(len(chunk))
            total += len(chunk)
        return ProxyResponse(200, [], _chunks(str(total).encode()))

    client = await (await serve(handler)).client()
    client.send(h11.Request(method="POST", target="/api/v1/namespaces/a/configmaps",
                            headers=[("host", "p"), ("transfer-encoding", "chunked")]))
    for _ in range(5):
        client.send(h11.Data(data=b"x" * 1000))
        await client.writer.drain()
        await asyncio.sleep(0.01)
    client.send(h11.EndOfMessage())
    r = await client.reply()
    assert r.body == b"5000"
    assert len(seen_chunks) >= 2  # arrived in pieces, not buffered whole
    client.conn.start_next_cycle()
    client.send(h11.Request(method="PUT", target="/x", headers=[("host", "p"), ("content-length", "7")]),
                h11.Data(data=b"1234567"), h11.EndOfMessage())
    assert (await client.reply()).body == b"7"


async def test_expect_100_continue_is_answered_when_the_body_is_read(serve):
    client = await (await serve(echo_handler)).client()
    client.writer.write(EXPECT_HEAD)
    await client.writer.drain()
    async with asyncio.timeout(5):
        head = await client.reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 100 ")
    client.writer.write(b"abcd")
    client.conn.send(h11.Request(method="POST", target="/api/v1/x",
                                 headers=[("host", "p"), ("content-length", "4")]))
    client.conn.send(h11.Data(data=b"abcd"))
    client.conn.send(h11.EndOfMessage())
    r = await client.reply()
    assert orjson.loads(r.body)["bytes"] == 4


async def test_request_rejected_before_body_gets_no_100_continue(serve):
    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(429, [("retry-after", "1")], _chunks(b"slow down"))

    client = await (await serve(handler)).client()
    client.writer.write(EXPECT_HEAD)
    await client.writer.drain()
    async with asyncio.timeout(5):
        head = await client.reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429 ")


@pytest.mark.parametrize(
    ("raw", "code", "reason"),
    [
        (b"GARBAGE\r\n\r\n", 400, "h1_malformed"),
        (b"GET /x HTTP/1.1\r\nHost: p\r\nBad Header Name: v\r\n\r\n", 400, "h1_malformed"),
        (b"GET /x HTTP/1.1\r\nHost: p\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n", 431, "h1_head_too_large"),
        (b"GET /x HTTP/1.1\r\nHost: p\r\n" + b"a: 1\r\n" * 100 + b"\r\n", 431, "h1_head_too_large"),
        (b"GET /x HTTP/1.1\r\nHost: p\r\n" + b"a: 1\r\n" * 100, 431, "h1_head_too_large"),
    ],
    ids=["request-line", "header-name", "header-too-large", "too-many-fields", "too-many-fields-unfinished"],
)
async def test_malformed_request_gets_clear_4xx_status(serve, raw, code, reason):
    """Refused, counted under its reason, closed. An unfinished head with too many fields is refused
    as soon as its line count passes the limit, before h11 parses any of it (it parses a head whole)."""
    before = rejected(reason)
    called = False

    async def handler(req: ProxyRequest) -> ProxyResponse:
        nonlocal called
        called = True
        return ProxyResponse(200, [], _chunks(b""))

    settings = ProtocolSettings(max_header_list_bytes=32768, h1_max_header_fields=50)
    client = await (await serve(handler, settings)).client()
    client.writer.write(raw)
    await client.writer.drain()
    r = await client.reply()
    assert r.status == code
    status = orjson.loads(r.body)
    assert status["kind"] == "Status" and status["code"] == code and "malformed" in status["message"]
    assert not called
    assert await client.closed_by_server()
    assert rejected(reason) == before + 1


async def test_too_many_header_fields_read_ahead_behind_a_request_are_refused(serve):
    """A head parsed whole from pipelined bytes (read while the previous response ran) is counted after
    parsing: 200 for the first request, 431 for the second."""
    before = rejected("h1_head_too_large")
    release = asyncio.Event()

    async def handler(req: ProxyRequest) -> ProxyResponse:
        await release.wait()
        return ProxyResponse(200, [("content-length", "2")], _chunks(b"ok"))

    client = await (await serve(handler, ProtocolSettings(h1_max_header_fields=50))).client()
    client.writer.write(b"GET /a HTTP/1.1\r\nHost: p\r\n\r\n"
                        b"GET /b HTTP/1.1\r\nHost: p\r\n" + b"a: 1\r\n" * 100 + b"\r\n")
    await client.writer.drain()
    await asyncio.sleep(0.1)  # the second head is read ahead while the first response waits
    release.set()
    for target, status in (("/a", 200), ("/b", 431)):  # the client's h11 only tracks what was sent raw
        client.conn.send(h11.Request(method="GET", target=target, headers=[("host", "p")]))
        client.conn.send(h11.EndOfMessage())
        assert (await client.reply()).status == status
        if status == 200:
            client.conn.start_next_cycle()
    assert rejected("h1_head_too_large") == before + 1


async def test_broken_chunked_framing_fails_the_request_and_is_counted(serve):
    before = rejected("h1_malformed")
    client = await (await serve(echo_handler)).client()
    client.writer.write(b"POST /x HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXX")
    await client.writer.drain()
    async with asyncio.timeout(5):
        rest = await client.reader.read()  # the handler's failure answer, then the close
    assert rest.startswith(b"HTTP/1.1 502 ")
    assert rejected("h1_malformed") == before + 1


async def test_head_204_304_have_no_body_and_keep_alive(serve):
    async def handler(req: ProxyRequest) -> ProxyResponse:
        code = {"/a": 200, "/b": 204, "/c": 304}[req.target]
        return ProxyResponse(code, [("content-length", "5")] if code == 200 else [], _chunks(b"12345"))

    client = await (await serve(handler)).client()
    r1 = await client.get("/a", method="HEAD")
    r2 = await client.get("/b")
    r3 = await client.get("/c")
    assert (r1.status, r1.body, r1.headers["content-length"]) == (200, b"", "5")
    assert (r2.status, r2.body, r3.status, r3.body) == (204, b"", 304, b"")
    assert (await client.get("/a")).body == b"12345"  # still the same keep-alive connection


async def test_pipelined_requests_are_answered_in_order(serve):
    server = await serve(echo_handler)
    client = await server.client()
    client.writer.write(b"GET /one HTTP/1.1\r\nHost: p\r\n\r\nGET /two HTTP/1.1\r\nHost: p\r\n\r\n")
    await client.writer.drain()
    replies = []
    for target in ("/one", "/two"):
        # both requests went out raw above; tell the parsing h11 client what it "sent"
        client.conn.send(h11.Request(method="GET", target=target, headers=[("host", "p")]))
        client.conn.send(h11.EndOfMessage())
        replies.append(await client.reply())
        client.conn.start_next_cycle()
    r1, r2 = replies
    assert [orjson.loads(r.body)["target"] for r in (r1, r2)] == ["/one", "/two"]


async def test_handler_exception_becomes_502_status(serve):
    async def handler(req: ProxyRequest) -> ProxyResponse:
        raise ValueError("no backend")

    client = await (await serve(handler)).client()
    r = await client.get()
    message = orjson.loads(r.body)["message"]
    assert r.status == 502 and message == "gatekeeper proxy could not serve the request"
    assert "ValueError" not in message and "no backend" not in message  # no exception text to clients


async def test_goaway_chance_sends_connection_close(serve):
    server = await serve(echo_handler, ProtocolSettings(goaway_chance=1.0, allow_unsafe_goaway_chance=True),
                         rng=lambda: 0.0)
    client = await server.client()
    r = await client.get()
    assert r.headers.get("connection") == "close" and orjson.loads(r.body)["target"] == "/api/v1/pods"
    assert await client.closed_by_server()


async def test_no_goaway_when_draw_is_above_chance(serve):
    server = await serve(echo_handler, ProtocolSettings(goaway_chance=0.02), rng=lambda: 0.5)
    client = await server.client()
    for _ in range(3):
        assert "connection" not in (await client.get()).headers
    assert len(server.connections) == 1


async def test_client_hangup_ends_idle_watch(serve):
    finishes: list[BaseException | None] = []
    closed, finished = asyncio.Event(), asyncio.Event()

    async def quiet_watch() -> AsyncIterator[bytes]:
        try:
            yield b'{"type":"ADDED"}\n'
            await asyncio.sleep(3600)  # no events for a long time
        finally:
            closed.set()

    async def handler(req: ProxyRequest) -> ProxyResponse:
        resp = ProxyResponse(200, [], quiet_watch())
        resp.on_complete += [finishes.append, lambda _e: finished.set()]
        return resp

    client = await (await serve(handler)).client()
    client.writer.write(b"GET /api/v1/pods?watch=true HTTP/1.1\r\nHost: p\r\n\r\n")
    await client.writer.drain()
    async with asyncio.timeout(5):
        await client.reader.readuntil(b"ADDED")
    client.writer.close()
    async with asyncio.timeout(5):
        await closed.wait()
        await finished.wait()
    assert len(finishes) == 1 and isinstance(finishes[0], ClientGone)


def quiet_watch_handler(finished: asyncio.Event, finishes: list[BaseException | None]) -> Handler:
    """A watch that sends one event and then nothing for an hour; ``finished`` is set when it is given up."""

    async def quiet_watch() -> AsyncIterator[bytes]:
        yield b'{"type":"ADDED"}\n'
        await asyncio.sleep(3600)

    async def handler(req: ProxyRequest) -> ProxyResponse:
        resp = ProxyResponse(200, [], quiet_watch())
        resp.on_complete += [finishes.append, lambda _e: finished.set()]
        return resp

    return handler


async def open_quiet_watch(serve: Any) -> tuple[Any, Any, asyncio.Event, list[BaseException | None]]:
    """A client whose watch (``quiet_watch_handler``) got its one event: (server, client, finished, finishes)."""
    finishes: list[BaseException | None] = []
    finished = asyncio.Event()
    server = await serve(quiet_watch_handler(finished, finishes))
    client = await server.client()
    client.writer.write(b"GET /api/v1/pods?watch=true HTTP/1.1\r\nHost: p\r\n\r\n")
    await client.writer.drain()
    async with asyncio.timeout(5):
        await client.reader.readuntil(b"ADDED")
    return server, client, finished, finishes


def reset(writer: asyncio.StreamWriter) -> None:
    """Leave as a killed client with bytes unread does: an RST, not a FIN."""
    sock = writer.transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def test_client_reset_ends_idle_watch(serve):
    """A reset, unlike an EOF, made the EOF watcher's read raise; the watcher died and the watch stayed up."""
    server, client, finished, finishes = await open_quiet_watch(serve)
    reset(client.writer)
    async with asyncio.timeout(5):
        await finished.wait()
        await server.connections[0].closed.wait()
    assert len(finishes) == 1 and isinstance(finishes[0], ClientGone)


@pytest.mark.parametrize("leave", ["fin", "rst"])
async def test_client_that_pipelines_past_the_read_ahead_then_leaves_ends_idle_watch(serve, monkeypatch, leave):
    """Past PIPELINE_BUFFER_LIMIT the proxy stops reading, so the transport no longer sees EOF or a reset;
    the kernel's hang-up state is checked instead, and the read-ahead stays bounded meanwhile."""
    monkeypatch.setattr(h1, "HANGUP_CHECK_SECONDS", 0.05)
    server, client, finished, finishes = await open_quiet_watch(serve)
    one = b"GET /api/v1/namespaces/a/pods HTTP/1.1\r\nHost: p\r\n\r\n"
    client.writer.write(one * (256 * 1024 // len(one)))  # fits the kernel buffers: its FIN can follow
    async with asyncio.timeout(5):
        await client.writer.drain()
        conn = server.connections[0]
        while len(conn._conn.trailing_data[0]) < h1.PIPELINE_BUFFER_LIMIT:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # reading has stopped: the read-ahead does not grow any more
    assert len(conn._conn.trailing_data[0]) < h1.PIPELINE_BUFFER_LIMIT + h1.READ_SIZE
    assert not finished.is_set()
    if leave == "rst":
        reset(client.writer)
    else:
        client.writer.close()
    async with asyncio.timeout(5):
        await finished.wait()
        await conn.closed.wait()
    assert len(finishes) == 1 and isinstance(finishes[0], ClientGone)


async def test_upgrade_is_spliced_byte_for_byte(serve):
    """A fake backend speaks its own framing after 101; every byte value crosses unchanged."""
    backend_got = bytearray()
    backend_done = asyncio.Event()
    hello = bytes(range(256))

    async def backend(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(hello)  # unsolicited server->client bytes right after the switch
        await w.drain()
        while data := await r.read(65536):
            backend_got.extend(data)
            w.write(data[::-1])  # answer every read with its reverse
            await w.drain()
        w.close()
        backend_done.set()

    bsrv = await asyncio.start_server(backend, "127.0.0.1", 0)
    bport = bsrv.sockets[0].getsockname()[1]
    closed_calls: list[str] = []
    on_close_done = asyncio.Event()
    finishes: list[BaseException | None] = []

    async def handler(req: ProxyRequest) -> ProxyResponse:
        assert req.header("upgrade") == "SPDY/3.1"
        r, w = await asyncio.open_connection("127.0.0.1", bport)

        async def on_close() -> None:
            closed_calls.append("closed")
            on_close_done.set()

        resp = ProxyResponse(101, [("connection", "Upgrade"), ("upgrade", "SPDY/3.1"),
                                   ("x-stream-protocol-version", "v4.channel.k8s.io")],
                             upgraded=Upgraded(r, w, on_close))
        resp.on_complete.append(finishes.append)
        return resp

    client = await (await serve(handler)).client()
    early = b"EARLY\x00\xff"
    client.writer.write(b"POST /api/v1/namespaces/a/pods/p/exec?command=sh HTTP/1.1\r\nHost: p\r\n"
                        b"Connection: Upgrade\r\nUpgrade: SPDY/3.1\r\n\r\n" + early)
    await client.writer.drain()
    async with asyncio.timeout(5):
        head = await client.reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101 ")
        assert b"x-stream-protocol-version: v4.channel.k8s.io" in head.lower()
        assert await client.reader.readexactly(256) == hello
        assert await client.reader.readexactly(len(early)) == early[::-1]
        payload = os.urandom(100_000)
        client.writer.write(payload)
        await client.writer.drain()
        got = bytearray()
        while len(backend_got) < len(early) + len(payload) or len(got) < len(payload):
            got.extend(await client.reader.read(65536))
    assert bytes(backend_got) == early + payload
    assert len(got) == len(payload)  # reversed per read, so compare multiset of bytes
    assert sorted(got) == sorted(payload)
    client.writer.close()
    async with asyncio.timeout(5):
        await backend_done.wait()
        await on_close_done.wait()
    assert closed_calls == ["closed"] and finishes == [None]
    bsrv.close()


async def test_idle_keepalive_connection_is_closed_after_idle_timeout(serve):
    server = await serve(echo_handler, ProtocolSettings(idle_timeout_seconds=0.2))
    client = await server.client()
    assert (await client.get()).status == 200
    assert await client.closed_by_server()


async def test_shutdown_closes_idle_connection_and_marks_busy_one(serve):
    release = asyncio.Event()

    async def handler(req: ProxyRequest) -> ProxyResponse:
        if req.target == "/busy":
            await release.wait()
        return ProxyResponse(200, [], _chunks(b"ok"))

    server = await serve(handler)
    idle = await server.client()
    assert (await idle.get("/warm")).status == 200
    busy = await server.client()
    busy.send(h11.Request(method="GET", target="/busy", headers=[("host", "p")]), h11.EndOfMessage())
    await busy.writer.drain()
    await asyncio.sleep(0.05)
    for conn in server.connections:
        conn.shutdown()
    assert await idle.closed_by_server()
    release.set()
    reply = await busy.reply()
    assert reply.body == b"ok" and reply.headers.get("connection") == "close"
    assert await busy.closed_by_server()


UPGRADE_HEAD = (b"GET /api/v1/namespaces/a/pods/p/portforward HTTP/1.1\r\nHost: p\r\nConnection: Upgrade\r\n"
                b"Upgrade: websocket\r\n\r\n")


async def tunnel_backend(behaviour):  # type: ignore[no-untyped-def]
    """A backend the handler splices to; ``behaviour(reader, writer)`` runs per connection, then it closes.

    Returns (handler, backend_closed, closed_calls): the event is set once the backend saw its end.
    """
    backend_closed = asyncio.Event()
    closed_calls: list[str] = []

    async def backend(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await behaviour(r, w)
            while await r.read(65536):  # until the proxy closes its side
                pass
        except ConnectionError:
            pass
        finally:
            w.close()
            backend_closed.set()

    bsrv = await asyncio.start_server(backend, "127.0.0.1", 0)
    bport = bsrv.sockets[0].getsockname()[1]

    async def handler(req: ProxyRequest) -> ProxyResponse:
        r, w = await asyncio.open_connection("127.0.0.1", bport)

        async def on_close() -> None:
            closed_calls.append("closed")

        return ProxyResponse(101, [("connection", "Upgrade"), ("upgrade", "websocket")],
                             upgraded=Upgraded(r, w, on_close))

    return handler, backend_closed, closed_calls


async def test_idle_upgraded_tunnel_is_closed_after_its_idle_timeout(serve):
    """No byte either way for h1UpgradeIdleTimeoutSeconds: both sides are closed, counted upgrade_idle.

    Before, an idle tunnel (a pods/proxy websocket to a silent pod) held its client connection, its
    backend connection and its lease for ever.
    """
    async def greet_then_silence(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"hello")
        await w.drain()

    handler, backend_closed, closed_calls = await tunnel_backend(greet_then_silence)
    before = rejected("upgrade_idle")
    client = await (await serve(handler, ProtocolSettings(h1_upgrade_idle_timeout_seconds=0.3))).client()
    client.writer.write(UPGRADE_HEAD)
    await client.writer.drain()
    async with asyncio.timeout(5):
        assert (await client.reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101 ")
        assert await client.reader.readexactly(5) == b"hello"
        client.writer.write(b"ping")  # traffic re-arms the deadline
        await client.writer.drain()
        assert await client.reader.read() == b""  # then silence: the proxy closes the tunnel
        await backend_closed.wait()
    assert closed_calls == ["closed"]
    assert rejected("upgrade_idle") == before + 1


async def test_upgraded_tunnel_whose_client_stops_reading_is_aborted(serve):
    """A client that takes no tunnel bytes for h1WriteStallTimeoutSeconds is aborted (response_stall).

    Before, the splice waited on the client's socket for ever, holding the backend connection and lease.
    """
    async def flood(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        chunk = b"x" * 65536
        for _ in range(1024):  # 64 MiB at most: far more than the socket buffers hold
            w.write(chunk)
            await w.drain()

    handler, backend_closed, closed_calls = await tunnel_backend(flood)
    before = rejected("response_stall")
    server = await serve(handler, ProtocolSettings(h1_write_stall_timeout_seconds=0.3))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(UPGRADE_HEAD)
        await writer.drain()
        async with asyncio.timeout(5):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101 ")
        writer.transport.pause_reading()  # never read again
        async with asyncio.timeout(20):
            await backend_closed.wait()
            await server.connections[0].closed.wait()
        assert closed_calls == ["closed"]
        assert rejected("response_stall") == before + 1
    finally:
        writer.close()


async def test_upgraded_tunnel_ends_when_the_backend_closes(serve):
    """The backend's close reaches the client as EOF and frees the tunnel (on_close runs once)."""

    async def say_bye(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"bye")
        await w.drain()
        w.close()

    handler, _backend_closed, closed_calls = await tunnel_backend(say_bye)
    server = await serve(handler)
    client = await server.client()
    client.writer.write(UPGRADE_HEAD)
    await client.writer.drain()
    async with asyncio.timeout(5):
        assert (await client.reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101 ")
        assert await client.reader.read() == b"bye"  # then EOF
        await server.connections[0].closed.wait()
    assert closed_calls == ["closed"]


def silent_backend(started: asyncio.Event, cancelled: asyncio.Event) -> Handler:
    """A handler that never answers (a backend sitting on the request); it sets ``cancelled`` when given up."""

    async def handler(req: ProxyRequest) -> ProxyResponse:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    return handler


async def test_client_hangup_while_an_upgrade_waits_for_its_backend_ends_the_request(serve):
    """An upgrade request whose backend has not answered yet: the client's hang-up cancels the handler.

    Before, EOF was not watched on an upgrade request (the bytes after it belong to the new
    protocol), so a client could send the request to a silent backend and leave: the proxy kept the
    client slot, the backend connection and the lease for ever, with nobody paying for them.
    """
    started, cancelled = asyncio.Event(), asyncio.Event()
    server = await serve(silent_backend(started, cancelled))
    client = await server.client()
    client.writer.write(UPGRADE_HEAD)
    await client.writer.drain()
    async with asyncio.timeout(5):
        await started.wait()
        client.writer.close()
        await cancelled.wait()
        await server.connections[0].closed.wait()


async def test_bytes_sent_before_the_101_reach_the_tunnel_in_order(serve):
    """The client may talk the new protocol before the 101 arrives; those bytes are held, then sent first."""
    got = bytearray()
    backend_done = asyncio.Event()
    answer = asyncio.Event()

    async def record(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while len(got) < 8:
            got.extend(await r.read(65536))
        backend_done.set()

    handler, _closed, _calls = await tunnel_backend(record)

    async def slow_handler(req: ProxyRequest) -> ProxyResponse:
        await answer.wait()
        return await handler(req)

    client = await (await serve(slow_handler)).client()
    client.writer.write(UPGRADE_HEAD + b"early")
    await client.writer.drain()
    await asyncio.sleep(0.1)  # read by the proxy while the backend has not answered
    answer.set()
    async with asyncio.timeout(5):
        assert (await client.reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101 ")
        client.writer.write(b"+late")
        await client.writer.drain()
        await backend_done.wait()
    assert bytes(got) == b"early+late"


async def test_upgrade_request_left_unanswered_is_cut_at_the_upgrade_idle_timeout(serve):
    """A backend that sits on an upgrade request (nothing moves either way) is given up on, counted
    upgrade_idle, while the client stays connected; the handler is cancelled (its backend freed)."""
    cancelled = asyncio.Event()
    before = rejected("upgrade_idle")
    settings = ProtocolSettings(h1_upgrade_idle_timeout_seconds=0.3)
    client = await (await serve(silent_backend(asyncio.Event(), cancelled), settings)).client()
    client.writer.write(UPGRADE_HEAD)
    await client.writer.drain()
    assert await client.closed_by_server()
    async with asyncio.timeout(5):
        await cancelled.wait()
    assert rejected("upgrade_idle") == before + 1
