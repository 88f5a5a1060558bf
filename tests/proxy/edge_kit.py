"""In-process attack bench: the real TLS listener and pipeline in front of an echoing HTTP/1.1 backend.

The backend is a raw TLS server driven by h11, so it records each request
line byte for byte (an aiohttp app would hand over a normalised URL) and
can misbehave on purpose: ``/die`` closes without answering, ``/slow``
answers after ``slow_seconds``, ``/big`` streams ``big_bytes``, a target with
``watch=1`` sends one event and stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import orjson
from prometheus_client import REGISTRY

from gatekeeper.certs.pki import FRONT_PROXY_CA, PKI
from gatekeeper.kube import requestinfo
from gatekeeper.proxy.identity import auth
from gatekeeper.proxy.listen.server import ProxyServer
from gatekeeper.proxy.messages import ProxyRequest
from gatekeeper.proxy.pipeline.stages import Pipeline, build
from gatekeeper.proxy.settings import (
    BackendSettings,
    ListenerSettings,
    ProtocolSettings,
    ProxySettings,
    UpstreamSettings,
)


def fronted(request: ProxyRequest) -> ProxyRequest:
    """``request`` as the front stage hands it on (RequestInfo parsed, Connection-named headers dropped, the caller
    identified): what a test that drives the dispatcher alone must give it."""
    request.headers = auth.drop_connection_named(request.headers)
    request.info = requestinfo.parse(request.method, request.target)
    request.user = auth.identify(request.peer_cert, request.headers)
    return request


def rejected(reason: str) -> float:
    """``gatekeeper_proxy_rejected_total{reason}`` in this process (0 before the first)."""
    return REGISTRY.get_sample_value("gatekeeper_proxy_rejected_total", {"reason": reason}) or 0.0


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    """A response or request body of ``parts``."""
    for p in parts:
        yield p


def make_pki(directory: Path) -> PKI:
    pki = PKI(directory)
    pki.init()
    pki.issue_serving("proxy", dns=["localhost"], ips=["127.0.0.1"])
    pki.issue_serving("backend", ips=["127.0.0.1"])
    pki.issue_client("front-proxy-client", user="front-proxy-client", ca=FRONT_PROXY_CA)
    pki.issue_client("admin", user="admin", groups=["system:masters"])
    return pki


@dataclass
class Seen:
    target: bytes
    method: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""


@dataclass
class EchoBackend:
    """Raw TLS HTTP/1.1 backend that records request lines and answers with them as JSON."""

    pki: PKI
    front_proxy_ca: Path | None = None
    """CA for the proxy's client certificate (default: the PKI's front-proxy CA)."""
    seen: list[Seen] = field(default_factory=list)
    client_serials: list[int] = field(default_factory=list)
    """Serial number of the client certificate of each connection (0: none)."""
    connections: int = 0
    slow_seconds: float = 5.0
    big_bytes: int = 32 << 20
    server: asyncio.Server | None = None
    port: int = 0
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> str:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.pki.cert_path("backend"), self.pki.key_path("backend"))
        ctx.load_verify_locations(self.front_proxy_ca or self.pki.cert_path(FRONT_PROXY_CA))
        ctx.verify_mode = ssl.CERT_OPTIONAL
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=ctx)
        self.port = int(self.server.sockets[0].getsockname()[1])
        return f"https://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def paths(self) -> list[bytes]:
        return [s.target for s in self.seen if s.target != b"/readyz"]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        peer = writer.get_extra_info("peercert") or {}
        self.client_serials.append(int(peer.get("serialNumber", "0"), 16))
        conn = h11.Connection(h11.SERVER)
        current: Seen | None = None
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    conn.receive_data(data)
                    if not data and conn.their_state is not h11.DONE:
                        return
                    continue
                if isinstance(event, h11.Request):
                    current = Seen(bytes(event.target), bytes(event.method), list(event.headers))
                    if current.target != b"/readyz":
                        self.seen.append(current)
                elif isinstance(event, h11.Data) and current is not None:
                    current.body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage) and current is not None:
                    if not await self._answer(conn, writer, current):
                        return
                    conn.start_next_cycle()
                else:
                    return
        except (ConnectionError, OSError, h11.ProtocolError):
            return
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _answer(self, conn: h11.Connection, writer: asyncio.StreamWriter, seen: Seen) -> bool:
        if seen.target.startswith(b"/die"):
            writer.transport.abort()
            return False
        if b"watch=1" in seen.target:
            writer.write(conn.send(h11.Response(status_code=200, headers=[("content-type", "application/json")])))
            writer.write(conn.send(h11.Data(data=b'{"type":"ADDED","object":{}}\n')))
            await writer.drain()
            await asyncio.sleep(3600)  # an idle watch: open until the proxy or the test ends it
        if seen.target.startswith(b"/slow"):
            await asyncio.sleep(self.slow_seconds)
        if seen.target.startswith(b"/big"):
            writer.write(conn.send(h11.Response(status_code=200, headers=[("content-type", "text/plain")])))
            chunk = b"x" * (1 << 20)
            for _ in range(self.big_bytes >> 20):
                writer.write(conn.send(h11.Data(data=chunk)))
                await writer.drain()
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
            return True
        status = 403 if b"/forbidden" in seen.target else 200
        body = orjson.dumps({"target": seen.target.decode("latin-1"),
                             "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in seen.headers]})
        writer.write(conn.send(h11.Response(status_code=status, headers=[
            ("content-type", "application/json"), ("content-length", str(len(body)))])))
        writer.write(conn.send(h11.Data(data=body)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()
        return True


def proxy_settings(pki: PKI, backend_urls: list[str], *, protocol: dict[str, Any] | None = None,
                   upstream: dict[str, Any] | None = None) -> ProxySettings:
    return ProxySettings(
        listener=ListenerSettings(address="127.0.0.1", port=0, cert_file=str(pki.cert_path("proxy")),
                                  key_file=str(pki.key_path("proxy")), client_ca_file=str(pki.cert_path("ca")),
                                  cert_check_interval_seconds=0.0),
        protocol=ProtocolSettings(**(protocol or {})),
        backends=[BackendSettings(url=u, name=f"backend-{i}") for i, u in enumerate(backend_urls)],
        upstream=UpstreamSettings(
            ca_file=str(pki.cert_path("ca")), client_cert_file=str(pki.cert_path("front-proxy-client")),
            client_key_file=str(pki.key_path("front-proxy-client")), connect_timeout_seconds=2.0,
            health_interval_seconds=60, cert_check_interval_seconds=0.0, **(upstream or {}),
        ),
    )


@dataclass
class Bench:
    pki: PKI
    backend: EchoBackend
    pipeline: Pipeline
    server: ProxyServer

    @property
    def port(self) -> int:
        return self.server.port

    def client_ctx(self, cert: str | None = "admin", *, alpn: str = "http/1.1") -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.cert_path("ca")))
        ctx.set_alpn_protocols([alpn])
        if cert is not None:
            ctx.load_cert_chain(str(self.pki.cert_path(cert)), str(self.pki.key_path(cert)))
        return ctx

    async def open(self, cert: str | None = "admin") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port, ssl=self.client_ctx(cert),
                                             server_hostname="localhost")

    async def raw(self, data: bytes, *, cert: str | None = "admin", limit: float = 10.0) -> bytes:
        """Send raw bytes on a fresh TLS connection; everything the proxy sends until it closes."""
        reader, writer = await self.open(cert)
        writer.write(data)
        await writer.drain()
        out = b""
        try:
            async with asyncio.timeout(limit):
                while chunk := await reader.read(65536):
                    out += chunk
        finally:
            writer.close()
        return out


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0


def body_json(raw: bytes) -> Any:
    return orjson.loads(raw.split(b"\r\n\r\n", 1)[1])


@contextlib.asynccontextmanager
async def bench(pki: PKI, *, backends: int = 1, protocol: dict[str, Any] | None = None,
                upstream: dict[str, Any] | None = None, extra_urls: list[str] | None = None,
                ) -> AsyncIterator[Bench]:
    backend = EchoBackend(pki)
    url = await backend.start()
    settings = proxy_settings(pki, [url, *(extra_urls or [])], protocol=protocol, upstream=upstream)
    pipeline = build(settings)
    server = ProxyServer(settings, pipeline.handler, close_delay=0.05)
    await server.start()
    try:
        yield Bench(pki, backend, pipeline, server)
    finally:
        await server.shutdown(drain_seconds=0.5)
        await pipeline.close()
        await backend.stop()
