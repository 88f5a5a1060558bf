"""Multiplexed HTTP/2 upstream for short, bodiless requests from verified callers (always on).

One connection per backend batches a loop iteration's requests into one write and their answers into one read. A shared
connection must not let one caller hold another's memory (per-stream windows reopen only as the client reads), slots
(stream caps), or cause a re-send (only provably unprocessed streams are re-sent). Which requests take it, and why, is
in docs/proxy/index.md (Upstream connections). A :class:`MuxStream` holds one request's head, unread chunks and waiter,
and gives the stream window back as the bytes are taken."""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Callable
from typing import cast

from gatekeeper.proxy.h2wire.client_codec import EV_DATA, EV_GOAWAY, EV_HEAD, H2ClientCodec
from gatekeeper.proxy.h2wire.errors import ErrorCodes, ProtocolError
from gatekeeper.proxy.upstream.lean import MAX_HEAD_BYTES, BackendProtocolError
from gatekeeper.proxy.upstream.slots import OneWaiter

MAX_STREAM_ID = 2**31 - 1
IDLE_SECONDS = 60.0
"""A connection with no stream for this long is closed at the next pick (the backend may have dropped it)."""
STREAM_WINDOW = 256 * 1024
"""Per-stream receive window (as ``lean.READ_HIGH``: what a client that stops reading can make us hold)."""


class StreamRefused(ConnectionError):
    """The backend did not process the stream (GOAWAY above it, or REFUSED_STREAM): safe to send again."""


class StreamReset(ConnectionResetError):
    """The backend reset this one stream (not REFUSED_STREAM); says something about the request (Go resets
    malformed ones), not by itself about the backend."""


class MuxStream(OneWaiter):
    """One request's response as it arrives on a shared connection."""

    __slots__ = (
        "buffered",
        "chunks",
        "complete",
        "conn",
        "error",
        "head_only",
        "headers_done",
        "raw_headers",
        "sid",
        "status",
        "timer",
    )

    def __init__(self, sid: int, conn: MuxConn, head_only: bool) -> None:
        self.sid = sid
        self.conn = conn
        self.loop = conn.loop
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        """Bytes received and not yet taken by the consumer (bounded by the stream window)."""
        self.complete = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.head_only = head_only

    def fail(self, error: BaseException) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self.stop_timer()
        self.wake()

    def stop_timer(self) -> None:
        timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()

    def take(self) -> bytes:
        """Everything buffered, as one chunk; its bytes go back to the backend as stream window."""
        chunks = self.chunks
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if not self.complete:
            self.conn.consumed(self.sid, len(chunk))
        return chunk


class NotH2(ConnectionError):
    """The backend did not negotiate HTTP/2 (ALPN): use the HTTP/1.1 pool for it.

    ``transport`` is the handshake that found out, nothing written yet, for the HTTP/1.1 pool to take (one handshake,
    not two); :meth:`claim` gives it out once to the requests that waited on it."""

    def __init__(self, message: str, transport: asyncio.Transport | None = None) -> None:
        super().__init__(message)
        self.transport = transport

    def claim(self) -> asyncio.Transport | None:
        transport, self.transport = self.transport, None
        return transport


class Paused(NotH2):
    """Multiplexing is paused for this kind of caller after a 401: nothing processed; use HTTP/1.1."""


class Refused(NotH2):
    """Every stream attempt was refused (provably not processed): send it over HTTP/1.1 once.

    Not a connect failure: ``--goaway-chance`` GOAWAYs under load catch re-sent streams too, which says nothing
    about the backend's health; one really going away fails the HTTP/1.1 connect and is ejected."""


class MuxConn(asyncio.Protocol):
    """One HTTP/2 connection to a backend, client side: the transport and its streams, driving
    :class:`~gatekeeper.proxy.h2wire.client_codec.H2ClientCodec` (the wire)."""

    def __init__(self, ctx: ssl.SSLContext, max_streams: int, on_lost: Callable[[MuxConn], None],
                 on_goaway: Callable[[], None], on_unauthorized: Callable[[MuxConn], None]) -> None:
        self.ctx = ctx
        self.cap = max_streams
        self.on_lost = on_lost
        self.on_goaway = on_goaway
        self.on_unauthorized = on_unauthorized
        """A stream's final head said 401: called while the read is handled, before any consumer runs."""
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.codec = H2ClientCodec(max_streams=max_streams, stream_window=STREAM_WINDOW,
                                   max_header_list=MAX_HEAD_BYTES)
        self.streams: dict[int, MuxStream] = {}
        self.goaway: int | None = None
        self.closed = False
        self.lost = False
        """``connection_lost`` came (``closed`` alone may be our own decision)."""
        self.stray = False
        """Bytes came on a connection already closed (before a handover they void it)."""
        self.flush_pending = False
        self.idle_since = time.monotonic()

    # --- for the pool (which reads its fields to pick one) ---------------------------------------

    def start(self, block: bytes, *, head_only: bool, header_timeout: float | None) -> MuxStream:
        """Open a stream for a bodiless request whose header block is ``block`` (:func:`mux_wire.request_block`)."""
        sid = self.codec.send_request(block)
        stream = self.streams[sid] = MuxStream(sid, self, head_only)
        self.queue()
        if header_timeout is not None:
            stream.timer = self.loop.call_later(header_timeout, self._header_timeout, stream)
        return stream

    def cancel(self, stream: MuxStream) -> None:
        """The consumer gave up on ``stream``: reset it if the backend may still send on it."""
        stream.stop_timer()
        if self.streams.pop(stream.sid, None) is not None and not self.closed:
            self.codec.reset_stream(stream.sid, ErrorCodes.CANCEL)
            self.queue()
        self._maybe_close()

    def consumed(self, sid: int, size: int) -> None:
        """The consumer took ``size`` bytes of the stream: its window reopens (in batches)."""
        self.codec.acknowledge_stream(sid, size)
        self.queue()

    def queue(self) -> None:
        """What the codec has to send is written at the end of this loop iteration, with everything else queued in it
        (one TLS write)."""
        if not self.flush_pending:
            self.flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_pending = False
        out = self.codec.data_to_send()
        if self.transport is not None and not self.closed and out:
            self.transport.write(out)

    def _header_timeout(self, stream: MuxStream) -> None:
        stream.timer = None
        if not stream.headers_done:
            stream.fail(TimeoutError("no response head in time"))
            self.cancel(stream)

    def _maybe_close(self) -> None:
        if not self.streams:
            self.idle_since = time.monotonic()
            if self.goaway is not None or self.codec.next_sid >= MAX_STREAM_ID:
                self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = tr = cast(asyncio.Transport, transport)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is None or ssl_object.selected_alpn_protocol() != "h2":
            # The pool hands it to the HTTP/1.1 pool; bytes that come first are not read (they void the handover).
            self.closed = True
            return
        self.codec.initiate_connection()
        tr.write(self.codec.data_to_send())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = self.lost = True
        error = exc or ConnectionResetError("the backend closed the connection")
        for stream in self.streams.values():
            stream.fail(error)
        self.streams.clear()
        self.on_lost(self)

    def _broken(self, why: str) -> None:
        """The backend broke HTTP/2: every stream fails, the codec's GOAWAY goes out and the connection is cut."""
        error = BackendProtocolError(f"HTTP/2 from the backend: {why}")
        for stream in self.streams.values():
            stream.fail(error)
        self.streams.clear()
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.write(self.codec.data_to_send())
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            self.stray = True
            return
        try:
            events = self.codec.receive_data(data)
        except ProtocolError as exc:
            return self._broken(str(exc))
        streams = self.streams
        for event in events:
            kind, sid = event[0], event[1]
            stream = streams.get(sid)
            if kind == EV_GOAWAY:
                self._goaway(sid)
                continue
            if stream is None:
                continue
            if kind == EV_DATA:
                chunk, ended = event[2], event[3]
                if chunk:
                    if stream.head_only:
                        self.codec.acknowledge_stream(sid, len(chunk))  # not read: its window reopens at once
                    else:
                        stream.chunks.append(chunk)
                        stream.buffered += len(chunk)
            elif kind == EV_HEAD:
                stream.status, stream.raw_headers, ended = event[2], event[3], event[4]
                stream.headers_done = True
                stream.stop_timer()
                if stream.status == 401:
                    self.on_unauthorized(self)
            else:  # EV_RESET
                self._reset(stream, event[2])
                continue
            if ended:
                stream.complete = True
                del streams[sid]
                self._maybe_close()
            stream.wake()
        if self.codec.pending and not self.closed:
            self.queue()
        return None

    def _reset(self, stream: MuxStream, code: int) -> None:
        del self.streams[stream.sid]
        if code == ErrorCodes.REFUSED_STREAM and not stream.headers_done:
            stream.fail(StreamRefused(f"stream refused by the backend (stream {stream.sid})"))
        else:
            stream.fail(StreamReset(f"the backend reset the stream (code {code})"))
        self._maybe_close()

    def _goaway(self, last: int) -> None:
        """Streams above ``last`` were never processed: they fail with StreamRefused (the caller re-sends)."""
        self.goaway = last if self.goaway is None else min(last, self.goaway)
        self.on_goaway()
        for sid in [s for s in self.streams if s > last]:
            self.streams.pop(sid).fail(StreamRefused(f"stream {sid} above the backend's GOAWAY ({last})"))
        self._maybe_close()
