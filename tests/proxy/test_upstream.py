"""Upstream forwarding through the pipeline against in-process TLS fake apiservers.

These are the fast tests (no control plane): header hygiene on the wire,
which TLS client certificate is presented, streaming without buffering,
retry-at-connect rules, mid-stream failure, lease accounting and upgrades.
The same behaviours are proven against real kube-apiservers in
``test_proxy_sandbox.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gatekeeper.certs.pki import FRONT_PROXY_CA, PKI
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse, close_body
from gatekeeper.proxy.pipeline.balancer import Balancer
from gatekeeper.proxy.pipeline.stages import Pipeline, build
from gatekeeper.proxy.settings import BackendSettings, ProxySettings, UpstreamSettings
from gatekeeper.proxy.upstream.client import BackendClient, PoolTimeout
from gatekeeper.proxy.upstream.hop_by_hop import KEEP_UPGRADE, response_headers
from gatekeeper.sandbox.processes import free_port

ADMIN_CERT = {"subject": ((("organizationName", "system:masters"),), (("commonName", "alice"),))}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    pki = PKI(tmp_path_factory.mktemp("pki"))
    pki.init()
    pki.issue_serving("backend", ips=["127.0.0.1"])
    pki.issue_client("front-proxy-client", user="front-proxy-client", ca=FRONT_PROXY_CA)
    return pki


def server_ssl(pki: PKI) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki.cert_path("backend"), pki.key_path("backend"))
    ctx.load_verify_locations(pki.cert_path(FRONT_PROXY_CA))
    ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


class FakeApiserver:
    """An aiohttp app that records what reached it and can stream, echo and die."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = 0
        app = web.Application()
        app.router.add_route("*", "/echo", self.echo)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/big", self.big)
        app.router.add_get("/api/v1/pods", self.pods)
        app.router.add_get("/die", self.die)
        self.app = app

    async def start(self, pki: PKI) -> str:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, ssl_context=server_ssl(pki))
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"https://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()

    def _record(self, request: web.Request) -> None:
        cert = request.transport.get_extra_info("peercert") if request.transport else None
        self.seen.append({"headers": list(request.headers.items()), "cert": cert, "path": request.path_qs})

    async def readyz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def echo(self, request: web.Request) -> web.Response:
        self._record(request)
        body = await request.read()
        return web.Response(body=body, headers={"Connection": "keep-alive, X-Hop", "X-Hop": "1",
                                                "Keep-Alive": "timeout=5", "X-End": "kept"})

    async def big(self, request: web.Request) -> web.StreamResponse:
        """64 MiB in 1 MiB chunks; waits after the first so the test sees streaming, not buffering."""
        resp = web.StreamResponse()
        await resp.prepare(request)
        chunk = b"x" * (1 << 20)
        await resp.write(chunk)
        await self.release.wait()
        for _ in range(63):
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def pods(self, request: web.Request) -> web.StreamResponse:
        """A watch (``?watch=1``) or list that is cut off by the server dying after one event."""
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"type":"ADDED","object":{}}\n')
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return resp

    async def die(self, request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.abort()
        return web.StreamResponse()


def settings_for(pki: PKI, urls: list[str]) -> ProxySettings:
    return ProxySettings(
        backends=[BackendSettings(url=u) for u in urls],
        upstream=UpstreamSettings(
            ca_file=str(pki.cert_path("ca")), client_cert_file=str(pki.cert_path("front-proxy-client")),
            client_key_file=str(pki.key_path("front-proxy-client")), connect_timeout_seconds=2.0,
            health_interval_seconds=60,
        ),
    )


async def body_of(resp: ProxyResponse) -> bytes:
    return b"".join([c async for c in resp.body])


def req(method: str, target: str, headers: list[tuple[str, str]] | None = None, *,
        body: AsyncIterator[bytes] | None = None, cert: dict[str, Any] | None = None,
        protocol: str = "h2") -> ProxyRequest:
    return ProxyRequest(method=method, target=target, headers=headers or [], body=body,
                        protocol=protocol, peer="127.0.0.1:5555", peer_cert=cert)  # type: ignore[arg-type]


@pytest.fixture
async def fake(pki: PKI) -> AsyncIterator[tuple[FakeApiserver, Pipeline]]:
    server = FakeApiserver()
    url = await server.start(pki)
    pipeline = build(settings_for(pki, [url]))
    yield server, pipeline
    await pipeline.close()
    await server.stop()


async def test_certificate_identity_is_stamped_and_front_proxy_cert_presented(fake: Any) -> None:
    server, pipeline = fake
    headers = [("x-remote-user", "mallory"), ("X-Remote-Group", "system:masters"),
               ("impersonate-user", "bob"), ("connection", "x-secret"), ("x-secret", "drop-me"),
               ("te", "trailers"), ("accept", "*/*")]
    resp = await pipeline.handler(req("GET", "/echo", headers, cert=ADMIN_CERT))
    assert resp.status == 200
    await body_of(resp)
    got = server.seen[-1]
    names = [k.lower() for k, _ in got["headers"]]
    values = [(k.lower(), v) for k, v in got["headers"]]
    assert ("x-remote-user", "alice") in values and ("x-remote-group", "system:masters") in values
    assert ("x-remote-user", "mallory") not in values
    assert ("impersonate-user", "bob") in values
    assert "x-secret" not in names and "te" not in names
    assert ("x-forwarded-for", "127.0.0.1") in values
    assert got["cert"] is not None, "front-proxy client certificate must be presented"
    assert dict(x[0] for x in got["cert"]["subject"])["commonName"] == "front-proxy-client"
    # response hop-by-hop headers (and those named in Connection) are gone, others kept
    rnames = [k for k, _ in resp.headers]
    assert "x-hop" not in rnames and "keep-alive" not in rnames and "connection" not in rnames
    assert ("x-end", "kept") in resp.headers


async def test_token_request_passes_untouched_without_client_cert(fake: Any) -> None:
    server, pipeline = fake
    headers = [("authorization", "Bearer abc"), ("x-remote-user", "admin")]
    resp = await pipeline.handler(req("GET", "/echo", headers))
    await body_of(resp)
    got = server.seen[-1]
    values = [(k.lower(), v) for k, v in got["headers"]]
    assert ("authorization", "Bearer abc") in values
    assert not any(k.startswith("x-remote-") for k, _ in values)
    assert not got["cert"], "token requests must not carry the front-proxy certificate"


async def test_request_body_streams_to_backend(fake: Any) -> None:
    _server, pipeline = fake

    async def gen() -> AsyncIterator[bytes]:
        for i in range(100):
            yield bytes([65 + i % 26]) * 10_000

    resp = await pipeline.handler(req("POST", "/echo", [("content-type", "application/json")], body=gen()))
    data = await body_of(resp)
    assert len(data) == 1_000_000 and data[:3] == b"AAA" and data[-1:] == bytes([65 + 99 % 26])


async def test_large_response_streams_without_buffering(fake: Any) -> None:
    server, pipeline = fake
    tracemalloc.start()
    try:
        resp = await pipeline.handler(req("GET", "/big"))
        first = await resp.body.__anext__()  # arrives while the backend still holds the other 63 MiB
        assert first
        server.release.set()
        total, peak_after_first = len(first), 0
        tracemalloc.reset_peak()
        async for chunk in resp.body:
            total += len(chunk)
        _, peak = tracemalloc.get_traced_memory()
        peak_after_first = peak
    finally:
        tracemalloc.stop()
    assert total == 64 << 20
    assert peak_after_first < 16 << 20, f"proxy held {peak_after_first} bytes while streaming 64 MiB"
    assert pipeline.balancer.backends[0].in_flight == 0


async def test_watch_cut_by_backend_ends_cleanly_and_list_raises(fake: Any) -> None:
    _server, pipeline = fake
    watch = await pipeline.handler(req("GET", "/api/v1/pods?watch=1"))
    assert pipeline.balancer.backends[0].watches == 1
    data = await body_of(watch)  # must not raise: client-go re-watches on a clean end
    assert data.startswith(b'{"type":"ADDED"')
    assert pipeline.balancer.backends[0].watches == 0
    listing = await pipeline.handler(req("GET", "/api/v1/pods"))
    with pytest.raises(ConnectionError):
        await body_of(listing)
    assert pipeline.balancer.backends[0].in_flight == 0


async def test_dropped_response_releases_lease_without_iteration(fake: Any) -> None:
    _server, pipeline = fake
    resp = await pipeline.handler(req("GET", "/echo"))
    assert pipeline.balancer.backends[0].in_flight == 1
    await resp.body.aclose()  # type: ignore[attr-defined]
    assert pipeline.balancer.backends[0].in_flight == 0


async def test_safe_request_moves_to_another_backend_after_connect_failure(pki: PKI) -> None:
    server = FakeApiserver()
    url = await server.start(pki)
    dead = f"https://127.0.0.1:{free_port()}"
    pipeline = build(settings_for(pki, [dead, url]))
    try:
        dead_backend = pipeline.balancer.backends[0]
        # Two equal backends: the power-of-two choice picks either at random, so send until the dead one has
        # been tried (a miss in 40 is 2**-40); every request must still succeed on the live one.
        for _ in range(40):
            resp = await pipeline.handler(req("GET", "/echo"))
            assert resp.status == 200
            await body_of(resp)
            if dead_backend.connect_failures_total:
                break
        assert dead_backend.connect_failures_total >= 1
        assert pipeline.balancer.health(dead_backend) == "ejected"
    finally:
        await pipeline.close()
        await server.stop()


async def test_a_reserved_apiserver_gets_the_request_and_its_connect_failure_is_not_retried_elsewhere(
        pki: PKI) -> None:
    """Flow control reserved the apiserver for an expensive LIST (``expensiveLists``): sending it to another
    would put one more there than its cap."""
    first, second = FakeApiserver(), FakeApiserver()
    urls = [await first.start(pki), await second.start(pki)]
    dead = f"https://127.0.0.1:{free_port()}"
    pipeline = build(settings_for(pki, [*urls, dead]))
    names = [b.name for b in pipeline.balancer.backends]
    try:
        for _ in range(4):
            r = req("GET", "/echo")
            r.reserved_backend = names[1]
            resp = await pipeline.handler(r)
            assert resp.status == 200
            await body_of(resp)
        assert len(second.seen) == 4 and not first.seen
        r = req("GET", "/echo")
        r.reserved_backend = names[2]
        resp = await pipeline.handler(r)
        assert resp.status == 503 and ("retry-after", "1") in resp.headers
        assert len(first.seen) + len(second.seen) == 4, "not sent on to an apiserver that was not reserved"
    finally:
        await pipeline.close()
        await first.stop()
        await second.stop()


async def test_unsafe_request_is_not_retried_but_gets_503_retry_after(pki: PKI) -> None:
    dead = f"https://127.0.0.1:{free_port()}"
    pipeline = build(settings_for(pki, [dead]))
    try:
        async def gen() -> AsyncIterator[bytes]:
            yield b"{}"

        resp = await pipeline.handler(req("POST", "/api/v1/namespaces/a/configmaps", body=gen()))
        assert resp.status == 503
        assert ("retry-after", "1") in resp.headers
        assert b'"reason":"ServiceUnavailable"' in await body_of(resp)
    finally:
        await pipeline.close()


async def test_backend_dropping_request_is_502_not_retried(fake: Any) -> None:
    _server, pipeline = fake
    resp = await pipeline.handler(req("GET", "/die"))
    assert resp.status == 502
    assert b"Status" in await body_of(resp)


async def test_probe_marks_backend_unready_and_back(pki: PKI) -> None:
    server = FakeApiserver()
    url = await server.start(pki)
    port = server.port
    pipeline = build(settings_for(pki, [url, f"https://127.0.0.1:{free_port()}"]))
    try:
        await pipeline.probe_once()
        await pipeline.probe_once()
        a, b = pipeline.balancer.backends
        assert pipeline.balancer.health(a) == "healthy" and pipeline.balancer.health(b) == "unready"
        await server.stop()
        await pipeline.probe_once()
        await pipeline.probe_once()
        assert pipeline.balancer.health(a) == "unready"
        assert not pipeline.ready()
        server2 = FakeApiserver()
        server2.port = port
        await server2.start(pki)
        await pipeline.probe_once()
        assert pipeline.balancer.health(a) == "healthy" and pipeline.ready()
        await server2.stop()
    finally:
        await pipeline.close()


async def test_the_proxys_own_calls_take_a_pool_of_their_own_and_a_bounded_answer(pki: PKI) -> None:
    """Probes, issuer keys and TokenReviews (``BackendClient.call``) present the front-proxy certificate, send
    their body whole and read the answer whole up to a bound; and they have their own pool, so a request pool
    that clients filled never makes a probe fail (that would eject a backend that is only busy)."""
    server = FakeApiserver()
    url = await server.start(pki)
    settings = replace(settings_for(pki, [url]).upstream, max_connections_per_backend=1,
                       pool_acquire_timeout_seconds=0.2)
    client = BackendClient("backend-0", url, settings)
    held: ProxyResponse | None = None
    try:
        status, data = await client.call("POST", "/echo", [("content-type", "application/json")], b'{"a":1}',
                                         deadline=5, max_bytes=1024)
        assert (status, data) == (200, b'{"a":1}')
        assert server.seen[-1]["cert"] is not None, "own calls assert the proxy's identity"
        held = await client.send(req("GET", "/big"), [], identity=False, swallow_body_errors=False,
                                 on_done=lambda _e: None)  # unread: it holds the one short-request connection
        with pytest.raises(PoolTimeout):
            await client.send(req("GET", "/readyz"), [], identity=False, swallow_body_errors=False,
                              on_done=lambda _e: None)
        assert await client.probe()
        with pytest.raises(ValueError, match="larger than 1024 bytes"):
            await client.call("GET", "/big", [], deadline=5, max_bytes=1024)
    finally:
        server.release.set()
        if held is not None:
            await close_body(held.body)
        await client.close()
        await server.stop()


async def upgrade_server(pki: PKI) -> tuple[asyncio.Server, int, list[bytes]]:
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        if b"forbidden" in head.split(b"\r\n")[0]:
            body = b'{"kind":"Status","code":403}'
            writer.write(b"HTTP/1.1 403 Forbidden\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        else:
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Protocol: v5.channel.k8s.io\r\n\r\n")
            while data := await reader.read(1024):
                writer.write(data.upper())
                await writer.drain()
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ssl(pki))
    return srv, srv.sockets[0].getsockname()[1], heads


async def test_upgrade_returns_spliceable_backend_connection(pki: PKI) -> None:
    srv, port, heads = await upgrade_server(pki)
    pipeline = build(settings_for(pki, [f"https://127.0.0.1:{port}"]))
    try:
        headers = [("connection", "Upgrade"), ("upgrade", "websocket"), ("sec-websocket-key", "k"),
                   ("x-remote-user", "admin")]
        resp = await pipeline.handler(req("GET", "/api/v1/namespaces/a/pods/p/exec?command=ls", headers,
                                          cert=ADMIN_CERT, protocol="http/1.1"))
        assert resp.status == 101 and resp.upgraded is not None
        assert ("upgrade", "websocket") in resp.headers
        assert ("sec-websocket-protocol", "v5.channel.k8s.io") in resp.headers
        assert pipeline.balancer.backends[0].watches == 1
        resp.upgraded.writer.write(b"hello")
        await resp.upgraded.writer.drain()
        assert await resp.upgraded.reader.readexactly(5) == b"HELLO"
        resp.upgraded.writer.close()
        assert resp.upgraded.on_close is not None
        await resp.upgraded.on_close()
        assert pipeline.balancer.backends[0].in_flight == 0
        head = heads[0].decode().lower()
        assert "x-remote-user: alice" in head and "x-remote-user: admin" not in head
        assert "upgrade: websocket" in head and "connection: upgrade" in head
        # a refused upgrade is an ordinary response
        resp = await pipeline.handler(req("GET", "/forbidden", headers, cert=ADMIN_CERT, protocol="http/1.1"))
        assert resp.status == 403 and resp.upgraded is None
        assert await body_of(resp) == b'{"kind":"Status","code":403}'
        assert pipeline.balancer.backends[0].in_flight == 0
    finally:
        await pipeline.close()
        srv.close()


def test_hop_by_hop_stripping_keeps_upgrade_only_when_asked() -> None:
    headers = [(b"Connection", b"upgrade, foo"), (b"upgrade", b"SPDY/3.1"), (b"foo", b"1"), (b"transfer-encoding",
               b"chunked"), (b"proxy-authorization", b"x"), (b"keep-alive", b"5"), (b"x-ok", b"1")]
    assert response_headers(headers) == [("x-ok", "1")]
    assert response_headers(headers, KEEP_UPGRADE) == [("connection", "upgrade, foo"),
                                                       ("upgrade", "SPDY/3.1"), ("x-ok", "1")]


async def test_a_protocol_switch_nobody_asked_for_is_a_502_never_a_tunnel(pki: PKI) -> None:
    srv, port, _heads = await upgrade_server(pki)  # answers 101 to anything
    pipeline = build(settings_for(pki, [f"https://127.0.0.1:{port}"]))
    try:
        resp = await pipeline.handler(req("GET", "/api/v1/pods", cert=ADMIN_CERT, protocol="http/1.1"))
        assert resp.status == 502 and resp.upgraded is None
        assert pipeline.balancer.backends[0].in_flight == 0
    finally:
        await pipeline.close()
        srv.close()


async def test_an_upgrade_answered_with_something_not_http_is_a_502(pki: PKI) -> None:
    async def ssh(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(ssh, "127.0.0.1", 0, ssl=server_ssl(pki))
    pipeline = build(settings_for(pki, [f"https://127.0.0.1:{srv.sockets[0].getsockname()[1]}"]))
    try:
        headers = [("connection", "Upgrade"), ("upgrade", "websocket"), ("sec-websocket-key", "k")]
        resp = await pipeline.handler(req("GET", "/api/v1/namespaces/a/pods/p/exec", headers, cert=ADMIN_CERT,
                                          protocol="http/1.1"))
        assert resp.status == 502 and resp.upgraded is None
        assert pipeline.balancer.backends[0].in_flight == 0 and pipeline.balancer.backends[0].watches == 0
    finally:
        await pipeline.close()
        srv.close()


def test_balancer_argument_is_used(pki: PKI, tmp_path: Path) -> None:
    settings = settings_for(pki, ["https://127.0.0.1:1"])
    bal = Balancer(settings.backends)
    assert build(settings, balancer=bal).balancer is bal


async def test_small_response_is_marked_exhausted_and_frees_its_connection_for_reuse(fake: Any) -> None:
    _server, pipeline = fake
    ends: list[BaseException | None] = []
    for _ in range(3):
        resp = await pipeline.handler(req("GET", "/readyz"))
        resp.on_complete.append(ends.append)
        body = resp.body
        chunk = await body.__anext__()
        assert chunk and getattr(body, "exhausted", False) is True
        # Released (lease and pooled connection) before the adapter even asks for more.
        assert pipeline.balancer.backends[0].in_flight == 0
        with pytest.raises(StopAsyncIteration):
            await body.__anext__()
        resp.finish(None)
    assert pipeline.upstream_connections(pipeline.balancer.backends[0].name) == 1, "keep-alive reuse"


async def test_upgrade_request_body_stops_being_read_while_the_backend_does_not_read_it(pki: PKI) -> None:
    """Backpressure on an upgrade's request body: a backend that reads nothing stops the client's upload.

    Before, every chunk was written without waiting, so the whole body (any Content-Length) sat in
    the proxy's memory.
    """
    held: list[asyncio.StreamWriter] = []

    async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        held.append(writer)  # the connection stays open, nothing more is read

    srv = await asyncio.start_server(never_reads, "127.0.0.1", 0, ssl=server_ssl(pki))
    port = srv.sockets[0].getsockname()[1]
    pipeline = build(settings_for(pki, [f"https://127.0.0.1:{port}"]))
    total, chunk = 64 << 20, b"x" * (64 << 10)
    pulled = 0

    async def upload() -> AsyncIterator[bytes]:
        nonlocal pulled
        while pulled < total:
            pulled += len(chunk)
            yield chunk

    headers = [("connection", "Upgrade"), ("upgrade", "websocket"), ("content-length", str(total))]
    task = asyncio.create_task(pipeline.handler(req("POST", "/api/v1/namespaces/a/pods/p/exec", headers,
                                                    body=upload(), cert=ADMIN_CERT, protocol="http/1.1")))
    try:
        async with asyncio.timeout(20):
            last = -1
            while pulled != last and not task.done():  # until the pulls stop (or everything was taken)
                last = pulled
                await asyncio.sleep(0.5)
        assert pulled < total // 2, f"{pulled} of {total} body bytes taken from the client"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for w in held:
            w.close()
        await pipeline.close()
        srv.close()


async def test_a_refused_upgrade_body_closed_unread_closes_its_backend_connection(pki: PKI) -> None:
    """HEAD, 204/304, or a client gone before the body: the body is closed before its first chunk. An async
    generator's finally does not run then: the lease was never given back (in_flight and watches stayed 1
    unless the adapter's finish() did it) and the connection, kept alive by the backend as Go's server does
    after a refused upgrade, was left to StreamWriter's finalizer."""
    hung_up = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b'{"kind":"Status","code":403}'
        writer.write(b"HTTP/1.1 403 Forbidden\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        with contextlib.suppress(OSError):
            while await reader.read(1024):
                pass
        hung_up.set()  # the proxy closed its side
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ssl(pki))
    pipeline = build(settings_for(pki, [f"https://127.0.0.1:{srv.sockets[0].getsockname()[1]}"]))
    keep: list[ProxyResponse] = []  # held, so the garbage collector cannot close it for us
    try:
        headers = [("connection", "Upgrade"), ("upgrade", "websocket"), ("sec-websocket-key", "k")]
        resp = await pipeline.handler(req("GET", "/forbidden", headers, cert=ADMIN_CERT, protocol="http/1.1"))
        keep.append(resp)
        assert resp.status == 403
        await asyncio.sleep(0.2)
        assert not hung_up.is_set()
        await close_body(resp.body)
        await asyncio.wait_for(hung_up.wait(), 5)
        assert pipeline.balancer.backends[0].in_flight == 0 and pipeline.balancer.backends[0].watches == 0
    finally:
        await pipeline.close()
        srv.close()
