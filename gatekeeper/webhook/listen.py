"""The webhook's listening socket: aiohttp's TCPSite plus the two bounds it lacks.

Any pod that reaches the Service can connect, not only the apiserver, so the
listener must not let a caller hold connections for free:

* ``tlsHandshakeTimeoutSeconds``: a TCP connection that never finishes its TLS
  handshake is dropped (asyncio's default is 60 s; TCPSite cannot set it) and
  counted (``reason="handshake-timeout"``); not while the delay is the worker's own
  (its loop stalled, or the client's bytes wait unread), up to 4 x the timeout
  (accept.py, ``gatekeeper/serving/tlshandshake.py``);
* ``maxConnections``: past that many open connections (per worker process), a
  new one is closed right after its handshake, before any request is read, and
  counted in ``gatekeeper_webhook_refused_connections_total{reason="connection-cap"}``.
  Handshakes still in progress are not counted; the handshake timeout bounds them.

* ``maxBufferedRequestBytes``: request heads (unfinished, queued behind a
  pipelined request, being answered, or the last one answered), the bodies of
  queued requests and the answers the client has not acknowledged, all
  connections of the worker together; over it the connection holding the most is
  closed and counted in ``...refused_connections_total{reason="request-budget"}``
  (:class:`MeteredRequestHandler`, request_budget.py).

* ``socketReceiveBufferBytes``: SO_RCVBUF of the connections, so that the TLS
  layer's buffers, which no budget sees, stay small (``LimitedSite.start``).

Idle connections and slow request heads are bounded by aiohttp's keep-alive
timeout (``idleTimeoutSeconds``, set on the runner), slow bodies by the
handler's ``bodyTimeoutSeconds`` (app.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct
import sys
from collections.abc import Awaitable, Callable
from itertools import islice
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import RawRequestMessage
from aiohttp.web_protocol import RequestHandler

from gatekeeper.serving.netbind import bind_listeners
from gatekeeper.webhook.accept import AcceptServer
from gatekeeper.webhook.request_budget import RequestBudget, UnfinishedHead, head_size

HANDSHAKE_CAP_PERIODS = 4
"""A handshake the worker itself held up may take this many ``tlsHandshakeTimeoutSeconds``, never more."""


class QuietClientErrors(logging.Logger):
    """aiohttp's per-connection logger, minus the ERROR and traceback for every malformed request.

    Any pod can send a bad chunk size or a broken request line, and aiohttp logs each one with
    ``logger.exception``: a log flood for the price of a connection. Malformed HTTP is the client's
    fault, so it is counted (``on_bad_request``) and logged at debug level; any other exception (a bug
    of ours) keeps its ERROR and traceback.
    """

    def __init__(self, on_bad_request: Callable[[], None]) -> None:
        super().__init__("aiohttp.server")
        self.parent = logging.getLogger("aiohttp.server")
        self.on_bad_request = on_bad_request

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            self.on_bad_request()
            self.debug("%s: %s", str(msg) % args if args else msg, exc)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


_TCP_INFO_BYTES_ACKED = struct.Struct("=Q")
"""``tcpi_bytes_acked`` (Linux >= 4.1) in ``struct tcp_info``, at offset 120: bytes the peer's kernel took."""
_TCP_INFO_LEN = 128


def bytes_acked(sock: Any) -> int | None:
    """Bytes of ours the peer has acknowledged on ``sock`` (a socket or asyncio's/uvloop's socket stand-in), or
    None where the kernel cannot say. What the client has not acknowledged is still ours: in the transport's
    buffers (TLS and TCP, uvloop's user-space ones included) or the kernel's send buffer."""
    if sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError, ValueError):
        return None
    if len(info) < _TCP_INFO_LEN:
        return None
    return int(_TCP_INFO_BYTES_ACKED.unpack_from(info, 120)[0])


class _Refuse(asyncio.Protocol):
    """A connection over the cap: closed as soon as it is handed over, nothing read or written."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.abort()


def _raw_bytes(payload: Any) -> int:
    """Body bytes as received that the parser fed into ``payload`` (compressed ones before inflating)."""
    raw = getattr(payload, "total_raw_bytes", None)  # aiohttp >= 3.12; total_bytes counts inflated bytes
    return int(payload.total_bytes if raw is None else raw)


class _Parsed:
    """One parsed request of a connection, until it is answered: its head, and its body while it is queued."""

    __slots__ = ("body", "head", "message", "started")

    def __init__(self, message: Any, head: int, body: int) -> None:
        self.message = message  # kept so that id(message) stays its key until it is answered
        self.head = head
        self.body = body
        self.started = False
        """Handed to a handler: body bytes from now on are the handler's (a review's BodyBudget)."""


class MeteredRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol, with what its parser holds counted in the worker's :class:`RequestBudget`.

    After each chunk the parser takes, the connection's total (its unfinished head, the heads of requests not
    answered yet, the bodies of requests still queued) is handed to the budget; the connections the budget names
    are aborted at once (no TLS close_notify, nothing written: an unfinished head has no request to answer, and
    a reset frees the memory now instead of after a flush the client may never take).
    """

    __slots__ = ("_acked", "_answered", "_bodies", "_budget", "_current", "_current_raw", "_evicted", "_heads",
                 "_on_evicted", "_parsed", "_sent", "_sock", "_unfinished", "_unsent")

    def __init__(self, manager: web.Server, *, budget: RequestBudget[MeteredRequestHandler],
                 on_evicted: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._budget = budget
        self._on_evicted = on_evicted
        self._unfinished = UnfinishedHead()
        self._parsed: dict[int, _Parsed] = {}
        self._heads = 0
        self._bodies = 0
        self._current: tuple[Any, _Parsed] | None = None
        """The last parsed request's payload (the only one the parser can still feed) and its entry."""
        self._current_raw = 0
        self._evicted = False
        self._sock: Any = None
        self._acked = 0
        """``bytes_acked`` when the connection was handed over (the TLS handshake's bytes)."""
        self._sent = 0
        """Response bytes handed to the transport (:meth:`will_write`), since the connection was handed over."""
        self._unsent = 0
        """Of those, the ones the client had not taken at the last count."""
        self._answered = 0
        """Head bytes of the request last answered, still held by aiohttp's request loop (in ``_heads``)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._sock = transport.get_extra_info("socket")
        self._acked = bytes_acked(self._sock) or 0

    def will_write(self, size: int) -> None:
        """A response of ``size`` bytes is about to be written: it counts in the budget until the client's kernel
        acknowledges it. uvloop's TLS transport moves a whole response into its TCP transport's buffer at once, so
        ``get_write_buffer_size()`` stays 0 and aiohttp never waits: 1000 connections that asked for a review with
        a 1 MiB uid (echoed in the answer) and never read took a worker to 3.8 GiB (bench_webhook_worstcase.py)."""
        if self._evicted:
            return
        self._sent += size
        self._unsent = self._sent  # an upper bound until the next count
        self._account()
    @property
    def unfinished_head_bytes(self) -> int:
        """The bound this connection holds for the head its parser is in the middle of (0 inside a body)."""
        return self._unfinished.held

    def data_received(self, data: bytes) -> None:
        if ((not data and self._current is None and self._unfinished.whole) or self._force_close or self._close
                or self._evicted or self._payload_parser is not None):
            # aiohttp's re-parse (b"", after every body read) with nothing left to parse, data aiohttp drops, or a
            # WebSocket (none here): nothing held changes.
            super().data_received(data)
            return
        messages = self._messages
        queued = len(messages)
        current = self._current
        super().data_received(data)
        body_before = 0
        if current is not None:
            raw = _raw_bytes(current[0])
            body_before = raw - self._current_raw
            self._current_raw = raw
            if not current[1].started:
                current[1].body += body_before
                self._bodies += body_before
        if not data and not body_before and len(messages) == queued:
            return  # aiohttp re-parsing what it held (after a pause) and finding nothing new: nothing changed
        heads: list[tuple[int, int]] = []
        broken = False
        end = self._unfinished.head_end(data) if len(messages) == queued + 1 else None  # the usual: one request
        for message, payload in islice(messages, queued, None):
            if not isinstance(message, RawRequestMessage):  # aiohttp's 400 for malformed HTTP: the parser is done
                broken = True
                continue
            body = _raw_bytes(payload)
            head = end if end is not None else head_size(message.method, message.path, message.raw_headers)
            entry = _Parsed(message, head, body)
            self._parsed[id(message)] = entry
            heads.append((entry.head, body))
            self._heads += entry.head
            self._bodies += body
            current = (payload, entry)
            self._current_raw = body
        in_body = broken or (current is not None and not current[0].is_eof())
        self._current = current if in_body else None  # a finished body gets no more bytes
        paused = (getattr(self, "_reading_paused", False) or getattr(self, "_buffer_paused", False)
                  or self._upgraded)
        self._unfinished.fed(data, body_before, heads, in_body=in_body, whole_next=not (paused or broken),
                             exact=end is not None)
        self._account()

    def _account(self) -> None:
        if self._evicted:
            return
        if self._unsent:  # one getsockopt per response, at the next count: the client took it, or not yet
            acked = bytes_acked(self._sock)
            if acked is not None:
                self._unsent = max(0, self._sent - (acked - self._acked))
            else:  # no TCP_INFO: what the transport says it still holds (a lower bound)
                transport = self.transport
                self._unsent = transport.get_write_buffer_size() if transport is not None else 0
        for victim in self._budget.hold(self, self._unfinished.held + self._heads + self._bodies + self._unsent):
            victim._evict()

    def _evict(self) -> None:
        self._evicted = True
        self._on_evicted()
        transport = self.transport
        if transport is not None:
            transport.abort()
        self.force_close()
        self._drop_queued()

    async def _handle_request(self, request: web.BaseRequest, start_time: float | None,
                              request_handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
                              ) -> tuple[web.StreamResponse, bool]:
        key = id(getattr(request, "_message", None))  # Request.message is deprecated (aiohttp 3.14), same object
        entry = self._parsed.get(key)
        if entry is not None:  # its body is the handler's now; released in the budget at the next count
            entry.started = True
            self._bodies -= entry.body
            entry.body = 0
        if self._answered:  # the previous request's head is let go now (aiohttp's loop took this one)
            self._heads -= self._answered
            self._answered = 0
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            if entry is not None and self._parsed.pop(key, None) is entry:
                # Answered, but not let go: aiohttp's request loop keeps the request it last handled (its
                # ``message`` and ``request`` locals) while it waits for the next one, up to idleTimeoutSeconds.
                # Measured: 1000 connections that each sent one 254 KB head, read the answer and idled held
                # 750 KiB each (a worker at 820 MiB). So the head counts until the next request or the close.
                self._answered = entry.head
                self._account()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._evicted = True  # counts nothing from now on
        self._budget.drop(self)
        self._parsed.clear()
        self._current = None
        super().connection_lost(exc)
        self._drop_queued()

    def _drop_queued(self) -> None:
        """Free the requests still queued on a closed connection: they will never be answered, but aiohttp keeps
        them (heads and bodies) until the one being answered ends, up to ``writeTimeoutSeconds`` for a client that
        stopped reading (measured: 18 closed connections still held 565 parsed requests). Its handler loop stops at
        ``_force_close`` after the request in hand; the one exception is a loop already woken for the next request
        and not yet run, which takes the first from the queue without looking, so that one stays."""
        waiter = self._waiter
        keep = 1 if waiter is not None and waiter.done() and not waiter.cancelled() else 0
        while len(self._messages) > keep:
            self._messages.pop()


class ConnectionCap:
    """Protocol factory in front of aiohttp's: a new connection over ``limit`` open ones gets :class:`_Refuse`.

    aiohttp's server keeps one handler per open connection (``connections``), so that is the count;
    no second bookkeeping can drift from it. Each accepted connection gets a :class:`MeteredRequestHandler` on
    ``budget`` (aiohttp's own handler when None), built with the server's own arguments.
    """

    def __init__(self, server: web.Server, limit: int, on_refused: Callable[[], None],
                 budget: RequestBudget[MeteredRequestHandler] | None = None,
                 on_evicted: Callable[[], None] = lambda: None) -> None:
        self.server = server
        self.limit = limit
        self.on_refused = on_refused
        self.budget = budget
        self.on_evicted = on_evicted

    def __call__(self) -> asyncio.Protocol:
        if len(self.server.connections) >= self.limit:
            self.on_refused()
            return _Refuse()
        if self.budget is None:
            return self.server()
        # web.Server.__call__ does the same with RequestHandler (its loop and keyword arguments are not public).
        server: Any = self.server
        return MeteredRequestHandler(self.server, budget=self.budget, on_evicted=self.on_evicted,
                                     loop=server._loop, **server._kwargs)


class LimitedSite(web.BaseSite):
    """A TCP site with a TLS handshake timeout, a connection cap and a request budget (see the module docstring)."""

    __slots__ = ("_address", "_budget", "_handshake_timeout", "_max_connections", "_on_accepted", "_on_evicted",
                 "_on_handshake_late", "_on_handshake_timeout", "_on_refused", "_port", "_receive_buffer")

    def __init__(self, runner: web.BaseRunner, address: str, port: int, *, ssl_context: ssl.SSLContext,
                 max_connections: int, handshake_timeout: float, on_refused: Callable[[], None],
                 max_buffered_request_bytes: int | None = None, on_evicted: Callable[[], None] = lambda: None,
                 on_handshake_timeout: Callable[[], None] = lambda: None,
                 on_handshake_late: Callable[[], None] = lambda: None, backlog: int = 2048,
                 receive_buffer: int = 0, on_accepted: Callable[[], None] = lambda: None) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._receive_buffer = receive_buffer
        self._address, self._port = address, port
        self._max_connections = max_connections
        self._handshake_timeout = handshake_timeout
        self._on_refused = on_refused
        self._budget: RequestBudget[MeteredRequestHandler] | None = (
            None if max_buffered_request_bytes is None else RequestBudget(max_buffered_request_bytes))
        self._on_evicted = on_evicted
        self._on_handshake_timeout = on_handshake_timeout
        self._on_handshake_late = on_handshake_late
        self._on_accepted = on_accepted

    @property
    def name(self) -> str:
        return f"https://{self._address}:{self._port}"

    @property
    def sockets(self) -> list[socket.socket]:
        # asyncio's Server and uvloop's (not a subclass of it) both have ``sockets``; AbstractServer does not.
        return list(getattr(self._server, "sockets", None) or ())

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert isinstance(server, web.Server)
        assert self._ssl_context is not None
        # Our own accept loop (accept.py), not create_server(ssl=...): the loop's handshake timer cut clients whose
        # TLS bytes waited unread while this worker was stalled.
        sockets = bind_listeners(self._address, self._port, reuse_port=True, backlog=self._backlog)
        if self._receive_buffer:
            # Accepted sockets inherit it. It bounds what the kernel queues for a connection, so what one read
            # hands to the TLS layer, whose buffers (uvloop's read buffer, OpenSSL's incoming BIO) keep the largest
            # size they reached for the connection's life: see ServerSettings.socket_receive_buffer_bytes.
            for sock in sockets:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._receive_buffer)
        self._server = AcceptServer(
            sockets, ConnectionCap(server, self._max_connections, self._on_refused, self._budget, self._on_evicted),
            self._ssl_context, period=self._handshake_timeout,
            max_seconds=HANDSHAKE_CAP_PERIODS * self._handshake_timeout, on_timeout=self._on_handshake_timeout,
            on_late=self._on_handshake_late, on_accepted=self._on_accepted)
