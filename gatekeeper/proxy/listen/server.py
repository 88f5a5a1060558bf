"""The client-facing TLS listener: ALPN dispatch to h2/HTTP/1.1 and graceful shutdown.

:func:`serve` runs until SIGTERM, then GOAWAYs, drains and returns; :class:`ProxyServer` is the same without signals,
for tests. Client certificates are ``CERT_OPTIONAL`` as in kube-apiserver (token and anonymous clients still connect).
The limits are in docs/proxy/limits.md. This module only moves bytes."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import logging
import random
import signal
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gatekeeper.proxy import rejections
from gatekeeper.proxy.adapter import ClientGone
from gatekeeper.proxy.handoff.inbox import Inbox
from gatekeeper.proxy.handoff.protocol import BACKLOG, RECEIVE_BACKOFF_MAX
from gatekeeper.proxy.listen import conn_metrics
from gatekeeper.proxy.listen.body_budget import RequestBodyBudget
from gatekeeper.proxy.listen.client_input import ClientProtocol
from gatekeeper.proxy.listen.h1 import H1Connection
from gatekeeper.proxy.listen.h2 import H2Protocol
from gatekeeper.proxy.listen.settings import ListenerSettings, ServedSettings
from gatekeeper.proxy.messages import Handler
from gatekeeper.serving.acceptloop import ACCEPT_BACKOFF, accept_forever
from gatekeeper.serving.netbind import bind_listeners
from gatekeeper.serving.tls import ReloadingTLS, server_context
from gatekeeper.serving.tlshandshake import handshake_within

log = logging.getLogger("gatekeeper.proxy.listen.server")
_receive_log = rejections.RateLimitedLog(log, rejections.LOG_INTERVAL)
"""A hand-off receive that keeps failing logs once per interval (and is counted every time)."""

H2_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"
"""TLS 1.2 suites RFC 9113 9.2.2 allows (AEAD, ephemeral key exchange); every TLS 1.3 suite is fine."""


def make_ssl_context(listener: ListenerSettings) -> ssl.SSLContext:
    ctx = server_context(listener.cert_file, listener.key_file, alpn=("h2", "http/1.1"))
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    ctx.set_ciphers(H2_CIPHERS)
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
        settings: ServedSettings,
        handler: Handler,
        *,
        rng: Callable[[], float] = random.random,
        close_delay: float = 1.0,
        handoff: Inbox | None = None,
    ) -> None:
        settings.listener.validate()  # for a server built without the loader
        settings.protocol.validate()
        self._settings = settings
        self._handler = handler
        self._rng = rng
        self._close_delay = close_delay
        self._body_budget = RequestBodyBudget(settings.protocol.max_buffered_request_bytes)
        """Shared by every HTTP/2 connection of this process (see ``body_budget``)."""
        lst = settings.listener
        self._ssl = ReloadingTLS(lambda: make_ssl_context(lst), [lst.cert_file, lst.key_file, lst.client_ca_file],
                                 what="proxy serving certificate and client CA",
                                 check_interval=lst.cert_check_interval_seconds).server_base()
        """Certificate and client CA follow the files (gatekeeper/serving/tls.py)."""
        self._sockets: list[socket.socket] = []
        self._accepters: list[asyncio.Task[None]] = []
        self._handshakes: set[asyncio.Task[None]] = set()
        """Connections still in their TLS handshake: a drain lets them finish and serves them; only those
        unfinished at the drain's end are cut."""
        self._clients: dict[int, _Client] = {}
        self._open = 0
        """Accepted TCP connections not yet closed, TLS handshakes included (listener.maxClientConnections)."""
        self._ids = itertools.count(1)
        self._stopping = False
        self._handoff = handoff
        """Connections come from the supervisor (``proxy/handoff/``) instead of a listening socket of ours."""
        self.handoff_ended = asyncio.Event()
        """The supervisor closed our hand-off socket: drain and exit, so it starts a successor. Serving on, the
        worker answered ``/readyz`` but never got a connection again."""
        self._receive_backoff = ACCEPT_BACKOFF
        """The next pause after a receive that failed and may pass (``handoff.RECEIVE_RETRY``)."""
        self.port = 0

    @property
    def connections(self) -> int:
        return len(self._clients)

    async def start(self) -> int:
        """Bind every address ``listener.address`` resolves to (one port) and start accepting; with a hand-off
        inbox nothing is bound."""
        lst = self._settings.listener
        loop = asyncio.get_running_loop()
        if self._handoff is not None:
            loop.add_reader(self._handoff.sock.fileno(), self._take_handoffs)
            self._handoff.announce()
            self.port = lst.port
            return self.port
        bind = functools.partial(bind_listeners, lst.address, lst.port, backlog=BACKLOG)
        self._sockets = await loop.run_in_executor(None, bind)
        self.port = int(self._sockets[0].getsockname()[1])
        # Our own loop, not start_server(ssl=...): over-cap connections close before any TLS work, and handshake
        # failures are counted; the TLS transport is still the loop's own.
        self._accepters = [loop.create_task(accept_forever(sock, self._admit, log=log,
                                                           stopping=lambda: self._stopping))
                           for sock in self._sockets]
        return self.port

    def _take_handoffs(self) -> None:
        assert self._handoff is not None
        loop = asyncio.get_running_loop()
        for conn in self._handoff.receive():
            self._admit(conn)
        error = self._handoff.error
        if error is not None:
            code = error.errno or 0
            conn_metrics.HANDOFF_RECEIVE_ERRORS.labels(errno.errorcode.get(code, str(code))).inc()
        if self._handoff.ended:  # the supervisor is exiting, or dropped us: nothing more will come
            loop.remove_reader(self._handoff.sock.fileno())
            if not self._stopping:
                # info: closing this end is how the supervisor stops its workers
                log.info("the supervisor closed this worker's hand-off socket (%s): draining and exiting; "
                         "it starts a successor unless it is exiting", error or "end of stream")
                self.handoff_ended.set()
        elif error is not None:
            # The kernel short of memory: read again later, never spin; meanwhile the supervisor passes us over.
            delay, self._receive_backoff = self._receive_backoff, min(2 * self._receive_backoff,
                                                                      RECEIVE_BACKOFF_MAX)
            _receive_log.warning("handoff_receive", "receiving a handed-over connection failed: %s; "
                                 "reading again in %.1fs", error, delay)
            self._pause_handoffs(delay)
        elif self._handoff.lost:
            # Out of descriptors: back off as an accept loop does on EMFILE, so our socket fills and the
            # supervisor passes us over; reading on, we would stay least loaded and lose every connection.
            rejections.reject("no_descriptors", "a handed-over connection was lost: out of file descriptors; "
                              "not taking connections for %.1fs", ACCEPT_BACKOFF)
            self._pause_handoffs(ACCEPT_BACKOFF)
        else:
            self._receive_backoff = ACCEPT_BACKOFF

    def _pause_handoffs(self, delay: float) -> None:
        """Read no hand-off for ``delay`` seconds: our socket fills and the supervisor passes us over."""
        assert self._handoff is not None
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._handoff.sock.fileno())
        loop.call_later(delay, self._resume_handoffs)

    def _resume_handoffs(self) -> None:
        if self._handoff is not None and not self._stopping:
            asyncio.get_running_loop().add_reader(self._handoff.sock.fileno(), self._take_handoffs)

    async def shutdown(self, drain_seconds: float | None = None) -> None:
        """Stop accepting, GOAWAY everyone, wait up to ``drain_seconds`` for streams to finish, then cut."""
        timeout = self._settings.protocol.shutdown_timeout_seconds if drain_seconds is None else drain_seconds
        self._stopping = True
        for task in self._accepters:
            task.cancel()
        for sock in self._sockets:
            sock.close()
        if self._handoff is not None and self._handoff.sock.fileno() >= 0:
            if not self._handoff.ended:
                asyncio.get_running_loop().remove_reader(self._handoff.sock.fileno())
            # Said and closed: the supervisor hands us nothing more while we drain and takes back what is still
            # queued for us, for another worker to serve.
            self._handoff.leave()
        clients = list(self._clients.values())
        log.info("shutting down: %d client connections to drain, %d in their TLS handshake (up to %.0fs)",
                 len(clients), len(self._handshakes), timeout)
        for client in clients:
            if client.h2 is not None:
                client.h2.goaway("shutdown", drain_timeout=timeout)
            elif client.h1 is not None:
                client.h1.shutdown()
        # Handshakes in progress are waited for, not cancelled: cancelled, the client read a TLS EOF mid-handshake.
        tasks = [c.task for c in clients if c.task is not None] + list(self._handshakes)
        if tasks:
            # h2 connections cut themselves at the deadline and close close_delay later.
            _, pending = await asyncio.wait(tasks, timeout=timeout + self._close_delay + 1.0)
            for task in pending:
                stage = "handshake" if task in self._handshakes else "serving"
                conn_metrics.DRAIN_CUT.labels(stage=stage).inc()
                task.cancel()
            if pending:
                log.warning("drain deadline: cut %d connection(s) still open (%d in their TLS handshake)",
                            len(pending), sum(1 for t in pending if t in self._handshakes))
                await asyncio.wait(pending, timeout=2.0)

    # ------------------------------------------------------------------ per connection

    def _admit(self, conn: socket.socket) -> None:
        """An accepted connection (ours or handed over): closed over the cap, else its TLS handshake starts."""
        if self._stopping or self._open >= self._settings.listener.max_client_connections:
            if not self._stopping:
                rejections.reject("connection_cap", "%d client connections open (maxClientConnections)",
                                  self._open)
            conn.close()
            self._closed()
            return
        self._open += 1
        task = asyncio.get_running_loop().create_task(self._handshake(conn))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    def _closed(self) -> None:
        if self._handoff is not None:
            self._handoff.closed()  # the supervisor's count of this worker's connections

    async def _handshake(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        lst, p = self._settings.listener, self._settings.protocol
        reader = asyncio.StreamReader()
        protocol = ClientProtocol(reader)
        try:
            try:
                transport = await handshake_within(loop, conn, lambda: protocol, self._ssl,
                                                   lst.tls_handshake_timeout_seconds, lst.tls_handshake_cap_seconds,
                                                   conn_metrics.TLS_HANDSHAKES_LATE.inc)
            except (ConnectionAbortedError, TimeoutError) as exc:  # ours, or the loop's own at the hard cap
                rejections.reject("handshake_timeout", "TLS handshake not done in %gs: %s",
                                    lst.tls_handshake_timeout_seconds, exc)
                return
            except (ssl.SSLError, OSError, EOFError) as exc:
                rejections.reject("handshake_failed", "TLS handshake failed: %s", exc)
                return
            self._handshakes.discard(asyncio.current_task())  # a client now: drained, not cancelled
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            try:
                transport.set_write_buffer_limits(high=p.write_buffer_high_bytes, low=p.write_buffer_low_bytes)
                await self._serve_client(reader, writer, protocol)
            finally:
                await self._close_writer(writer)
        finally:
            conn.close()  # no-op when the transport already closed it
            self._open -= 1
            self._closed()

    async def _close_writer(self, writer: asyncio.StreamWriter) -> None:
        """Close gracefully (TLS close_notify after pending output), but abort a client that is not reading."""
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), self._close_delay + 1.0)
        except (TimeoutError, ConnectionError, OSError, ssl.SSLError) as exc:
            # The error is also kept by the protocol's future and the reader; its traceback would hold this frame
            # (and wait_for's, which holds its task), which hold the writer, which holds them: a cycle.
            exc.__traceback__ = None
        finally:
            writer.transport.abort()  # no-op once closed; frees a non-reading client's buffers otherwise

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stream: ClientProtocol,
    ) -> None:
        ssl_obj = writer.get_extra_info("ssl_object")
        alpn = ssl_obj.selected_alpn_protocol() if ssl_obj is not None else None
        protocol = "h2" if alpn == "h2" else "http/1.1"
        peername = writer.get_extra_info("peername")
        peer = f"{peername[0]}:{peername[1]}" if peername else ""
        peer_cert: dict[str, Any] | None = None
        if ssl_obj is not None and self._settings.listener.client_ca_file:
            peer_cert = ssl_obj.getpeercert() or None  # only a verified certificate is returned
        client = _Client(next(self._ids), protocol, task=asyncio.current_task())
        if protocol != "h2":
            stream.attach_reader()
        # A handshake finished during a drain is answered like any client (GOAWAY or Connection: close): a silent
        # close left an EOF the client could not tell from a crash.
        self._clients[client.id] = client
        conn_metrics.CLIENT_CONNECTIONS.labels(protocol=protocol).inc()
        conn_metrics.CLIENT_CONNECTIONS_ACCEPTED.labels(protocol=protocol).inc()
        try:
            if protocol == "h2":
                await self._run_h2(client, stream, writer, peer, peer_cert)
            else:
                client.h1 = H1Connection(
                    self._handler, self._settings.protocol, reader, writer, peer=peer, peer_cert=peer_cert,
                    connection_id=client.id, rng=self._rng, draining=self._stopping,
                )
                await client.h1.run()
        except (ConnectionError, OSError) as exc:
            log.debug("connection %d from %s ended: %s", client.id, peer, exc)
        finally:
            conn_metrics.CLIENT_CONNECTIONS.labels(protocol=protocol).dec()
            self._clients.pop(client.id, None)
            # The record and the closures over it (drain, stalled) form a cycle with the connection: cut here, the
            # connection and its TLS buffers go when the last reference does, not at the next full collection.
            client.h2 = client.h1 = client.task = None

    async def _run_h2(
        self, client: _Client, stream: ClientProtocol, writer: asyncio.StreamWriter,
        peer: str, peer_cert: dict[str, Any] | None,
    ) -> None:
        transport = writer.transport

        def write(data: bytes) -> None:
            # The transport's own methods, not StreamWriter's wrappers of them: two Python frames less per write.
            if not transport.is_closing():
                transport.write(data)

        stall = self._settings.protocol.response_stall_timeout_seconds
        low = self._settings.protocol.write_buffer_low_bytes

        def stalled() -> None:
            rejections.reject("write_stall", "h2 connection %d from %s: output not read for %.0fs",
                                client.id, peer, stall)
            transport.abort()

        async def drain() -> None:
            """Senders wait here while our output to the client is over the high-water mark."""
            try:
                if transport.get_write_buffer_size() <= low:
                    await writer.drain()  # not paused: returns at once (the common, cheap case)
                else:
                    async with asyncio.timeout(stall):
                        await writer.drain()
            except TimeoutError:
                if not transport.is_closing():
                    stalled()
                raise ClientGone(f"client did not read for {stall:.0f}s") from None
            except (ConnectionError, OSError) as exc:
                raise ClientGone(f"client socket failed: {exc}") from exc

        self._body_budget.limit = self._settings.protocol.max_buffered_request_bytes  # after a reload too
        proto = H2Protocol(
            self._handler, self._settings.protocol, write=write, drain=drain, close=writer.close,
            peer=peer, peer_cert=peer_cert, connection_id=client.id, rng=self._rng,
            close_delay=self._close_delay, body_budget=self._body_budget,
        )
        client.h2 = proto
        proto.start()
        if self._stopping:
            proto.goaway("shutdown", drain_timeout=0)
        ended = asyncio.get_running_loop().create_future()

        def on_end() -> None:
            if not ended.done():
                ended.set_result(None)

        # From here input flows by callback (ClientProtocol); backpressure pauses reading.
        stream.attach_sink(proto.data_received, on_end, stalled, stall)
        closed = asyncio.ensure_future(proto.closed.wait())
        try:
            await asyncio.wait([ended, closed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            proto.connection_lost()


async def serve(
    settings: ServedSettings,
    handler: Handler,
    *,
    ready: Callable[[int], None] | None = None,
    stopping: Callable[[], None] | None = None,
    handoff: Inbox | None = None,
    supervised: bool = False,
) -> None:
    """Serve until SIGTERM/SIGINT (or until the supervisor closes ``handoff``), then drain and return.

    ``stopping`` runs as the signal arrives (``/readyz`` turns 503). ``supervised``: no later signal may stop the drain
    (the supervisor kills an overstaying worker); alone, a second signal ends a draining proxy."""
    server = ProxyServer(settings, handler, handoff=handoff)
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
    signalled = loop.create_task(stop.wait())
    ended = loop.create_task(server.handoff_ended.wait())
    try:
        await asyncio.wait([signalled, ended], return_when=asyncio.FIRST_COMPLETED)
        log.info("%s: draining", "signal received" if stop.is_set() else "the hand-off socket closed")
        if stopping is not None:
            stopping()
    finally:
        signalled.cancel()
        ended.cancel()
        # Draining keeps the handlers, then ignores the signals: a SIGTERM to the whole process group (systemd's
        # KillMode, Ctrl-C) landing during the drain or clean-up would otherwise kill the worker mid-drain
        # (exit -15). A hung worker is SIGKILLed by the supervisor as ever.
        keep = supervised or (server.handoff_ended.is_set() and not stop.is_set())
        if not keep:
            for sig in installed:
                loop.remove_signal_handler(sig)
        try:
            await server.shutdown()
        finally:
            for sig in installed if keep else ():
                # SIG_IGN over the loop's handler, left registered: removing it first restores the default action
                # (death) for a moment, and blocking the signal in this thread does not help (uvloop's threads
                # take it). uvloop's closed loop leaves the disposition alone.
                signal.signal(sig, signal.SIG_IGN)
