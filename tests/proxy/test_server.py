"""The TLS listener over real sockets on 127.0.0.1: ALPN, client certificates, graceful shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import sys
import textwrap
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest

from gatekeeper.certs.pki import PKI
from gatekeeper.proxy.listen.server import ProxyServer
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import ListenerSettings, ProtocolSettings, ProxySettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    pki = PKI(tmp_path_factory.mktemp("pki"))
    pki.init()
    pki.issue_serving("proxy", dns=["localhost"], ips=["127.0.0.1"])
    pki.issue_client("alice", user="alice", groups=["dev", "gpu-users"])
    other = PKI(pki.dir / "other")
    other.init()
    other.issue_client("mallory", user="mallory", groups=["system:masters"])
    return pki


def _settings(pki: PKI, *, client_ca: bool = True, **protocol: object) -> ProxySettings:
    listener = ListenerSettings(
        address="127.0.0.1", port=0,
        cert_file=str(pki.cert_path("proxy")), key_file=str(pki.key_path("proxy")),
        client_ca_file=str(pki.cert_path("ca")) if client_ca else "",
    )
    return ProxySettings(listener=listener, protocol=ProtocolSettings(**protocol))  # type: ignore[arg-type]


def _client_ctx(pki: PKI, cert: str | None = None, base: PKI | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.cert_path("ca")))
    if cert is not None:
        owner = base or pki
        ctx.load_cert_chain(str(owner.cert_path(cert)), str(owner.key_path(cert)))
    return ctx


def _subject_cn(cert: dict | None) -> str | None:
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                return str(v)
    return None


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def echo(req: ProxyRequest) -> ProxyResponse:
    total = 0
    if req.body is not None:
        async for c in req.body:
            total += len(c)
    body = orjson.dumps({"protocol": req.protocol, "target": req.target, "cn": _subject_cn(req.peer_cert),
                         "bytes": total, "host": req.header("host"), "conn": req.connection_id})
    return ProxyResponse(200, [("content-type", "application/json")], _chunks(body))


@pytest.fixture
async def running(pki: PKI):
    servers: list[ProxyServer] = []

    async def start(settings: ProxySettings, handler=echo) -> ProxyServer:
        server = ProxyServer(settings, handler, close_delay=0.05)
        await server.start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        await s.shutdown(drain_seconds=1)


@pytest.mark.parametrize(
    ("http2", "version", "protocol"), [(True, "HTTP/2", "h2"), (False, "HTTP/1.1", "http/1.1")]
)
async def test_alpn_serves_h2_and_http11_on_one_port(pki, running, http2, version, protocol):
    server = await running(_settings(pki))
    conns = set()
    async with httpx.AsyncClient(http2=http2, verify=_client_ctx(pki)) as client:
        for i in range(3):
            r = await client.post(f"https://127.0.0.1:{server.port}/api/v1/x{i}", content=b"q" * 70000)
            assert r.http_version == version
            got = r.json()
            assert got["protocol"] == protocol and got["target"] == f"/api/v1/x{i}" and got["bytes"] == 70000
            assert got["host"] == f"127.0.0.1:{server.port}"
            conns.add(got["conn"])
    assert len(conns) == 1  # all three requests reused one connection


async def test_verified_client_certificate_reaches_the_pipeline(pki, running):
    server = await running(_settings(pki))
    url = f"https://127.0.0.1:{server.port}/api"
    async with httpx.AsyncClient(http2=True, verify=_client_ctx(pki, "alice")) as client:
        assert (await client.get(url)).json()["cn"] == "alice"
    async with httpx.AsyncClient(http2=True, verify=_client_ctx(pki)) as client:  # token/anonymous client
        assert (await client.get(url)).json()["cn"] is None


async def test_untrusted_client_certificate_fails_the_handshake(pki, running):
    server = await running(_settings(pki))
    other = PKI(pki.dir / "other")
    ctx = _client_ctx(pki, "mallory", base=other)
    with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
        r, w = await asyncio.open_connection("127.0.0.1", server.port, ssl=ctx, server_hostname="127.0.0.1")
        # TLS 1.3 reports a rejected client certificate on the first read
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await w.drain()
        data = await asyncio.wait_for(r.read(100), 5)
        if not data:
            raise ConnectionError("closed")


async def test_without_client_ca_no_certificate_identity_is_passed(pki, running):
    server = await running(_settings(pki, client_ca=False))
    async with httpx.AsyncClient(http2=True, verify=_client_ctx(pki, "alice")) as client:
        assert (await client.get(f"https://127.0.0.1:{server.port}/")).json()["cn"] is None


async def test_tls_below_1_2_is_refused_and_1_2_works(pki, running):
    server = await running(_settings(pki))
    ctx12 = _client_ctx(pki)
    ctx12.maximum_version = ssl.TLSVersion.TLSv1_2
    _, w = await asyncio.open_connection("127.0.0.1", server.port, ssl=ctx12, server_hostname="127.0.0.1")
    assert w.get_extra_info("ssl_object").version() == "TLSv1.2"
    w.close()
    ctx11 = _client_ctx(pki)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # that is the point
            ctx11.minimum_version = ssl.TLSVersion.TLSv1
            ctx11.maximum_version = ssl.TLSVersion.TLSv1_1
        ctx11.set_ciphers("ALL:@SECLEVEL=0")
    except (ValueError, ssl.SSLError):
        pytest.skip("this OpenSSL cannot even offer TLS 1.1")
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await asyncio.open_connection("127.0.0.1", server.port, ssl=ctx11, server_hostname="127.0.0.1")


async def test_connection_metric_counts_by_protocol(pki, running):
    from prometheus_client import REGISTRY

    def gauge(p: str) -> float:
        return REGISTRY.get_sample_value("gatekeeper_proxy_client_connections", {"protocol": p}) or 0.0

    server = await running(_settings(pki))
    base = gauge("h2")
    async with httpx.AsyncClient(http2=True, verify=_client_ctx(pki)) as client:
        await client.get(f"https://127.0.0.1:{server.port}/")
        assert gauge("h2") == base + 1
    for _ in range(100):
        if gauge("h2") == base:
            break
        await asyncio.sleep(0.02)
    assert gauge("h2") == base


SLOW_SERVER = textwrap.dedent(
    """
    import asyncio, sys
    from gatekeeper.proxy.messages import ProxyResponse
    from gatekeeper.proxy.listen.server import serve
    from gatekeeper.proxy.settings import ListenerSettings, ProtocolSettings, ProxySettings

    async def slow(n, delay):
        for i in range(n):
            await asyncio.sleep(delay)
            yield b"chunk%d;" % i

    async def handler(req):
        if req.target.startswith("/slow"):
            return ProxyResponse(200, [], slow(8, 0.25))
        if req.target.startswith("/watch"):
            return ProxyResponse(200, [], slow(10**6, 0.1))
        return ProxyResponse(200, [], slow(1, 0))

    def ready(port):
        print(port, flush=True)

    settings = ProxySettings(
        listener=ListenerSettings(address="127.0.0.1", port=0, cert_file=sys.argv[1], key_file=sys.argv[2]),
        protocol=ProtocolSettings(shutdown_timeout_seconds=float(sys.argv[3])),
    )
    asyncio.run(serve(settings, handler, ready=ready))
    print("drained", flush=True)
    """
)


async def _start_process(pki: PKI, shutdown_timeout: float) -> tuple[asyncio.subprocess.Process, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SLOW_SERVER, str(pki.cert_path("proxy")), str(pki.key_path("proxy")),
        str(shutdown_timeout), stdout=asyncio.subprocess.PIPE, env=env,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    return proc, int(line)


async def _curl_h2(pki: PKI, url: str) -> asyncio.subprocess.Process:
    """curl (nghttp2) as the HTTP/2 client: unlike httpx/httpcore, which fails every in-flight
    stream when any GOAWAY arrives, it finishes streams below the GOAWAY's last stream id, as Go does."""
    return await asyncio.create_subprocess_exec(
        "curl", "--http2", "-sS", "-N", "--cacert", str(pki.cert_path("ca")), "-w", "\n%{http_version}", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )


async def test_sigterm_drains_inflight_slow_responses_and_exits_0(pki):
    proc, port = await _start_process(pki, shutdown_timeout=10)
    try:
        async with httpx.AsyncClient(http2=False, verify=_client_ctx(pki)) as h1c:
            h1_first = asyncio.Event()

            async def fetch_h1() -> bytes:
                async with h1c.stream("GET", f"https://127.0.0.1:{port}/slow") as r:
                    body = b""
                    async for chunk in r.aiter_bytes():
                        body += chunk
                        h1_first.set()
                    return body

            h1_task = asyncio.create_task(fetch_h1())
            curl = await _curl_h2(pki, f"https://127.0.0.1:{port}/slow")
            assert curl.stdout is not None
            first = await asyncio.wait_for(curl.stdout.readexactly(len(b"chunk0;")), 10)
            await asyncio.wait_for(h1_first.wait(), 10)
            proc.send_signal(signal.SIGTERM)
            h1_body = await asyncio.wait_for(h1_task, 20)
            rest, err = await asyncio.wait_for(curl.communicate(), 20)
        expected = b"".join(b"chunk%d;" % i for i in range(8))
        assert h1_body == expected
        assert curl.returncode == 0, err
        assert first + rest == expected + b"\n2"  # all of it, over HTTP/2
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        assert proc.stdout is not None
        assert b"drained" in await proc.stdout.read()
        with pytest.raises(ConnectionError):  # no longer accepting
            await asyncio.open_connection("127.0.0.1", port)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigterm_cuts_watches_at_the_shutdown_deadline(pki):
    proc, port = await _start_process(pki, shutdown_timeout=1.0)
    try:
        loop = asyncio.get_running_loop()
        curl = await _curl_h2(pki, f"https://127.0.0.1:{port}/watch")
        assert curl.stdout is not None
        await asyncio.wait_for(curl.stdout.readexactly(20), 10)
        t0 = loop.time()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        elapsed = loop.time() - t0
        await asyncio.wait_for(curl.communicate(), 10)
        assert curl.returncode != 0  # the watch was cut, not ended as if complete
        assert 0.9 <= elapsed < 10
    finally:
        for p in (proc, locals().get("curl")):
            if p is not None and p.returncode is None:
                p.kill()
                await p.wait()
