"""The client-facing TLS listener: ALPN dispatch to h2/HTTP/1.1 and graceful shutdown.

Entry point for ``gatekeeper proxy`` (called from ``command.py``)::

    async def serve(settings: ProxySettings, handler: Handler, *,
                    ready: Callable[[int], None] | None = None) -> None

``serve`` binds ``listener.address:listener.port`` (TLS >= 1.2, ALPN ``h2`` and
``http/1.1`` on one port), calls ``ready(bound_port)`` once accepting, and
returns after SIGTERM (or SIGINT): stop accepting, GOAWAY every h2
connection (``Connection: close`` on the next response of every HTTP/1.1
connection), drain up to ``protocol.shutdownTimeoutSeconds``, cut what is
left, return. The caller then exits 0.

:class:`ProxyServer` is the same thing without signal handling, for tests and
embedding: ``port = await server.start()`` ... ``await server.shutdown()``.

Client certificates: with ``listener.clientCaFile`` set, the handshake asks
for a certificate (``CERT_OPTIONAL``, as kube-apiserver does: token and
anonymous clients still connect) and verifies any presented certificate
against that CA; a verified certificate reaches the pipeline as
``ProxyRequest.peer_cert``. An untrusted certificate fails the handshake.

This module only moves bytes; protocol logic lives in ``h2.py``/``h1.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import signal
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gatekeeper.proxy import conn_metrics
from gatekeeper.proxy.adapter import ClientGone
from gatekeeper.proxy.h1 import H1Connection
from gatekeeper.proxy.h2 import H2Protocol
from gatekeeper.proxy.messages import Handler
from gatekeeper.proxy.settings import ListenerSettings, ProxySettings

log = logging.getLogger("gatekeeper.proxy.server")

READ_SIZE = 65536
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a client gets to finish the TLS handshake."""
H2_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"
"""TLS 1.2 suites RFC 9113 9.2.2 allows (AEAD, ephemeral key exchange); every TLS 1.3 suite is fine."""


def make_ssl_context(listener: ListenerSettings) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    ctx.set_ciphers(H2_CIPHERS)
    ctx.load_cert_chain(listener.cert_file, listener.key_file)
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    if listener.client_ca_file:
        ctx.load_verify_locations(cafile=listener.client_ca_file)
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


@dataclass(eq=False)
class _Client:
    id: int
    protocol: str
    h2: H2Protocol | None = None
    h1: H1Connection | None = None
    task: asyncio.Task[None] | None = None


class ProxyServer:
    """The TLS listener and its client connections."""

    def __init__(
        self,
        settings: ProxySettings,
        handler: Handler,
        *,
        rng: Callable[[], float] = random.random,
        close_delay: float = 1.0,
    ) -> None:
        settings.listener.validate()
        settings.protocol.validate()
        self._settings = settings
        self._handler = handler
        self._rng = rng
        self._close_delay = close_delay
        self._ssl = make_ssl_context(settings.listener)
        self._server: asyncio.Server | None = None
        self._clients: dict[int, _Client] = {}
        self._ids = itertools.count(1)
        self._stopping = False
        self.port = 0

    @property
    def connections(self) -> int:
        return len(self._clients)

    async def start(self) -> int:
        lst = self._settings.listener
        self._server = await asyncio.start_server(
            self._on_client, lst.address, lst.port, ssl=self._ssl, ssl_handshake_timeout=HANDSHAKE_TIMEOUT,
            backlog=1024, reuse_port=lst.reuse_port or None,
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def shutdown(self, drain_seconds: float | None = None) -> None:
        """Stop accepting, GOAWAY everyone, wait up to ``drain_seconds`` for streams to finish, then cut."""
        timeout = self._settings.protocol.shutdown_timeout_seconds if drain_seconds is None else drain_seconds
        self._stopping = True
        if self._server is not None:
            self._server.close()
        clients = list(self._clients.values())
        log.info("shutting down: %d client connections to drain (up to %.0fs)", len(clients), timeout)
        for client in clients:
            if client.h2 is not None:
                client.h2.goaway("shutdown", drain_timeout=timeout)
            elif client.h1 is not None:
                client.h1.shutdown()
        tasks = [c.task for c in clients if c.task is not None]
        if tasks:
            # h2 connections cut themselves at the deadline and close close_delay later.
            _, pending = await asyncio.wait(tasks, timeout=timeout + self._close_delay + 1.0)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=2.0)

    # ------------------------------------------------------------------ per connection

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ssl_obj = writer.get_extra_info("ssl_object")
        alpn = ssl_obj.selected_alpn_protocol() if ssl_obj is not None else None
        protocol = "h2" if alpn == "h2" else "http/1.1"
        peername = writer.get_extra_info("peername")
        peer = f"{peername[0]}:{peername[1]}" if peername else ""
        peer_cert: dict[str, Any] | None = None
        if ssl_obj is not None and self._settings.listener.client_ca_file:
            peer_cert = ssl_obj.getpeercert() or None  # only a verified certificate is returned
        client = _Client(next(self._ids), protocol, task=asyncio.current_task())
        if self._stopping:
            writer.close()
            return
        self._clients[client.id] = client
        conn_metrics.CLIENT_CONNECTIONS.labels(protocol=protocol).inc()
        conn_metrics.CLIENT_CONNECTIONS_ACCEPTED.labels(protocol=protocol).inc()
        try:
            if protocol == "h2":
                await self._run_h2(client, reader, writer, peer, peer_cert)
            else:
                client.h1 = H1Connection(
                    self._handler, self._settings.protocol, reader, writer, peer=peer, peer_cert=peer_cert,
                    connection_id=client.id, rng=self._rng,
                )
                await client.h1.run()
        except (ConnectionError, OSError) as exc:
            log.debug("connection %d from %s ended: %s", client.id, peer, exc)
        finally:
            conn_metrics.CLIENT_CONNECTIONS.labels(protocol=protocol).dec()
            self._clients.pop(client.id, None)
            writer.close()

    async def _run_h2(
        self, client: _Client, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
        peer: str, peer_cert: dict[str, Any] | None,
    ) -> None:
        def write(data: bytes) -> None:
            if not writer.is_closing():
                writer.write(data)

        async def drain() -> None:
            try:
                await writer.drain()
            except (ConnectionError, OSError) as exc:
                raise ClientGone(f"client socket failed: {exc}") from exc

        proto = H2Protocol(
            self._handler, self._settings.protocol, write=write, drain=drain, close=writer.close,
            peer=peer, peer_cert=peer_cert, connection_id=client.id, rng=self._rng,
            close_delay=self._close_delay,
        )
        client.h2 = proto
        proto.start()
        if self._stopping:
            proto.goaway("shutdown", drain_timeout=0)
        try:
            while not proto.closed.is_set():
                data = await reader.read(READ_SIZE)
                if not data:
                    break
                proto.data_received(data)
        except (ConnectionError, OSError):
            pass
        finally:
            proto.connection_lost()


async def serve(
    settings: ProxySettings,
    handler: Handler,
    *,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain gracefully and return (see the module docstring)."""
    server = ProxyServer(settings, handler)
    port = await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    log.info("listening on %s:%d (h2, http/1.1)", settings.listener.address, port)
    if ready is not None:
        ready(port)
    try:
        await stop.wait()
        log.info("signal received: draining")
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await server.shutdown()
