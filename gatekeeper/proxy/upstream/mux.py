"""Multiplexed HTTP/2 upstream for short, bodiless requests from verified callers (always on).

One connection per backend batches a loop iteration's requests into one write and their answers into one read. A shared
connection must not let one caller hold another's memory (per-stream windows reopen only as the client reads), slots
(stream caps), or cause a re-send (only provably unprocessed streams are re-sent). Which requests take it, and why, is
in docs/proxy/index.md (Upstream connections)."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import cast

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire.errors import ErrorCodes, FrameError
from gatekeeper.proxy.h2wire.hpack_decode import BlockDecoder, HeaderBlockError
from gatekeeper.proxy.upstream.lean import MAX_HEAD_BYTES, BackendProtocolError
from gatekeeper.proxy.upstream.mux_stream import STREAM_WINDOW, MuxStream, StreamRefused, StreamReset
from gatekeeper.proxy.upstream.mux_wire import response_head

MAX_FRAME = f.MIN_FRAME_SIZE
"""Largest frame we accept (the default; we never advertise more)."""
MAX_STREAM_ID = 2**31 - 1
IDLE_SECONDS = 60.0
"""A connection with no stream for this long is closed at the next pick (the backend may have dropped it)."""


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
    """One HTTP/2 connection to a backend, client side; frames parsed in place (no event objects)."""

    def __init__(self, ctx: ssl.SSLContext, max_streams: int, on_lost: Callable[[MuxConn], None],
                 on_goaway: Callable[[], None], on_unauthorized: Callable[[MuxConn], None]) -> None:
        self.ctx = ctx
        self.cap = max_streams
        self.on_lost = on_lost
        self.on_goaway = on_goaway
        self.on_unauthorized = on_unauthorized
        """A stream's final head said 401: called while the frame is parsed, before any consumer runs."""
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.decoder = BlockDecoder(MAX_HEAD_BYTES)
        self.streams: dict[int, MuxStream] = {}
        self.next_sid = 1
        self.peer_max_streams = max_streams
        self.peer_max_frame = f.MIN_FRAME_SIZE
        self.goaway: int | None = None
        self.closed = False
        self.lost = False
        """``connection_lost`` came (``closed`` alone may be our own decision)."""
        self.out: list[bytes] = []
        self.flush_pending = False
        self.conn_unacked = 0
        self.block: list[bytes] | None = None
        """A header block waiting for its CONTINUATION frames: its parts; ``block_sid``/``block_flags`` say whose."""
        self.block_sid = 0
        self.block_flags = 0
        self.block_size = 0
        self.block_frames = 0
        self.idle_since = time.monotonic()
        self.window = STREAM_WINDOW * max_streams
        """The connection receive window we open: room for every stream's window at once."""

    # --- for the pool -------------------------------------------------------------------------

    def available(self) -> bool:
        return (not self.closed and self.goaway is None and self.next_sid < MAX_STREAM_ID
                and len(self.streams) < min(self.cap, self.peer_max_streams))

    def start(self, block: bytes, *, head_only: bool, header_timeout: float | None) -> MuxStream:
        """Open a stream for a bodiless request whose header block is ``block`` (:func:`mux_wire.request_block`)."""
        sid = self.next_sid
        self.next_sid += 2
        stream = self.streams[sid] = MuxStream(sid, self, head_only)
        self.queue(b"".join(f.headers_frames(sid, block, self.peer_max_frame, f.END_STREAM)))
        if header_timeout is not None:
            stream.timer = self.loop.call_later(header_timeout, self._header_timeout, stream)
        return stream

    def cancel(self, stream: MuxStream) -> None:
        """The consumer gave up on ``stream``: reset it if the backend may still send on it."""
        stream.stop_timer()
        if self.streams.pop(stream.sid, None) is not None and not self.closed:
            self.queue(f.rst_stream(stream.sid, ErrorCodes.CANCEL))
        self._maybe_close()

    def queue(self, data: bytes) -> None:
        """Written at the end of this loop iteration, with everything else queued in it (one TLS write)."""
        self.out.append(data)
        if not self.flush_pending:
            self.flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_pending = False
        out, self.out = self.out, []
        if self.transport is not None and not self.closed and out:
            self.transport.write(b"".join(out))

    def _header_timeout(self, stream: MuxStream) -> None:
        stream.timer = None
        if not stream.headers_done:
            stream.fail(TimeoutError("no response head in time"))
            self.cancel(stream)

    def _maybe_close(self) -> None:
        if not self.streams:
            self.idle_since = time.monotonic()
            if self.goaway is not None or self.next_sid >= MAX_STREAM_ID:
                self.close()

    def close(self, code: int | None = None) -> None:
        if self.closed:
            return
        if code is not None and self.transport is not None:
            self._flush()
            self.transport.write(f.goaway(0, code))
        self.closed = True
        if self.transport is not None:
            self.transport.close() if code is None else self.transport.abort()

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = tr = cast(asyncio.Transport, transport)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is None or ssl_object.selected_alpn_protocol() != "h2":
            # The pool hands it to the HTTP/1.1 pool; bytes that come first are kept unparsed (they void the handover).
            self.closed = True
            return
        tr.write(f.PREFACE + f.settings_frame({
            f.ENABLE_PUSH: 0, f.INITIAL_WINDOW_SIZE: STREAM_WINDOW, f.MAX_HEADER_LIST_SIZE: MAX_HEAD_BYTES,
        }) + f.window_update(0, self.window - f.DEFAULT_WINDOW))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = self.lost = True
        error = exc or ConnectionResetError("the backend closed the connection")
        for stream in self.streams.values():
            stream.fail(error)
        self.streams.clear()
        self.on_lost(self)

    def _broken(self, why: str, code: int = ErrorCodes.PROTOCOL_ERROR) -> None:
        error = BackendProtocolError(f"HTTP/2 from the backend: {why}")
        for stream in self.streams.values():
            stream.fail(error)
        self.streams.clear()
        self.close(code)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        end = len(buf)
        pos = 0
        unpack = f.FRAME_HEADER.unpack_from
        streams = self.streams
        try:
            while end - pos >= 9 and not self.closed:
                lt, flags, sid = unpack(buf, pos)
                length = lt >> 8
                if length > MAX_FRAME:
                    raise FrameError(ErrorCodes.FRAME_SIZE_ERROR, f"frame of {length} bytes")
                if end - pos - 9 < length:
                    break
                ftype = lt & 0xFF
                start = pos + 9
                pos = start + length
                sid &= MAX_STREAM_ID
                if self.block is not None and ftype != f.CONTINUATION:
                    raise FrameError(ErrorCodes.PROTOCOL_ERROR, "a frame inside a header block")
                if ftype == f.DATA:
                    self.conn_unacked += length
                    if sid == 0:
                        raise FrameError(ErrorCodes.PROTOCOL_ERROR, "DATA on stream 0")
                    size = length
                    if flags & f.PADDED:
                        start, size = f.unpad(flags, buf, start, length)
                    stream = streams.get(sid)
                    if stream is None:
                        if sid >= self.next_sid:
                            raise FrameError(ErrorCodes.PROTOCOL_ERROR, f"DATA on stream {sid}, never opened")
                        continue  # a stream we reset: its bytes still count for the connection window
                    if not stream.headers_done:
                        raise FrameError(ErrorCodes.PROTOCOL_ERROR, f"DATA before the head on stream {sid}")
                    if size:
                        if stream.buffered + size > STREAM_WINDOW:
                            raise FrameError(ErrorCodes.FLOW_CONTROL_ERROR, f"stream {sid} over its window")
                        if not stream.head_only:
                            stream.chunks.append(buf[start:start + size])
                            stream.buffered += size
                    if flags & f.END_STREAM:
                        stream.complete = True
                        del streams[sid]
                        self._maybe_close()
                    stream.wake()
                elif ftype == f.HEADERS:
                    if sid == 0 or sid % 2 == 0:
                        raise FrameError(ErrorCodes.PROTOCOL_ERROR, f"HEADERS on stream {sid}")
                    size = length
                    if flags & (f.PADDED | f.PRIORITY_FLAG):
                        start, size = f.unpad(flags, buf, start, length, 5 if flags & f.PRIORITY_FLAG else 0)
                    if flags & f.END_HEADERS:
                        self._head(sid, flags, buf[start:start + size])
                    else:
                        self.block, self.block_sid, self.block_flags = [buf[start:start + size]], sid, flags
                        self.block_size, self.block_frames = size, 1
                else:
                    self._control(ftype, flags, sid, buf, start, length)
        except FrameError as exc:
            return self._broken(str(exc), exc.error_code)
        self.buf = buf[pos:] if pos < end else b""
        if self.conn_unacked >= self.window // 4 and not self.closed:
            self.queue(f.window_update(0, self.conn_unacked))
            self.conn_unacked = 0
        return None

    def _control(self, ftype: int, flags: int, sid: int, buf: bytes, start: int, length: int) -> None:
        """Every frame but DATA and HEADERS (``data_received`` keeps those inline: they are the per-request ones);
        FrameError when the connection broke."""
        if ftype == f.CONTINUATION:
            if self.block is None or sid != self.block_sid:
                raise FrameError(ErrorCodes.PROTOCOL_ERROR, "CONTINUATION out of place")
            self.block.append(buf[start:start + length])
            self.block_size += length
            self.block_frames += 1
            if self.block_size > MAX_HEAD_BYTES or self.block_frames > f.MAX_CONTINUATIONS:
                raise FrameError(ErrorCodes.ENHANCE_YOUR_CALM, "header block too large")
            if flags & f.END_HEADERS:
                parts, self.block = self.block, None
                self._head(sid, self.block_flags, b"".join(parts))
            return
        f.check_control(ftype, flags, sid, length)
        if ftype == f.RST_STREAM:
            stream = self.streams.pop(sid, None)
            if stream is not None:
                code = f.U32.unpack_from(buf, start)[0]
                if code == ErrorCodes.REFUSED_STREAM and not stream.headers_done:
                    stream.fail(StreamRefused(f"stream refused by the backend (stream {sid})"))
                else:
                    stream.fail(StreamReset(f"the backend reset the stream (code {code})"))
                self._maybe_close()
        elif ftype == f.SETTINGS and not flags & f.ACK:
            for key, value in f.settings(buf, start, length):
                if key == f.MAX_CONCURRENT_STREAMS:
                    self.peer_max_streams = value
                elif key == f.MAX_FRAME_SIZE:
                    self.peer_max_frame = value
            self.queue(f.frame(f.SETTINGS, f.ACK, 0))
        elif ftype == f.PING and not flags & f.ACK:
            self.queue(f.frame(f.PING, f.ACK, 0, buf[start:start + 8]))
        elif ftype == f.GOAWAY:
            self._goaway(f.U32.unpack_from(buf, start)[0] & MAX_STREAM_ID)
        # PRIORITY, WINDOW_UPDATE (we send no DATA) and unknown frame types are ignored (RFC 9113 5.5).

    def _head(self, sid: int, flags: int, block: bytes) -> None:
        """A complete header block: decoded whatever the stream's state (the HPACK table must follow)."""
        try:
            fields = self.decoder.decode(block)
        except HeaderBlockError as exc:
            raise FrameError(ErrorCodes.COMPRESSION_ERROR, f"header block: {exc}") from None
        stream = self.streams.get(sid)
        if stream is None:
            if sid >= self.next_sid:
                raise FrameError(ErrorCodes.PROTOCOL_ERROR, f"HEADERS on stream {sid}, never opened")
            return
        if stream.headers_done:  # trailers: must end the stream; their fields are dropped
            if not flags & f.END_STREAM:
                raise FrameError(ErrorCodes.PROTOCOL_ERROR, f"a second head without END_STREAM on stream {sid}")
        else:
            try:
                code, raw = response_head(fields)
            except ValueError as bad:
                raise FrameError(ErrorCodes.PROTOCOL_ERROR, str(bad)) from None
            if code < 200:
                if flags & f.END_STREAM:
                    raise FrameError(ErrorCodes.PROTOCOL_ERROR, "an interim response ended the stream")
                return  # interim (1xx): wait for the final head
            stream.status = code
            stream.raw_headers = raw
            stream.headers_done = True
            stream.stop_timer()
            if code == 401:
                self.on_unauthorized(self)
        if flags & f.END_STREAM:
            stream.complete = True
            del self.streams[sid]
            self._maybe_close()
        stream.wake()

    def _goaway(self, last: int) -> None:
        """Streams above ``last`` were never processed: they fail with StreamRefused (the caller re-sends)."""
        self.goaway = last if self.goaway is None else min(last, self.goaway)
        self.on_goaway()
        for sid in [s for s in self.streams if s > last]:
            self.streams.pop(sid).fail(StreamRefused(f"stream {sid} above the backend's GOAWAY ({last})"))
        self._maybe_close()
