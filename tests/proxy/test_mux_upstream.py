"""The multiplexed HTTP/2 upstream  against an in-process TLS backend.

The backend is the ``h2`` library's server state machine (an implementation
independent of ours) with a script per test, plus raw frames where a test needs
a backend that breaks the protocol. The same client is proven against real
kube-apiservers in ``test_mux_sandbox.py``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import hpack
import pytest
from edge_kit import fronted, make_pki
from hpack import NeverIndexedHeaderTuple
from prometheus_client import REGISTRY
from test_upstream import server_ssl

from gatekeeper.base.config import ConfigError, load_config
from gatekeeper.certs.pki import PKI
from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire.client_codec import response_head
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.pipeline.balancer import Balancer
from gatekeeper.proxy.pipeline.stages import Dispatcher
from gatekeeper.proxy.settings import BackendSettings, UpstreamSettings
from gatekeeper.proxy.upstream import mux
from gatekeeper.proxy.upstream.client import BackendClient, BackendFailed, UpstreamTimeout
from gatekeeper.proxy.upstream.exchange import encode_request_head
from gatekeeper.proxy.upstream.mux_pool import MuxBody
from gatekeeper.proxy.upstream.mux_wire import authority_field, request_block

Script = Callable[["Backend", "Peer", int, dict[str, str]], Awaitable[None]]
"""What the backend does with one request (stream id, its headers)."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


class Peer:
    """One client connection on the backend: the h2 state machine and its socket."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        self.writer = writer
        self.window_opened = asyncio.Event()

    def flush(self) -> None:
        self.writer.write(self.conn.data_to_send())

    def respond(self, sid: int, status: int = 200, body: bytes = b"", *, end: bool = True) -> None:
        self.conn.send_headers(sid, [(":status", str(status)), ("content-type", "text/plain"),
                                     ("audit-id", f"id-{sid}")], end_stream=not body and end)
        if body:
            self.conn.send_data(sid, body, end_stream=end)
        self.flush()

    async def send_all(self, sid: int, body: bytes) -> None:
        """``body`` as flow control allows, waiting for WINDOW_UPDATEs (as a real server would)."""
        while body:
            room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size, len(body))
            if room <= 0:
                self.window_opened.clear()
                await self.window_opened.wait()
                continue
            self.conn.send_data(sid, body[:room], end_stream=len(body) == room)
            body = body[room:]
            self.flush()

    def raw(self, data: bytes) -> None:
        self.flush()
        self.writer.write(data)


class Backend:
    def __init__(self, pki: PKI, *, alpn: str = "h2") -> None:
        self.pki = pki
        self.alpn = alpn
        self.script: Script = self.ok
        self.connections = 0
        self.requests: list[dict[str, str]] = []
        self.raw_requests: list[list[tuple[bytes, bytes]]] = []
        self.resets: list[tuple[int, int]] = []
        self.server: asyncio.Server | None = None
        self.peers: list[Peer] = []
        self.peer_certs: list[object] = []

    @staticmethod
    async def ok(backend: Backend, peer: Peer, sid: int, headers: dict[str, str]) -> None:
        peer.respond(sid, 200, b"ok " + headers[":path"].encode())

    async def start(self) -> str:
        ctx = self.ctx = server_ssl(self.pki)
        ctx.set_alpn_protocols([self.alpn])
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0, ssl=ctx)
        return f"https://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.peer_certs.append(writer.get_extra_info("peercert"))
        peer = Peer(writer)
        self.peers.append(peer)
        peer.conn.initiate_connection()
        peer.flush()
        tasks: set[asyncio.Task[None]] = set()
        try:
            while data := await reader.read(65536):
                try:
                    events = peer.conn.receive_data(data)
                except h2.exceptions.ProtocolError:
                    break
                for event in events:
                    if isinstance(event, h2.events.RequestReceived):
                        raw = list(event.headers)  # HeaderTuple / NeverIndexedHeaderTuple, as hpack decoded them
                        headers = {bytes(k).decode(): bytes(v).decode() for k, v in raw}
                        self.requests.append(headers)
                        self.raw_requests.append(raw)
                        task = asyncio.create_task(self.script(self, peer, event.stream_id, headers))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    elif isinstance(event, h2.events.StreamReset):
                        self.resets.append((event.stream_id, event.error_code))
                    elif isinstance(event, h2.events.WindowUpdated):
                        peer.window_opened.set()
                peer.flush()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            for task in tasks:
                task.cancel()
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for peer in self.peers:
                peer.writer.close()


@pytest.fixture
async def backend(pki: PKI):
    b = Backend(pki)
    url = await b.start()
    client = BackendClient("b", url, UpstreamSettings(
        ca_file=str(pki.cert_path("ca")), response_header_timeout_seconds=5,
        client_cert_file=str(pki.cert_path("front-proxy-client")),
        client_key_file=str(pki.key_path("front-proxy-client"))))
    yield b, client
    await client.close()
    await b.stop()


def get(target: str, headers: list[tuple[str, str]] | None = None, method: str = "GET") -> ProxyRequest:
    return ProxyRequest(method=method, target=target, headers=headers or [("accept", "*/*")], body=None,
                        protocol="h2")


async def send(client: BackendClient, request: ProxyRequest, *, multiplex: bool = True, identity: bool = False,
               done: list[BaseException | None] | None = None) -> ProxyResponse:
    return await client.send(request, request.headers, identity=identity, swallow_body_errors=False,
                             on_done=(done.append if done is not None else lambda e: None), multiplex=multiplex)


def free_slots(client: BackendClient) -> int:
    assert client.mux is not None
    return client.mux.slots.free


async def read_all(response: ProxyResponse) -> bytes:
    assert response.body is not None
    return b"".join([chunk async for chunk in response.body])


async def test_concurrent_gets_share_one_connection_and_arrive_whole(backend) -> None:
    b, client = backend
    responses = await asyncio.gather(*(send(client, get(f"/api/v1/namespaces/n{i}")) for i in range(40)))
    bodies = [await read_all(r) for r in responses]
    assert bodies == [f"ok /api/v1/namespaces/n{i}".encode() for i in range(40)]
    assert {r.status for r in responses} == {200}
    assert ("audit-id", "id-1") in responses[0].headers
    assert b.connections == 1
    assert free_slots(client) == client.settings.max_connections_per_backend


async def test_requests_not_marked_multiplexable_take_the_http11_pool(backend) -> None:
    b, client = backend
    # The backend speaks only h2, so the HTTP/1.1 attempt fails at the protocol level: what matters is
    # that it never became a stream on the shared connection.
    with pytest.raises(BackendFailed):
        await read_all(await send(client, get("/version"), multiplex=False))
    assert b.requests == []


async def test_streams_above_a_goaway_are_sent_again_and_those_below_finish(backend) -> None:
    b, client = backend
    release = asyncio.Event()

    async def goaway_after_three(backend: Backend, peer: Peer, sid: int, headers: dict[str, str]) -> None:
        if backend.connections == 1:
            if len(backend.requests) == 10:
                peer.raw(f.goaway(5, 0))  # streams 1, 3, 5 will be answered; 7.. were never processed
                release.set()
            await release.wait()
            if sid <= 5:
                peer.respond(sid, 200, b"first " + headers[":path"].encode())
            return
        peer.respond(sid, 200, b"second " + headers[":path"].encode())

    b.script = goaway_after_three
    responses = await asyncio.gather(*(send(client, get(f"/r{i}")) for i in range(10)))
    bodies = sorted([(await read_all(r)).decode() for r in responses])
    assert len([x for x in bodies if x.startswith("first")]) == 3
    assert len([x for x in bodies if x.startswith("second")]) == 7
    assert sorted(int(x.split("/r")[1]) for x in bodies) == list(range(10))
    assert b.connections == 2


async def test_a_refused_stream_is_sent_once_more_and_a_reset_one_never(backend) -> None:
    b, client = backend
    seen: list[str] = []

    async def refuse_always(backend: Backend, peer: Peer, sid: int, headers: dict[str, str]) -> None:
        seen.append(headers[":path"])
        peer.conn.reset_stream(sid, 7)
        peer.flush()

    async def refuse_first(backend: Backend, peer: Peer, sid: int, headers: dict[str, str]) -> None:
        seen.append(headers[":path"])
        if headers[":path"] == "/refused" and seen.count("/refused") == 1:
            peer.conn.reset_stream(sid, 7)  # REFUSED_STREAM: provably not processed
            peer.flush()
        elif headers[":path"] == "/reset":
            peer.conn.reset_stream(sid, 2)  # INTERNAL_ERROR: may have been processed
            peer.flush()
        else:
            peer.respond(sid, 200, b"ok")

    b.script = refuse_first
    assert await read_all(await send(client, get("/refused"))) == b"ok"
    assert seen == ["/refused", "/refused"]
    with pytest.raises(BackendFailed):
        await send(client, get("/reset"))
    assert seen.count("/reset") == 1
    seen.clear()
    b.script = refuse_always
    # Refused twice: never processed, so it goes over HTTP/1.1 (this backend speaks only h2, so that
    # attempt fails at the protocol level; test_mux_refused.py has a backend that answers it).
    with pytest.raises(BackendFailed):
        await send(client, get("/refused"))
    assert seen == ["/refused", "/refused"]


async def test_a_client_that_stops_reading_holds_one_stream_window_and_the_others_go_on(backend) -> None:
    b, client = backend
    big = b"x" * (3 * mux.STREAM_WINDOW)

    async def script(backend: Backend, peer: Peer, sid: int, headers: dict[str, str]) -> None:
        if headers[":path"] == "/big":
            peer.conn.send_headers(sid, [(":status", "200")])
            await peer.send_all(sid, big)
        else:
            peer.respond(sid, 200, b"small")

    b.script = script
    stalled = await send(client, get("/big"))
    for _ in range(20):  # the stalled stream's window fills while nobody reads it
        await asyncio.sleep(0.02)
    small = await asyncio.gather(*(send(client, get(f"/s{i}")) for i in range(5)))
    assert [await read_all(r) for r in small] == [b"small"] * 5
    assert isinstance(stalled.body, MuxBody)
    stream = stalled.body.stream
    assert 0 < stream.buffered <= mux.STREAM_WINDOW
    assert await read_all(stalled) == big  # the window re-opens as the consumer reads
    assert b.connections == 1


@pytest.mark.parametrize("frame", [
    pytest.param(f.frame(f.PUSH_PROMISE, f.END_HEADERS, 1, b"\x00\x00\x00\x02\x88"), id="push-promise"),
    pytest.param(f.header(f.DATA, 0, 1, f.MIN_FRAME_SIZE + 1) + b"x" * (f.MIN_FRAME_SIZE + 1), id="oversized-frame"),
    pytest.param(f.frame(f.DATA, 0, 99, b"x"), id="data-on-a-stream-never-opened"),
    pytest.param(f.frame(f.HEADERS, f.END_HEADERS, 1, b"\xff\xff\xff\xff\x0f"), id="bad-header-block"),
    pytest.param(f.frame(f.HEADERS, f.END_HEADERS, 1, b"\x88\x82"), id="request-pseudo-header-in-a-response"),
    pytest.param(f.frame(f.DATA, 0, 1, b"early"), id="data-before-the-head"),
])
async def test_a_backend_breaking_http2_loses_the_connection_and_the_next_request_gets_a_new_one(
        backend, frame: bytes) -> None:
    b, client = backend

    async def hostile(backend: Backend, peer: Peer, sid: int, headers: dict[str, str]) -> None:
        if backend.connections == 1:
            peer.raw(frame)
        else:
            peer.respond(sid, 200, b"ok")

    b.script = hostile
    with pytest.raises(BackendFailed):
        await read_all(await send(client, get("/one")))
    assert await read_all(await send(client, get("/two"))) == b"ok"
    assert b.connections == 2
    assert free_slots(client) == client.settings.max_connections_per_backend


async def test_a_stream_the_backend_resets_is_that_requests_502_and_never_ejects_the_backend(backend) -> None:
    """Go's server resets a request it finds malformed (RST_STREAM PROTOCOL_ERROR, no answer): the
    request fails, the backend stays in rotation and its connection serves the next request. Ejecting
    it, as for a dead connection, let any client empty the rotation with one GET per apiserver."""
    b, client = backend

    async def resets_one(backend: Backend, peer: Peer, sid: int, headers: dict[str, str]) -> None:
        if headers[":path"] == "/malformed":
            peer.conn.reset_stream(sid, 1)  # PROTOCOL_ERROR, before any head
            peer.flush()
        else:
            peer.respond(sid, 200, b"ok")

    b.script = resets_one
    balancer = Balancer([BackendSettings(url=client.url, name="b")])
    dispatch = Dispatcher(balancer, {"b": client})

    def request(target: str) -> ProxyRequest:
        return fronted(ProxyRequest(method="GET", target=target, headers=[("authorization", "Bearer t")],
                                    body=None, protocol="h2", token_verified=True))

    for _ in range(3):
        response = await dispatch(request("/malformed"))
        assert response.status == 502
        await read_all(response)
    (backend_state,) = balancer.backends
    assert backend_state.ejections_total == 0 and balancer.health(backend_state) == "healthy"
    assert backend_state.in_flight == 0
    ok = await dispatch(request("/fine"))
    assert ok.status == 200 and await read_all(ok) == b"ok"
    ok.finish(None)
    assert b.connections == 1  # the connection outlived the resets
    assert free_slots(client) == client.settings.max_connections_per_backend


async def test_a_response_head_that_never_comes_times_out_and_the_stream_is_reset(backend) -> None:
    b, client = backend
    client.settings = replace(client.settings, response_header_timeout_seconds=0.3)

    async def silent(backend: Backend, peer: Peer, sid: int, headers: dict[str, str]) -> None:
        await asyncio.sleep(30)

    b.script = silent
    done: list[BaseException | None] = []
    with pytest.raises(UpstreamTimeout):
        await send(client, get("/slow"), done=done)
    for _ in range(50):
        if b.resets:
            break
        await asyncio.sleep(0.02)
    assert b.resets == [(1, 8)]  # RST_STREAM CANCEL
    assert free_slots(client) == client.settings.max_connections_per_backend


async def test_a_client_gone_mid_body_resets_its_stream_and_frees_its_slot(backend) -> None:
    b, client = backend

    async def endless(backend: Backend, peer: Peer, sid: int, headers: dict[str, str]) -> None:
        peer.respond(sid, 200, b"part", end=False)

    b.script = endless
    done: list[BaseException | None] = []
    response = await send(client, get("/list"), done=done)
    assert response.body is not None
    assert await response.body.__anext__() == b"part"
    await response.body.aclose()  # type: ignore[attr-defined]
    for _ in range(50):
        if b.resets:
            break
        await asyncio.sleep(0.02)
    assert b.resets == [(1, 8)]
    assert len(done) == 1 and done[0] is not None
    assert free_slots(client) == client.settings.max_connections_per_backend


async def fetch(client: BackendClient, target: str, *, identity: bool = False) -> bytes:
    """One GET read to its end (its connection is back in the pool when this returns)."""
    return await read_all(await send(client, get(target), identity=identity))


def fallbacks(name: str) -> float:
    return REGISTRY.get_sample_value("gatekeeper_proxy_upstream_http2_fallbacks_total", {"backend": name}) or 0.0


@pytest.mark.parametrize("alpn", [pytest.param(["http/1.1"], id="alpn-http11"), pytest.param(None, id="no-alpn")])
async def test_a_backend_that_does_not_speak_http2_is_used_over_http11_after_one_handshake(
        pki: PKI, alpn: list[str] | None) -> None:
    from test_lean_upstream import RawBackend  # the scripted HTTP/1.1 backend

    raw = RawBackend(pki, alpn=alpn)
    url = await raw.start()
    name = f"h1-only-{alpn}"
    before = fallbacks(name)
    client = BackendClient(name, url, UpstreamSettings(ca_file=str(pki.cert_path("ca"))))
    try:
        assert await read_all(await send(client, get("/version"))) == b"ok"
        assert client.mux is not None and client.mux.h2 is False
        assert await read_all(await send(client, get("/version"))) == b"ok"
        assert len(raw.requests) == 2
        # The handshake that found out carried both requests: the HTTP/1.1 pool did not make its own.
        assert raw.connections == 1
        assert client.connections() == 1
        assert fallbacks(name) - before == 1
    finally:
        await client.close()
        await raw.stop()


async def test_the_handed_over_connection_counts_in_the_pool_limit(pki: PKI) -> None:
    from test_lean_upstream import RawBackend

    raw = RawBackend(pki, alpn=["http/1.1"])
    url = await raw.start()
    client = BackendClient("h1-limit", url, UpstreamSettings(ca_file=str(pki.cert_path("ca")),
                                                             max_connections_per_backend=1))
    try:
        # Eight callers at once, one connection allowed: the eight that asked for HTTP/2 and waited on one
        # another share the one handshake, which then carries every request in turn.
        bodies = await asyncio.gather(*(fetch(client, f"/r{i}") for i in range(8)))
        assert bodies == [b"ok"] * 8
        assert raw.connections == 1
        assert client._pools[False].open == 1 and client.connections() == 1
        assert client._pools[False].slots.free == 1
    finally:
        await client.close()
        await raw.stop()


async def test_a_handed_over_connection_past_the_pool_limit_is_closed(pki: PKI) -> None:
    from test_lean_upstream import RawBackend

    raw = RawBackend(pki, alpn=["http/1.1"])
    url = await raw.start()
    client = BackendClient("h1-full", url, UpstreamSettings(ca_file=str(pki.cert_path("ca")),
                                                            max_connections_per_backend=1))
    pool = client._pools[False]
    try:
        first = await send(client, get("/first"))  # the handed-over connection, busy until its body is read
        interval_passes(client)
        second = asyncio.create_task(fetch(client, "/second"))  # asks for HTTP/2 again: a new connection
        for _ in range(500):
            if pool.slots.waiters:
                break
            await asyncio.sleep(0.01)
        assert pool.slots.waiters, "the second request never reached the HTTP/1.1 pool"
        assert raw.connections == 2 and pool.open == 1  # the pool holds one connection, as its limit says
        assert await read_all(first) == b"ok"
        assert await second == b"ok"
        assert pool.open == 1 and fallbacks("h1-full") >= 2
    finally:
        await client.close()
        await raw.stop()


async def test_a_handed_over_connection_keeps_the_kind_of_certificate_it_was_made_with(pki: PKI) -> None:
    from test_lean_upstream import RawBackend

    raw = RawBackend(pki, alpn=["http/1.1"])
    url = await raw.start()
    client = BackendClient("h1-kinds", url, UpstreamSettings(
        ca_file=str(pki.cert_path("ca")), client_cert_file=str(pki.cert_path("front-proxy-client")),
        client_key_file=str(pki.key_path("front-proxy-client"))))
    try:
        assert await fetch(client, "/asserted", identity=True) == b"ok"  # found out with the certificate
        assert await fetch(client, "/token") == b"ok"  # so a token request needs a connection without one
        assert await fetch(client, "/asserted-again", identity=True) == b"ok"
        assert raw.connections == 2
        assert raw.peer_certs[0] and not raw.peer_certs[1]
        heads = [head.split(b" ")[1] for head, _ in raw.requests]
        assert heads == [b"/asserted", b"/token", b"/asserted-again"]
    finally:
        await client.close()
        await raw.stop()


class Switching(Backend):
    """A backend whose ALPN answer is changed by the test: ``h2`` connections go to the h2 script, the
    others are answered over HTTP/1.1 with ``h1 <path>``."""

    def __init__(self, pki: PKI) -> None:
        super().__init__(pki, alpn="http/1.1")
        self.h1_connections = 0

    def answer(self, alpn: str) -> None:
        self.ctx.set_alpn_protocols([alpn])  # read by every later handshake

    def h1_answer(self, head: bytes) -> bytes:
        body = b"h1 " + head.split(b" ")[1]
        return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2":
            return await super().handle(reader, writer)
        self.h1_connections += 1
        try:
            while True:
                writer.write(self.h1_answer(await reader.readuntil(b"\r\n\r\n")))
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()


def interval_passes(client: BackendClient) -> None:
    assert client.mux is not None
    client.mux.retry_at = time.monotonic()


async def test_a_backend_that_turns_http2_on_is_asked_again_once_per_interval(pki: PKI) -> None:
    b = Switching(pki)
    url = await b.start()
    client = BackendClient("switching", url, UpstreamSettings(ca_file=str(pki.cert_path("ca"))))
    before = fallbacks("switching")
    try:
        assert await read_all(await send(client, get("/a"))) == b"h1 /a"
        b.answer("h2")
        for _ in range(5):  # within the interval: the HTTP/1.1 pool, no new connection
            assert await read_all(await send(client, get("/b"))) == b"h1 /b"
        assert (b.h1_connections, b.connections) == (1, 0)
        interval_passes(client)
        assert await read_all(await send(client, get("/c"))) == b"ok /c"
        assert client.mux is not None and client.mux.h2 is True
        assert await read_all(await send(client, get("/d"))) == b"ok /d"
        assert (b.h1_connections, b.connections) == (1, 1)
        assert fallbacks("switching") - before == 1
    finally:
        await client.close()
        await b.stop()


async def test_a_backend_still_on_http11_costs_one_attempt_per_interval_and_no_handshake(pki: PKI) -> None:
    b = Switching(pki)
    url = await b.start()
    client = BackendClient("flapping", url, UpstreamSettings(
        ca_file=str(pki.cert_path("ca")), client_cert_file=str(pki.cert_path("front-proxy-client")),
        client_key_file=str(pki.key_path("front-proxy-client"))))
    before = fallbacks("flapping")
    try:
        assert await read_all(await send(client, get("/a"))) == b"h1 /a"
        interval_passes(client)
        # The interval is over: of these eight callers (two TLS contexts, so two connections could be asked
        # for at once) one asks for HTTP/2 again, the rest take the pool.
        bodies = await asyncio.gather(*(fetch(client, f"/r{i}", identity=i % 2 == 1) for i in range(8)))
        assert bodies == [f"h1 /r{i}".encode() for i in range(8)]
        assert fallbacks("flapping") - before == 2
        opened = b.h1_connections
        for _ in range(5):  # the asking connection is in the pool; nothing more is asked until the next interval
            assert await read_all(await send(client, get("/b"))) == b"h1 /b"
        assert b.h1_connections == opened and fallbacks("flapping") - before == 2
        assert b.connections == 0
    finally:
        await client.close()
        await b.stop()


async def test_a_retry_interval_of_zero_never_asks_again(pki: PKI) -> None:
    from test_lean_upstream import RawBackend

    raw = RawBackend(pki, alpn=["http/1.1"])
    url = await raw.start()
    client = BackendClient("never", url, UpstreamSettings(ca_file=str(pki.cert_path("ca")),
                                                          http2_retry_seconds=0))
    try:
        await read_all(await send(client, get("/a")))
        interval_passes(client)
        client.mux.retry_at = 0.0  # type: ignore[union-attr]
        await read_all(await send(client, get("/b")))
        assert fallbacks("never") == 1 and raw.connections == 1
    finally:
        await client.close()
        await raw.stop()


@pytest.mark.parametrize(("key", "value", "message"), [
    *(("http2RetrySeconds", v, r"must be 0 \(never\) or at least 1") for v in ("0.5", "-1", ".nan")),
    *(("http2UnauthorizedPauseSeconds", v, r"must be 1..86400") for v in ("0", "0.5", "-1", ".nan", "86401")),
])
def test_an_http2_interval_out_of_its_range_is_refused(tmp_path: Path, key: str, value: str, message: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("proxy:\n  backends: [{url: 'https://127.0.0.1:1'}]\n"
                 f"  listener: {{certFile: a, keyFile: b}}\n  upstream: {{caFile: ca, {key}: {value}}}\n")
    with pytest.raises(ConfigError, match=rf"proxy.upstream: {key} {message}"):
        load_config(p)


async def test_the_token_goes_out_never_indexed_and_the_backend_sees_the_target_byte_for_byte(backend) -> None:
    b, client = backend
    target = "/api/v1/namespaces/a%2Fb/pods?labelSelector=x%3Dy&limit=5"
    headers = [("authorization", "Bearer secret"), ("accept", "application/json"), ("host", "evil.example"),
               ("connection", "keep-alive"), ("te", "trailers"), ("X-Upper", "v")]
    await read_all(await send(client, get(target, headers)))
    sent = b.requests[0]
    assert sent[":path"] == target and sent[":authority"] == client.authority
    assert sent["authorization"] == "Bearer secret" and sent["x-upper"] == "v"
    assert "te" not in sent and "host" not in sent and "connection" not in sent
    raw = b.raw_requests[0]
    assert [type(x) for x in raw if x[0] == b"authorization"] == [NeverIndexedHeaderTuple]
    assert not any(type(x) is NeverIndexedHeaderTuple for x in raw if x[0] != b"authorization")


@pytest.mark.parametrize("method,target,headers", [
    ("GET", "/api\r\nx: y", []),
    ("GET", "http://evil/api", []),
    ("G ET", "/api", []),
    ("GET", "/api", [("x-a", "v\r\nx-b: w")]),
    ("GET", "/api", [("x-a", "v\x00")]),
    ("GET", "/api", [("bad name", "v")]),
    ("GET", "/api", [("content-length", "5")]),
])
def test_what_the_http11_head_refuses_is_refused_as_http2_fields(method: str, target: str,
                                                                 headers: list[tuple[str, str]]) -> None:
    with pytest.raises(ValueError):
        request_block(method, target, authority_field("a:1"), headers, frozenset())


def decoded(block: bytes) -> list[tuple[bytes, bytes]]:
    return [(bytes(k), bytes(v)) for k, v in hpack.Decoder().decode(block, raw=True)]


def test_client_pseudo_headers_never_reach_the_backend() -> None:
    block = request_block("GET", "/api", authority_field("a:1"), [(":path", "/other"), (":authority", "evil")],
                          frozenset())
    assert decoded(block) == [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"a:1"),
                              (b":path", b"/api")]


def test_a_connection_header_naming_a_field_is_refused_on_both_paths_even_after_that_field_was_memoized() -> None:
    """The front stage drops what Connection names; a request that did not pass it is refused, never sent with it."""
    removed = frozenset({"connection", "host", "keep-alive"})
    plain = request_block("GET", "/a", authority_field("a:1"), [("x-token-hint", "1")], removed)
    assert (b"x-token-hint", b"1") in decoded(plain)
    with pytest.raises(ValueError):
        request_block("GET", "/a", authority_field("a:1"), [("x-token-hint", "1"), ("connection", "x-token-hint")],
                      removed)
    with pytest.raises(ValueError):
        encode_request_head("GET", "/a", "a:1", [("connection", "x-token-hint")], removed, has_body=False)
    # Naming only fields that are dropped anyway is no reason to refuse.
    assert request_block("GET", "/a", authority_field("a:1"),
                         [("connection", "keep-alive"), ("x-token-hint", "1")], removed) == plain


async def test_asserted_identities_and_token_requests_never_share_a_connection(backend) -> None:
    b, client = backend
    for identity in (True, False, True, False):
        await read_all(await send(client, get("/who"), identity=identity))
    assert b.connections == 2
    assert b.peer_certs[0] and not b.peer_certs[1]  # the front-proxy certificate only on the identity one


async def test_a_header_block_larger_than_a_frame_goes_out_in_continuation_frames(backend) -> None:
    b, client = backend
    token = "Bearer " + "t" * 40000
    await read_all(await send(client, get("/big-head", [("authorization", token)])))
    assert b.requests[0]["authorization"] == token


async def test_head_gets_the_status_and_headers_and_no_body(backend) -> None:
    b, client = backend

    async def head(backend: Backend, peer: Peer, sid: int, headers: dict[str, str]) -> None:
        peer.conn.send_headers(sid, [(":status", "200"), ("content-length", "1234")], end_stream=True)
        peer.flush()

    b.script = head
    response = await send(client, get("/api/v1/namespaces", method="HEAD"))
    assert response.status == 200 and ("content-length", "1234") in response.headers
    assert await read_all(response) == b""
    assert b.requests[0][":method"] == "HEAD"


@pytest.mark.parametrize("fields", [
    [(b"content-type", b"x")],
    [(b"content-type", b"x"), (b":status", b"200")],
    [(b":status", b"200"), (b":status", b"200")],
    [(b":status", b"200"), (b":path", b"/")],
    [(b":status", b"20")],
    [(b":status", b"099")],
    [(b":status", b"2x0")],
])
def test_a_response_head_without_one_valid_leading_status_is_refused(fields: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(ValueError):
        response_head(fields)


def test_a_response_head_gives_its_status_and_regular_fields() -> None:
    assert response_head([(b":status", b"404"), (b"a", b"1")]) == (404, [(b"a", b"1")])
