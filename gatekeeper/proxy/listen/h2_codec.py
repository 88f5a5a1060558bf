"""The proxy's sans-IO HTTP/2 server connection (RFC 9113): only the server half the proxy needs.

The ``h2`` library cost ~60 us of CPU per small request in general machinery; this codec unpacks frames with one
``struct`` call, keeps streams in a slots record and reports plain tuples (``h2_state.EV_*``). It keeps every h2 server
behaviour the proxy relied on (the tests hold h2 as an oracle). ``h2_inbound`` has the rules per received frame; error
classes and closed-stream handling are summarized in docs/proxy/limits.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire.errors import ErrorCodes, FlowControlError, ProtocolError, StreamClosedError
from gatekeeper.proxy.h2wire.hpack_decode import BlockDecoder
from gatekeeper.proxy.h2wire.hpack_encode import ResponseEncoder
from gatekeeper.proxy.listen.body_budget import Share
from gatekeeper.proxy.listen.h2_inbound import InboundFrames
from gatekeeper.proxy.listen.h2_limits import PING, FloodGuard
from gatekeeper.proxy.listen.h2_state import (
    CLOSED_BY_END,
    CLOSED_MEMORY,
    EV_BAD_LENGTH,
    EV_DATA,
    EV_ENDED,
    EV_GOAWAY,
    EV_REQUEST,
    EV_RESET,
    EV_WINDOW,
    RESET_BY_US,
    Event,
    StreamState,
)

__all__ = ["CLOSED_MEMORY", "EV_BAD_LENGTH", "EV_DATA", "EV_ENDED", "EV_GOAWAY", "EV_REQUEST", "EV_RESET",
           "EV_WINDOW", "Event", "H2ServerCodec"]
_FH = f.FRAME_HEADER.unpack_from
_U32 = f.U32.unpack_from


class H2ServerCodec(InboundFrames):
    """Server side of one HTTP/2 connection: bytes in, event tuples out; frames to send in a buffer."""

    def __init__(
        self,
        on_refused: Callable[[int], None] | None = None,
        *,
        guard: FloodGuard | None = None,
        max_concurrent_streams: int = 100,
        stream_window: int = f.DEFAULT_WINDOW,
        max_header_list: int = 1 << 16,
        connection_window: int = f.DEFAULT_WINDOW,
        header_budget: Share | None = None,
    ) -> None:
        self._on_refused = on_refused
        self.header_budget = header_budget
        """Where a header block in progress is counted (the connection's share of the process budget)."""
        self._cont_bytes = 0
        self._guard = guard
        self.max_concurrent_streams = max_concurrent_streams
        self._stream_window = stream_window
        self._conn_window_size = max(connection_window, f.DEFAULT_WINDOW)
        self.decoder = BlockDecoder(max_header_list)
        self._max_header_list = max_header_list
        self.encoder = ResponseEncoder()
        self.streams: dict[int, StreamState] = {}
        self._held: set[int] = set()
        self._closed: dict[int, int] = {}
        """Recently closed stream id -> how it closed (``h2_state.CLOSED_BY_END``, ...)."""
        self.highest_inbound_stream_id = 0
        self._send_window = f.DEFAULT_WINDOW
        self._peer_initial_window = f.DEFAULT_WINDOW
        self.max_outbound_frame_size = f.MIN_FRAME_SIZE
        self._recv_window = f.DEFAULT_WINDOW
        self._recv_unacked = 0
        self._buf = b""
        self._preface = True
        """Still expecting the client preface (magic, then a SETTINGS frame)."""
        self._first_frame = True
        self._cont_sid = 0
        self._cont_parts: list[bytes] = []
        self._cont_end_stream = False
        self._cont_bad_priority = False
        self._out: list[bytes] = []
        self.closed = False

    # ------------------------------------------------------------------ outbound API

    def initiate_connection(self) -> None:
        """Our SETTINGS, then a connection WINDOW_UPDATE up to the configured connection window."""
        self._out.append(f.settings_frame({
            f.MAX_CONCURRENT_STREAMS: self.max_concurrent_streams,
            f.INITIAL_WINDOW_SIZE: self._stream_window,
            f.MAX_FRAME_SIZE: f.MIN_FRAME_SIZE,
            f.MAX_HEADER_LIST_SIZE: self._max_header_list,
        }))
        extra = self._conn_window_size - f.DEFAULT_WINDOW
        if extra > 0:
            self._recv_window += extra
            self._out.append(f.window_update(0, extra))

    @property
    def inbound_flow_control_window(self) -> int:
        return self._recv_window

    @property
    def held_streams(self) -> int:
        return len(self._held)

    def release_stream(self, stream_id: int) -> None:
        """The adapter is done with a stream: it stops counting against MAX_CONCURRENT_STREAMS."""
        self._held.discard(stream_id)

    def data_to_send(self) -> bytes:
        out = self._out
        if not out:
            return b""
        self._out = []
        return out[0] if len(out) == 1 else b"".join(out)

    def send_headers(self, stream_id: int, headers: Any, end_stream: bool = False) -> None:
        sid = stream_id
        stream = self._sendable(sid)
        block = self.encoder.encode(headers)
        size = self.max_outbound_frame_size
        flags = f.END_STREAM if end_stream else 0
        if len(block) <= size:
            self._out += (f.header(f.HEADERS, flags | f.END_HEADERS, sid, len(block)), block)
        else:
            pieces = [block[i:i + size] for i in range(0, len(block), size)]
            self._out += (f.header(f.HEADERS, flags, sid, len(pieces[0])), pieces[0])
            for n, piece in enumerate(pieces[1:], 2):
                end = f.END_HEADERS if n == len(pieces) else 0
                self._out += (f.header(f.CONTINUATION, end, sid, len(piece)), piece)
        if end_stream:
            self._local_close(sid, stream)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        sid = stream_id
        stream = self._sendable(sid)
        n = len(data)
        if n > self._send_window or n > stream.send_window:
            raise FlowControlError(f"{n} bytes exceed the flow-control window of stream {sid}")
        if n > self.max_outbound_frame_size:
            size = self.max_outbound_frame_size
            for i in range(0, n - size, size):
                self._out += (f.header(f.DATA, 0, sid, size), data[i:i + size])
            data = data[(n - 1) // size * size:]
        self._send_window -= n
        stream.send_window -= n
        self._out += (f.header(f.DATA, f.END_STREAM if end_stream else 0, sid, len(data)), data)
        if end_stream:
            self._local_close(sid, stream)

    def end_stream(self, stream_id: int) -> None:
        self.send_data(stream_id, b"", end_stream=True)

    def reset_stream(self, stream_id: int, error_code: Any = 0) -> None:
        sid = stream_id
        if self.streams.pop(sid, None) is None:
            raise StreamClosedError(sid)
        self._remember(sid, RESET_BY_US)
        self._out.append(f.rst_stream(sid, error_code))

    def local_flow_control_window(self, stream_id: int) -> int:
        stream = self._sendable(stream_id)
        return min(self._send_window, stream.send_window)

    def acknowledge_received_data(self, acknowledged_size: int, stream_id: int) -> None:
        """The adapter consumed ``size`` flow-controlled bytes: reopen the windows in batches (once under half),
        so a steady upload costs one WINDOW_UPDATE per half window, not one per DATA frame."""
        size, sid = acknowledged_size, stream_id
        if size <= 0:
            return
        self._recv_unacked += size
        if self._recv_window < self._conn_window_size // 2:
            self._recv_window += self._recv_unacked
            self._out.append(f.window_update(0, self._recv_unacked))
            self._recv_unacked = 0
        stream = self.streams.get(sid)
        if stream is not None and not stream.remote_closed:
            stream.unacked += size
            if stream.recv_window < self._stream_window // 2:
                stream.recv_window += stream.unacked
                self._out.append(f.window_update(sid, stream.unacked))
                stream.unacked = 0

    def close_connection(self, error_code: int = 0, last_stream_id: int | None = None) -> None:
        if self.closed:
            return
        last = self.highest_inbound_stream_id if last_stream_id is None else last_stream_id
        self._out.append(f.goaway(last, error_code))
        self.closed = True

    def _sendable(self, sid: int) -> StreamState:
        stream = self.streams.get(sid)
        if stream is None or stream.local_closed or self.closed:
            raise StreamClosedError(sid)
        return stream

    def _local_close(self, sid: int, stream: StreamState) -> None:
        stream.local_closed = True
        if stream.remote_closed:
            del self.streams[sid]
            self._remember(sid, CLOSED_BY_END)

    def _remember(self, sid: int, how: int) -> None:
        closed = self._closed
        closed[sid] = how
        if len(closed) > CLOSED_MEMORY:
            del closed[next(iter(closed))]

    # ------------------------------------------------------------------ inbound

    def receive_data(self, data: bytes) -> list[Event]:
        """Parse every complete frame in ``data`` (plus what was left over); return the events."""
        if self.closed:
            return []
        buf = self._buf + data if self._buf else data
        events: list[Event] = []
        try:
            pos = 0
            if self._preface:
                if len(buf) < len(f.PREFACE):
                    if not f.PREFACE.startswith(buf):
                        self._fail(ErrorCodes.PROTOCOL_ERROR, "invalid connection preface")
                    self._buf = buf
                    return events
                if not buf.startswith(f.PREFACE):
                    self._fail(ErrorCodes.PROTOCOL_ERROR, "invalid connection preface")
                self._preface = False
                pos = len(f.PREFACE)
            end = len(buf)
            while end - pos >= 9:
                lt, flags, sid = _FH(buf, pos)
                length = lt >> 8
                if length > f.MIN_FRAME_SIZE:
                    self._fail(ErrorCodes.FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds MAX_FRAME_SIZE")
                if end - pos - 9 < length:
                    break
                start = pos + 9
                pos = start + length
                self._frame(lt & 0xFF, flags, sid & 0x7FFFFFFF, buf, start, length, events)
            self._buf = buf[pos:] if pos < end else b""
        except ProtocolError as exc:
            if not self.closed:  # a FloodError from the guard: its GOAWAY is not queued yet
                self.close_connection(exc.error_code or ErrorCodes.PROTOCOL_ERROR)
            self._buf = b""
            raise
        return events

    def _frame(self, ftype: int, flags: int, sid: int, buf: bytes, start: int, length: int,
               events: list[Event]) -> None:
        if self._first_frame:
            if ftype != f.SETTINGS or flags & f.ACK:
                self._fail(ErrorCodes.PROTOCOL_ERROR, "the client preface must end with a SETTINGS frame")
            self._first_frame = False
        if self._cont_sid and (ftype != f.CONTINUATION or sid != self._cont_sid):
            self._fail(ErrorCodes.PROTOCOL_ERROR, "header block interrupted by another frame")
        if ftype == f.HEADERS:
            self._on_headers(flags, sid, buf, start, length, events)
        elif ftype == f.DATA:
            self._on_data(flags, sid, buf, start, length, events)
        elif ftype == f.CONTINUATION:
            self._on_continuation(flags, sid, buf, start, length, events)
        elif ftype == f.WINDOW_UPDATE:
            self._on_window_update(sid, buf, start, length, events)
        elif ftype == f.RST_STREAM:
            self._on_rst_stream(sid, buf, start, length, events)
        elif ftype == f.SETTINGS:
            self._on_settings(flags, sid, buf, start, length, events)
        elif ftype == f.PING:
            if length != 8:
                self._fail(ErrorCodes.FRAME_SIZE_ERROR, "PING payload must be 8 bytes")
            if sid:
                self._fail(ErrorCodes.PROTOCOL_ERROR, "PING on a stream")
            if not flags & f.ACK:
                self._count(PING)
                self._out.append(f.frame(f.PING, f.ACK, 0, buf[start:start + 8]))
        elif ftype == f.PRIORITY:
            self._on_priority(sid, buf, start, length, events)
        elif ftype == f.GOAWAY:
            if sid:
                self._fail(ErrorCodes.PROTOCOL_ERROR, "GOAWAY on a stream")
            if length < 8:
                self._fail(ErrorCodes.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
            events.append((EV_GOAWAY, 0, _U32(buf, start + 4)[0]))
        elif ftype == f.PUSH_PROMISE:
            self._fail(ErrorCodes.PROTOCOL_ERROR, "a client cannot send PUSH_PROMISE")
        # unknown frame types are ignored (RFC 9113 5.5)

