"""Shared HTTP/2 connections to one backend, and one exchange on them (see :mod:`mux`).

Connections are kept per TLS context and the oldest with room is filled first, so a backend sees one connection per
context per worker. The bounded retry of HTTP/2 after an HTTP/1.1 ALPN answer, the pause after a 401 and the fall-back
to HTTP/1.1 of a request refused twice are described in docs/proxy/index.md."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable

from gatekeeper.proxy.upstream.errors import BackendFailed, ConnectFailed, RequestResetByBackend, UpstreamTimeout
from gatekeeper.proxy.upstream.exchange import StreamedBody
from gatekeeper.proxy.upstream.mux import (
    IDLE_SECONDS,
    MAX_STREAM_ID,
    MuxConn,
    MuxStream,
    NotH2,
    Paused,
    Refused,
    StreamRefused,
    StreamReset,
)
from gatekeeper.proxy.upstream.slots import BackendPool

log = logging.getLogger("gatekeeper.proxy.upstream.mux_pool")

SENDS = 2
"""Times a request may go out as a stream (the second only if the first was provably not processed)."""


class _OpenerGone(Exception):
    """The request opening a connection was cancelled: the requests waiting on that connect try again."""


class MuxPool(BackendPool):
    """HTTP/2 connections to one backend; ``slots`` bounds its concurrent streams, as the HTTP/1.1 pool's."""

    def __init__(self, host: str, port: int, *, limit: int, max_streams: int, connect_timeout: float,
                 retry_seconds: float = 300.0, pause_seconds: float = 60.0,
                 on_goaway: Callable[[], None] = lambda: None, on_fallback: Callable[[], None] = lambda: None,
                 on_pause: Callable[[], None] = lambda: None, on_refused: Callable[[], None] = lambda: None) -> None:
        super().__init__(host, port, limit=limit, connect_timeout=connect_timeout)
        self.max_streams = max_streams
        self.conns: dict[ssl.SSLContext, list[MuxConn]] = {}
        self.opening: dict[ssl.SSLContext, asyncio.Future[MuxConn]] = {}
        self.on_goaway = on_goaway
        self.on_fallback = on_fallback
        self.h2 = True
        """False once the backend picked HTTP/1.1 in ALPN: the caller uses the HTTP/1.1 pool instead."""
        self.retry_seconds = retry_seconds
        self.retry_at = 0.0
        """When (monotonic) a backend known as HTTP/1.1 may be asked for HTTP/2 again."""
        self.attempt_granted = False
        """:meth:`wants_h2` granted an attempt at HTTP/2 that has not connected yet."""
        self.pause_seconds = pause_seconds
        self.paused: dict[ssl.SSLContext, float] = {}
        """Context -> when (monotonic) its pause after a 401 ends; empty on the hot path."""
        self.on_pause = on_pause
        self.on_refused = on_refused
        """A request refused on every stream attempt goes over HTTP/1.1 (:class:`mux.Refused`)."""

    def unauthorized(self, conn: MuxConn) -> None:
        """A stream on ``conn`` was answered 401: pause multiplexing for its context (see the module)."""
        now = time.monotonic()
        if self.paused.get(conn.ctx, 0.0) <= now:
            self.on_pause()
            log.warning("%s:%s answered 401 on a multiplexed stream (a token verified here was refused there, "
                        "so it sends GOAWAY): that kind of caller goes over HTTP/1.1 for %gs", self.host,
                        self.port, self.pause_seconds)
        self.paused[conn.ctx] = now + self.pause_seconds

    def is_paused(self, ctx: ssl.SSLContext) -> bool:
        until = self.paused.get(ctx)
        if until is None:
            return False
        if until > time.monotonic():
            return True
        del self.paused[ctx]
        return False

    def wants_h2(self) -> bool:
        """Whether an eligible request should go over HTTP/2: known to work, or a retry is due (this one). Called last,
        only for requests that may be multiplexed, so an ineligible one never takes the retry."""
        if self.h2:
            return True
        if not self.retry_seconds:
            return False
        now = time.monotonic()
        if now < self.retry_at:
            return False
        self.retry_at = now + self.retry_seconds
        self.attempt_granted = True
        return True

    def give_back(self) -> None:
        """The grant of :meth:`wants_h2` failed before connecting: the next eligible request asks instead of
        waiting out the interval. A no-op unless a grant is pending."""
        if self.attempt_granted:
            self.attempt_granted = False
            self.retry_at = 0.0

    def _lost(self, conn: MuxConn) -> None:
        conns = self.conns.get(conn.ctx)
        if conns is not None and conn in conns:
            conns.remove(conn)

    def open_connections(self) -> int:
        return sum(len(c) for c in self.conns.values())

    def _pick(self, ctx: ssl.SSLContext, live: Callable[[], tuple[object, ...]]) -> MuxConn | None:
        conns = self.conns.get(ctx)
        if conns is None:
            current = live()
            for stale in [c for c in self.conns if c not in current]:
                for conn in self.conns.pop(stale):
                    conn.close()  # contexts replaced by a reload: their connections finish and go
            for stale in [c for c in self.paused if c not in current]:
                del self.paused[stale]
            self.conns[ctx] = []
            return None
        now = time.monotonic()
        for conn in list(conns):
            if conn.closed:
                conns.remove(conn)
            elif not conn.streams and now - conn.idle_since > IDLE_SECONDS:
                conns.remove(conn)
                conn.close()
            elif (not conn.closed and conn.goaway is None and conn.codec.next_sid < MAX_STREAM_ID
                  and len(conn.streams) < min(conn.cap, conn.codec.peer_max_streams)):
                return conn  # room for one more stream
        return None

    async def conn(self, ctx: ssl.SSLContext, live: Callable[[], tuple[object, ...]]) -> MuxConn:
        """A connection with room for one more stream; ConnectFailed or NotH2 when none can be had."""
        while True:
            conn = self._pick(ctx, live)
            if conn is not None:
                return conn
            opening = self.opening.get(ctx)
            if opening is not None:
                try:
                    conn = await asyncio.shield(opening)
                except _OpenerGone:
                    pass  # the request connecting was cancelled, not this one: connect (or wait) anew
                continue  # the new connection is picked if it has room
            asking = not self.h2
            if asking:
                if not self.attempt_granted:  # found out while this request waited: nothing was sent
                    raise NotH2(f"{self.host}:{self.port} does not negotiate HTTP/2")
                self.attempt_granted = False  # taken: no other context's request connects meanwhile
            fut: asyncio.Future[MuxConn] = asyncio.get_running_loop().create_future()
            self.opening[ctx] = fut
            try:
                conn = await self._connect(ctx)
            except BaseException as exc:
                if asking and not isinstance(exc, NotH2):
                    self.retry_at = 0.0  # no ALPN answer came (connect failed, caller gone): not used up
                # Handed to the waiters, this request's CancelledError read as "client gone" in theirs.
                fut.set_exception(_OpenerGone() if isinstance(exc, asyncio.CancelledError) else exc)
                fut.exception()  # retrieved: waiters re-raise it, nobody else needs to
                # The error's traceback holds this frame: without the name the future would hold itself (a cycle
                # keeping this request and its callers' frames until a full garbage collection).
                del fut
                raise
            else:
                fut.set_result(conn)
            finally:
                del self.opening[ctx]
            self.conns.setdefault(ctx, []).append(conn)
            return conn

    async def _connect(self, ctx: ssl.SSLContext) -> MuxConn:
        conn = MuxConn(ctx, self.max_streams, self._lost, self.on_goaway, self.unauthorized)
        transport = await self._dial(conn, ctx)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is None or ssl_object.selected_alpn_protocol() != "h2":
            conn.closed = True
            was_h2, self.h2 = self.h2, False
            self.retry_at = time.monotonic() + self.retry_seconds
            self.on_fallback()
            (log.warning if was_h2 else log.debug)(
                "%s:%s did not negotiate HTTP/2: its multiplexed requests go over HTTP/1.1%s", self.host, self.port,
                f" (asked again every {self.retry_seconds:g}s)" if self.retry_seconds else "")
            handover: asyncio.Transport | None = None
            if not conn.lost and not conn.stray and not transport.is_closing():
                handover = transport
            else:
                transport.close()
            raise NotH2(f"{self.host}:{self.port} did not negotiate HTTP/2", handover)
        if not self.h2:
            self.h2 = True
            log.info("%s:%s negotiates HTTP/2 again: its short GETs are multiplexed", self.host, self.port)
        return conn

    def close(self) -> None:
        for conns in self.conns.values():
            for conn in conns:
                conn.close()
        self.conns.clear()


class MuxBody(StreamedBody):
    """A body on a shared HTTP/2 connection: a stream not read to its end is reset (RST_STREAM CANCEL)."""

    def __init__(self, stream: MuxStream, pool: MuxPool, name: str,
                 on_done: Callable[[BaseException | None], None]) -> None:
        super().__init__(stream, name, swallow_errors=False, on_done=on_done)  # never a watch
        self.stream = stream
        self.pool = pool

    def _release(self, error: BaseException | None) -> None:
        if error is not None or not self.stream.complete:
            self.stream.conn.cancel(self.stream)
        self.pool.slots.release()


async def exchange(
    pool: MuxPool, name: str, ctx: ssl.SSLContext, live: Callable[[], tuple[object, ...]],
    block: bytes, *, head_only: bool, header_timeout: float | None,
    acquire_timeout: float, on_done: Callable[[BaseException | None], None],
) -> tuple[int, list[tuple[bytes, bytes]], MuxBody]:
    """Send one bodiless request as a stream and wait for its head; the errors are :func:`lean.round_trip`'s. Raises
    :class:`NotH2`, :class:`Paused` or :class:`Refused` (nothing processed): use HTTP/1.1 instead."""
    if pool.paused and pool.is_paused(ctx):
        pool.give_back()
        raise Paused(f"{name}: multiplexing paused after a 401")
    slots = pool.slots
    if not slots.try_take():
        try:
            await pool.wait_for_slot(acquire_timeout, f"HTTP/2 stream to {name}")
        except BaseException:
            pool.give_back()
            raise
    stream: MuxStream | None = None
    try:
        for attempt in range(SENDS):
            if pool.paused and pool.is_paused(ctx):  # a 401 came while this request waited for a slot
                raise Paused(f"{name}: multiplexing paused after a 401")
            conn = await pool.conn(ctx, live)
            if pool.paused and pool.is_paused(ctx):  # a 401 came while this request waited for a connection
                raise Paused(f"{name}: multiplexing paused after a 401")
            stream = conn.start(block, head_only=head_only, header_timeout=header_timeout)
            try:
                await stream.wait_head()
            except StreamRefused:
                if pool.paused and pool.is_paused(ctx):  # not processed: HTTP/1.1, never a second stream
                    raise Paused(f"{name}: multiplexing paused after a 401") from None
                if attempt + 1 == SENDS:
                    pool.on_refused()
                    raise Refused(f"{name}: refused on {SENDS} streams (HTTP/2 GOAWAY or REFUSED_STREAM), "
                                  "not processed") from None
                continue
            break
    except BaseException as exc:
        if stream is not None:
            stream.conn.cancel(stream)
        slots.release()
        if not pool.h2:
            pool.give_back()  # a pending grant this request held, ended before connecting (slot, pause, cancel)
        if isinstance(exc, (ConnectFailed, NotH2)):  # NotH2 and its Paused and Refused: HTTP/1.1 next
            raise
        if isinstance(exc, TimeoutError):
            raise UpstreamTimeout(f"no response headers from {name} within {header_timeout:g}s") from exc
        if isinstance(exc, StreamReset):
            raise RequestResetByBackend(f"{name}: {exc}") from exc
        if isinstance(exc, (OSError, ValueError)):
            raise BackendFailed(f"{name}: {type(exc).__name__}") from exc
        raise
    assert stream is not None
    return stream.status, stream.raw_headers, MuxBody(stream, pool, name, on_done)
