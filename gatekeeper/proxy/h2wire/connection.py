"""What one HTTP/2 connection does whichever side it is (RFC 9113), pure: the frame read loop, header block assembly
(HEADERS then CONTINUATION), receive windows and their WINDOW_UPDATEs, the frames waiting to be sent and the GOAWAY of
a connection error. The listener's server codec (``listen/h2_codec``) and the upstream client codec (``client_codec``)
extend :class:`H2Connection` with what each side does per frame: one frame layer for both directions. Compiled with
mypyc together (docs/proxy/compiled.md): the subclasses' calls and field reads stay native."""

from __future__ import annotations

from typing import Any

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire.errors import ErrorCodes, FrameError, ProtocolError
from gatekeeper.proxy.h2wire.hpack_decode import BlockDecoder

Event = tuple[Any, ...]
"""A codec's event: its kind (``EV_*`` of the codec), the stream id, then what the kind carries."""

_FH = f.FRAME_HEADER.unpack_from
_U32 = f.U32.unpack_from


class H2ConnectionError(FrameError):
    """A connection error: the GOAWAY with ``error_code`` is already queued."""


class StreamState:
    __slots__ = ("head", "length", "local_closed", "received", "recv_window", "remote_closed", "send_window",
                 "unacked")

    def __init__(self, send_window: int, recv_window: int) -> None:
        self.send_window = send_window
        self.recv_window = recv_window
        self.unacked = 0
        self.remote_closed = False
        self.local_closed = False
        self.length: int | None = None
        """content-length of the request, when given; checked against the DATA received (server side)."""
        self.received = 0
        self.head = False
        """The final response head arrived (client side)."""


class H2Connection:
    """One connection's frame layer, either side (see the module docstring); ``_frame`` is the side's."""

    def __init__(self, *, stream_window: int, connection_window: int, max_header_list: int, max_block: int) -> None:
        self._stream_window = stream_window
        self._conn_window_size = max(connection_window, f.DEFAULT_WINDOW)
        self._max_header_list = max_header_list
        self._max_block = max_block
        """Bytes a header block may have on the wire before it ends (ENHANCE_YOUR_CALM past them)."""
        self.decoder = BlockDecoder(max_header_list)
        self.streams: dict[int, StreamState] = {}
        self.highest_inbound_stream_id = 0
        self._recv_window = f.DEFAULT_WINDOW
        self._recv_unacked = 0
        self._out: list[bytes] = []
        self.closed = False
        self._buf = b""
        self._preface = False
        """Still expecting the client preface (server side: ``_start`` takes it)."""
        self._cont_sid = 0
        """The stream whose header block waits for CONTINUATION frames (0: none); its parts and HEADERS flags next."""
        self._cont_parts: list[bytes] = []
        self._cont_flags = 0
        self._cont_size = 0

    def _initiate(self, settings: dict[int, int]) -> None:
        """Our SETTINGS, then a connection WINDOW_UPDATE up to the configured connection window."""
        self._out.append(f.settings_frame(settings))
        extra = self._conn_window_size - f.DEFAULT_WINDOW
        if extra > 0:
            self._recv_window += extra
            self._out.append(f.window_update(0, extra))

    @property
    def inbound_flow_control_window(self) -> int:
        return self._recv_window

    @property
    def pending(self) -> bool:
        """Frames wait in :meth:`data_to_send`."""
        return bool(self._out)

    def data_to_send(self) -> bytes:
        out = self._out
        if not out:
            return b""
        self._out = []
        return out[0] if len(out) == 1 else b"".join(out)

    # ------------------------------------------------------------------ inbound

    def receive_data(self, data: bytes) -> list[Event]:
        """Parse every complete frame in ``data`` (plus what was left over); return the events. A ProtocolError is a
        connection error, its GOAWAY queued."""
        if self.closed:
            return []
        buf = self._buf + data if self._buf else data
        events: list[Event] = []
        pos = self._start(buf) if self._preface else 0
        if pos < 0:
            self._buf = buf
            return events
        end = len(buf)
        try:
            while end - pos >= 9:
                lt, flags, sid = _FH(buf, pos)
                length = lt >> 8
                if length > f.MIN_FRAME_SIZE:
                    self._fail(ErrorCodes.FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds MAX_FRAME_SIZE")
                if end - pos - 9 < length:
                    break
                start = pos + 9
                pos = start + length
                ftype = lt & 0xFF
                sid &= 0x7FFFFFFF
                if self._cont_sid:
                    if ftype != f.CONTINUATION or sid != self._cont_sid:
                        self._fail(ErrorCodes.PROTOCOL_ERROR, "header block interrupted by another frame")
                elif ftype == f.CONTINUATION:
                    self._fail(ErrorCodes.PROTOCOL_ERROR, "CONTINUATION without a header block in progress")
                self._frame(ftype, flags, sid, buf, start, length, events)
            self._buf = buf[pos:] if pos < end else b""
        except ProtocolError as exc:
            if not self.closed:  # e.g. a FloodError from the server's guard: its GOAWAY is not queued yet
                self.close_connection(exc.error_code or ErrorCodes.PROTOCOL_ERROR)
            self._buf = b""
            raise
        return events

    def _start(self, buf: bytes) -> int:
        """Where frames start in ``buf`` while ``_preface`` is set (-1: wait for more); the server's to override."""
        return 0

    def _frame(self, ftype: int, flags: int, sid: int, buf: bytes, start: int, length: int,
               events: list[Event]) -> None:
        raise NotImplementedError

    def _fragment(self, flags: int, sid: int, buf: bytes, start: int, length: int) -> tuple[bytes, bool]:
        """A HEADERS frame's block fragment past padding and priority, and whether its priority names ``sid``
        itself (a stream error, RFC 9113 5.3.1)."""
        if flags & f.PRIORITY_FLAG:
            first, length = f.unpad(flags, buf, start, length, 5)
            return buf[first:first + length], (_U32(buf, first - 5)[0] & 0x7FFFFFFF) == sid
        if flags & f.PADDED:
            start, length = f.unpad(flags, buf, start, length)
        return buf[start:start + length], False

    def _begin_block(self, sid: int, flags: int, fragment: bytes) -> None:
        """A HEADERS frame without END_HEADERS: its CONTINUATION frames come next (``_continuation``)."""
        self._cont_sid = sid
        self._cont_parts = [fragment]
        self._cont_flags = flags
        self._cont_size = len(fragment)

    def _continuation(self, flags: int, buf: bytes, start: int, length: int) -> bytes | None:
        """The header block once this CONTINUATION ended it (``_cont_flags`` are its HEADERS' flags), else None."""
        parts = self._cont_parts
        parts.append(buf[start:start + length])
        self._cont_size += length
        if len(parts) > f.MAX_CONTINUATIONS or self._cont_size > self._max_block:
            self._fail(ErrorCodes.ENHANCE_YOUR_CALM, "too many CONTINUATION frames or header block bytes")
        if not flags & f.END_HEADERS:
            return None
        self._cont_sid = 0
        self._cont_parts = []
        return b"".join(parts)

    def _take_window(self, length: int) -> None:
        """A DATA frame of ``length`` flow-controlled bytes arrived: FLOW_CONTROL_ERROR past the connection window."""
        if length > self._recv_window:
            self._fail(ErrorCodes.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._recv_window -= length

    # ------------------------------------------------------------------ windows and errors out

    def acknowledge_received_data(self, acknowledged_size: int, stream_id: int) -> None:
        """The adapter consumed ``size`` flow-controlled bytes of the stream (0: none): reopen both windows."""
        if acknowledged_size > 0:
            self._ack_connection(acknowledged_size)
            self.acknowledge_stream(stream_id, acknowledged_size)

    def _ack_connection(self, size: int) -> None:
        """Reopen the connection window in batches (once under half), so a steady upload costs one WINDOW_UPDATE per
        half window, not one per DATA frame."""
        self._recv_unacked += size
        if self._recv_window < self._conn_window_size // 2:
            self._recv_window += self._recv_unacked
            self._out.append(f.window_update(0, self._recv_unacked))
            self._recv_unacked = 0

    def acknowledge_stream(self, sid: int, size: int) -> None:
        """Reopen a stream's window, in batches as the connection's (a stream no longer open needs none)."""
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

    def _fail(self, code: ErrorCodes, message: str) -> None:
        self.close_connection(code)
        raise H2ConnectionError(code, message)
