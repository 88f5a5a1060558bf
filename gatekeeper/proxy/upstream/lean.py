"""The HTTP/1.1 client under the request path: one asyncio Protocol per pooled connection, llhttp parsing, and the
round trip over them.

Reading pauses while more than :data:`READ_HIGH` bytes wait, so a slow client slows the backend read. A connection is
reused only after a complete exchange; a response cut short is an error, never a truncated success; idle connections are
keyed by TLS context so a certificate connection never carries a token request; and nothing is re-sent (the backend may
have acted on the first copy). See docs/proxy/index.md."""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Callable
from typing import Any

import httptools

from gatekeeper.proxy.upstream import errors as up
from gatekeeper.proxy.upstream.exchange import ClientBody, StreamedBody
from gatekeeper.proxy.upstream.slots import BackendPool, OneWaiter

MAX_HEAD_BYTES = 256 * 1024
"""Largest response head accepted from a backend (status line plus headers)."""
READ_HIGH = 256 * 1024
"""Stop reading a backend while this much of its body waits for the consumer."""
IDLE_SECONDS = 15.0
"""An idle pooled connection older than this is closed, not reused (a backend closing sooner costs a 502 on
the request that raced the close, never a re-send)."""


class BackendProtocolError(ConnectionError):
    """The backend broke HTTP/1.1 (unparsable head, oversized head, bytes while idle)."""


_LOST_PARSER = httptools.HttpResponseParser(object())
"""What a lost connection holds instead of its own parser; never fed (no bytes come after the loss)."""


class Conn(OneWaiter, asyncio.Protocol):
    """One backend connection and the response being read on it."""

    final_1xx = 0
    """An interim status that is this request's answer (an upgrade's 101); any other 1xx is skipped."""

    def __init__(self, ctx: ssl.SSLContext, on_lost: Callable[[Conn], None]) -> None:
        self.ctx = ctx
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.timer: asyncio.TimerHandle | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.active = False
        self.waiter: asyncio.Future[None] | None = None
        self.drain_waiter: asyncio.Future[None] | None = None
        self.write_paused = False
        self.body_task: asyncio.Task[None] | None = None
        self.request_sent = True
        self._response(head_only=False)

    def _response(self, *, head_only: bool) -> None:
        self.head_only = head_only
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.interim = False
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.reading_paused = False

    def begin(self, head: bytes, *, head_only: bool, header_timeout: float | None) -> None:
        """Start an exchange: reset the response state and write the request head (one write). ``header_timeout`` arms
        one timer, cheaper than an ``asyncio.timeout`` scope per request."""
        self._response(head_only=head_only)
        self.active = True
        if self.closed:  # lost between its connect and now: connection_lost saw no exchange to fail
            self.error = ConnectionResetError("the backend closed the connection")
            return
        if header_timeout is not None:
            self.timer = self.loop.call_later(header_timeout, self._header_timeout)
        assert self.transport is not None
        self.transport.write(head)

    def _header_timeout(self) -> None:
        self.timer = None
        if not self.headers_done:
            self._fail(TimeoutError("no response head in time"))

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.active:
            # A backend talking while no request is out: nothing sane can follow on this connection.
            self._fail(BackendProtocolError("bytes from the backend on an idle connection"))
            return
        if not self.headers_done:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as switch:
            self._switched(data[switch.args[0]:])
        except httptools.HttpParserError as exc:
            self._fail(BackendProtocolError(f"malformed response: {exc}"))
        else:
            # Counted per read, not per header (see on_headers_complete for the exact check).
            if not self.headers_done and self.head_bytes > MAX_HEAD_BYTES:
                self._fail(BackendProtocolError(f"response head over {MAX_HEAD_BYTES} bytes"))

    def _switched(self, rest: bytes) -> None:
        """The backend switched protocols; ``rest`` is what followed its head (only an upgrade expects that)."""
        self._fail(BackendProtocolError("unexpected protocol switch"))

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost decides what the EOF means

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.active and not self.complete and self.error is None:
            if self.headers_done and exc is None and self._framed_by_close():
                self.complete = True  # the body was framed by the end of the connection
            else:
                self.error = exc or ConnectionResetError("the backend closed the connection")
        self.wake()
        drain, self.drain_waiter = self.drain_waiter, None
        if drain is not None and not drain.done():
            drain.set_exception(ConnectionResetError("the backend closed the connection"))
        self.on_lost(self)
        # The parser calls back into us (a cycle): nothing is parsed after the loss, so let it go, and this
        # connection's buffers go with its last reference instead of at the next full garbage collection.
        self.parser = _LOST_PARSER

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        drain, self.drain_waiter = self.drain_waiter, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    # --- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            # A second response to one request: answering it to the next request would desync.
            raise BackendProtocolError("more than one response to a request")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != self.final_1xx:
            # An interim response (we never send Expect, but a backend may): skip it whole.
            self.interim = True
            self.raw_headers = []
            self.head_bytes = 0
            return
        if self.head_bytes > MAX_HEAD_BYTES and (
                sum(len(k) + len(v) + 4 for k, v in self.raw_headers) > MAX_HEAD_BYTES):
            # The reads so far were over the limit; only then are the head's own bytes counted.
            raise BackendProtocolError(f"response head over {MAX_HEAD_BYTES} bytes")
        self.status = status
        self.headers_done = True
        timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()
        if self.head_only:
            # llhttp cannot be told the request was HEAD; the connection is closed after it.
            self.complete = True
        self.wake()

    def _framed_by_close(self) -> bool:
        """The body ends with the connection; asked only when a connection ends mid-response (not on the hot path)."""
        if self.status in (204, 304):
            return False
        return not any(name.lower() in (b"content-length", b"transfer-encoding") for name, _ in self.raw_headers)

    def on_body(self, data: bytes) -> None:
        if self.head_only:
            return
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > READ_HIGH and not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()
        self.wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        if self.head_only:
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self.wake()

    # --- for the consumer ---------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self.abort()
        self.wake()

    def take(self) -> bytes:
        """Everything buffered, as one chunk (one write to the client instead of several)."""
        chunks = self.chunks
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()
        return chunk

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("the backend closed the connection")
        if self.write_paused:
            self.drain_waiter = self.loop.create_future()
            await self.drain_waiter

    def abort(self) -> None:
        timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = True
        task, self.body_task = self.body_task, None
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()


class Pool(BackendPool):
    """Connections to one backend for one kind of request (short or long-running)."""

    conn_class: type[Conn] = Conn

    def __init__(self, host: str, port: int, *, limit: int, connect_timeout: float) -> None:
        super().__init__(host, port, limit=limit, connect_timeout=connect_timeout)
        self.limit = limit
        self.idle: dict[ssl.SSLContext, list[Conn]] = {}
        self.open = 0

    def _lost(self, conn: Conn) -> None:
        self.open -= 1

    def _idle_list(self, ctx: ssl.SSLContext, live: Callable[[], tuple[Any, ...]]) -> list[Conn] | None:
        """The idle connections kept for ``ctx``; None when ``ctx`` is seen for the first time (a reload)."""
        idle = self.idle.get(ctx)
        if idle is None:
            # A context seen for the first time: contexts replaced by a reload are dropped with their sockets.
            current = live()
            for stale in [c for c in self.idle if c not in current]:
                for conn in self.idle.pop(stale):
                    conn.abort()
            self.idle[ctx] = []
        return idle

    def take_idle(self, ctx: ssl.SSLContext, live: Callable[[], tuple[Any, ...]]) -> Conn | None:
        """The most recently used idle connection made with ``ctx`` (LIFO keeps the pool warm and small)."""
        idle = self._idle_list(ctx, live)
        if idle is None:
            return None
        now = time.monotonic()
        while idle and (idle[0].closed or now - idle[0].idle_since > IDLE_SECONDS):
            idle.pop(0).abort()
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    async def connect(self, ctx: ssl.SSLContext) -> Conn:
        """A new connection; :class:`ConnectFailed` when it cannot be made."""
        conn = self.conn_class(ctx, self._lost)
        await self._dial(conn, ctx)
        self.open += 1
        return conn

    def adopt(self, transport: asyncio.Transport, ctx: ssl.SSLContext, live: Callable[[], tuple[Any, ...]]) -> None:
        """Keep a fresh TLS connection (nothing sent yet) as an idle one for ``ctx``.

        A backend that picked HTTP/1.1 in the HTTP/2 pool's ALPN has just completed a handshake the request can use.
        ``ctx`` comes from the same reload as the connection's context, so certificate and token connections never mix;
        a stale ``ctx``, or a full pool, closes the connection instead."""
        if ctx not in live():
            transport.close()
            return
        idle = self._idle_list(ctx, live)
        if idle is None:
            idle = self.idle[ctx]
        if self.open >= self.limit or len(idle) >= self.limit:
            transport.close()
            return
        conn = Conn(ctx, self._lost)
        transport.set_protocol(conn)
        conn.connection_made(transport)
        self.open += 1
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def put_back(self, conn: Conn) -> None:
        """Keep a connection for reuse if its exchange ended cleanly; close it otherwise."""
        conn.active = False
        idle = self.idle.get(conn.ctx)
        if (not (conn.complete and conn.keep_alive and conn.request_sent) or conn.closed or conn.head_only
                or conn.error is not None or idle is None or len(idle) >= self.limit):
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def close(self) -> None:
        for idle in self.idle.values():
            for conn in idle:
                conn.abort()
        self.idle.clear()


class BodyFramer:
    """A request body's bytes as they go upstream: raw within the declared Content-Length, else chunked. Shared by
    the round trip and the upgrade splice so no path writes a body unframed (request smuggling with the front-proxy
    certificate's trust). Over- or under-running the length raises ValueError."""

    __slots__ = ("declared", "sent")

    def __init__(self, declared: int | None) -> None:
        self.declared = declared
        self.sent = 0

    def frame(self, chunk: bytes) -> bytes:
        """The wire bytes for one non-empty chunk."""
        self.sent += len(chunk)
        declared = self.declared
        if declared is None:
            return b"%x\r\n%b\r\n" % (len(chunk), chunk)
        if self.sent > declared:
            raise ValueError(f"request body longer than its content-length {declared}")
        return chunk

    def end(self) -> bytes:
        """The bytes that end the body (the last chunk, or nothing); ValueError if it came up short."""
        if self.declared is None:
            return b"0\r\n\r\n"
        if self.sent != self.declared:
            raise ValueError(f"request body of {self.sent} bytes, content-length {self.declared}")
        return b""


async def _send_body(conn: Conn, body: ClientBody, declared: int | None) -> None:
    """Stream the client's body to the backend; any failure aborts the connection (the response side sees it)."""
    transport = conn.transport
    assert transport is not None
    framer = BodyFramer(declared)
    try:
        async for chunk in body:
            if chunk:
                transport.write(framer.frame(chunk))
                await conn.drain()
        if end := framer.end():
            transport.write(end)
        conn.request_sent = True
    except asyncio.CancelledError:
        conn.abort()
        raise
    except BaseException as exc:  # reported through the connection, never lost
        if body.error is None and isinstance(exc, ValueError):
            body.error = exc  # the client's body broke its own framing
        conn._fail(exc)


class LeanBody(StreamedBody):
    """A body on a pooled HTTP/1.1 connection: back to the pool when read whole, closed otherwise."""

    def __init__(self, conn: Conn, pool: Pool, name: str, *, swallow_errors: bool,
                 on_done: Callable[[BaseException | None], None]) -> None:
        super().__init__(conn, name, swallow_errors=swallow_errors, on_done=on_done)
        self.conn = conn
        self.pool = pool

    def _release(self, error: BaseException | None) -> None:
        if error is None:
            self.pool.put_back(self.conn)
        else:
            self.conn.abort()
        self.pool.slots.release()


async def round_trip(
    pool: Pool, name: str, ctx: ssl.SSLContext, live: Callable[[], tuple[object, ...]], head: bytes, *,
    method: str, body: ClientBody | None, declared: int | None, header_timeout: float | None,
    acquire_timeout: float, pool_name: str, swallow_body_errors: bool,
    on_done: Callable[[BaseException | None], None],
) -> tuple[int, list[tuple[bytes, bytes]], LeanBody]:
    """Send one request and wait for its response head; the body streams as it is pulled.

    Raises :class:`PoolTimeout` or :class:`ConnectFailed` when nothing was sent, :class:`UpstreamTimeout` without a head
    in time, :class:`ClientBodyFailed` when the client's body broke off, and :class:`BackendFailed` when the backend may
    have seen the request."""
    if not pool.slots.try_take():
        await pool.wait_for_slot(acquire_timeout, f"{pool_name} connection to {name}")
    conn: Conn | None = None
    try:
        conn = pool.take_idle(ctx, live)
        if conn is None:
            conn = await pool.connect(ctx)
        conn.begin(head, head_only=method == "HEAD", header_timeout=header_timeout)
        conn.request_sent = body is None
        if body is not None:
            conn.body_task = asyncio.create_task(_send_body(conn, body, declared))
        await conn.wait_head()
    except BaseException as exc:
        if conn is not None:
            conn.abort()
        pool.slots.release()
        if body is not None and body.error is not None:
            raise up.ClientBodyFailed(f"request body failed: {body.error}") from body.error
        if isinstance(exc, up.ConnectFailed):
            raise
        if isinstance(exc, TimeoutError):
            raise up.UpstreamTimeout(f"no response headers from {name} within {header_timeout:g}s") from exc
        if isinstance(exc, OSError):
            raise up.BackendFailed(f"{name}: {type(exc).__name__}") from exc
        raise
    return conn.status, conn.raw_headers, LeanBody(conn, pool, name, swallow_errors=swallow_body_errors,
                                                   on_done=on_done)
