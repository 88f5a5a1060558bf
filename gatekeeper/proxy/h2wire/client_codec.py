"""The client side of an HTTP/2 connection (RFC 9113), sans-IO: only what the multiplexed upstream needs (bodiless
requests, responses read as the consumer takes them). Bytes in, event tuples (``EV_*``) out, frames to send in a
buffer; the read loop, header blocks and windows are the frame layer the listener's server codec runs on too
(``connection``). The tests hold the ``h2`` library's client as an oracle."""

from __future__ import annotations

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire.connection import Event, H2Connection, StreamState
from gatekeeper.proxy.h2wire.errors import ErrorCodes
from gatekeeper.proxy.h2wire.hpack_decode import HeaderBlockError

EV_HEAD, EV_DATA, EV_RESET, EV_GOAWAY = range(4)
"""Event tuples: (EV_HEAD, sid, status, fields, ended): the final response head (interim 1xx heads are dropped);
(EV_DATA, sid, data, ended): body bytes, b"" when only the end came (an empty DATA frame, or trailers, whose fields are
dropped); (EV_RESET, sid, code); (EV_GOAWAY, last_stream_id): the streams above it were never processed, and are
forgotten. A stream is forgotten by the codec once an event ended it."""

_U32 = f.U32.unpack_from


def response_head(fields: list[tuple[bytes, bytes]]) -> tuple[int, list[tuple[bytes, bytes]]]:
    """The status and regular fields of a decoded response head (RFC 9113 8.3.2); ValueError if malformed."""
    status = b""
    raw: list[tuple[bytes, bytes]] = []
    for name, value in fields:
        if name[:1] == b":":
            if name != b":status" or status or raw:
                raise ValueError(f"pseudo-header {name[:16]!r} in a response")
            status = value
        else:
            raw.append((name, value))
    if len(status) != 3 or not status.isdigit() or status[:1] == b"0":
        raise ValueError("response without a valid :status")
    return int(status), raw


class H2ClientCodec(H2Connection):
    """Client side of one HTTP/2 connection. The connection window is every stream's window at once and is reopened
    as DATA arrives; a stream's window reopens only as its consumer reads (``acknowledge_stream``), so a caller who
    stops reading holds one stream window of memory, never the connection."""

    def __init__(self, *, max_streams: int, stream_window: int, max_header_list: int) -> None:
        super().__init__(stream_window=stream_window, connection_window=stream_window * max_streams,
                         max_header_list=max_header_list, max_block=max_header_list)
        self.next_sid = 1
        self.peer_max_streams = max_streams
        """The backend's MAX_CONCURRENT_STREAMS (our own cap until its SETTINGS say)."""
        self.peer_max_frame = f.MIN_FRAME_SIZE

    def initiate_connection(self) -> None:
        self._out.append(f.PREFACE)
        self._initiate({f.ENABLE_PUSH: 0, f.INITIAL_WINDOW_SIZE: self._stream_window,
                        f.MAX_HEADER_LIST_SIZE: self._max_header_list})

    def send_request(self, block: bytes) -> int:
        """Open the next stream with a bodiless request's HPACK header block (END_STREAM); its stream id."""
        sid = self.next_sid
        self.next_sid += 2
        stream = self.streams[sid] = StreamState(0, self._stream_window)
        stream.local_closed = True
        self._out += f.headers_frames(sid, block, self.peer_max_frame, f.END_STREAM)
        return sid

    def reset_stream(self, sid: int, code: int) -> None:
        """RST_STREAM ``code`` if the stream is still open (the backend may still send on it)."""
        if self.streams.pop(sid, None) is not None:
            self._out.append(f.rst_stream(sid, code))

    # ------------------------------------------------------------------ inbound frames (RFC 9113 6)

    def _frame(self, ftype: int, flags: int, sid: int, buf: bytes, start: int, length: int,
               events: list[Event]) -> None:
        if ftype == f.DATA:
            self._on_data(flags, sid, buf, start, length, events)
        elif ftype == f.HEADERS:
            if not sid or not sid & 1:
                self._fail(ErrorCodes.PROTOCOL_ERROR, f"HEADERS on stream {sid}")
            fragment, _ = self._fragment(flags, sid, buf, start, length)
            if flags & f.END_HEADERS:
                self._head(sid, flags, fragment, events)
            else:
                self._begin_block(sid, flags, fragment)
        elif ftype == f.CONTINUATION:
            block = self._continuation(flags, buf, start, length)
            if block is not None:
                self._head(sid, self._cont_flags, block, events)
        elif ftype != f.PRIORITY:
            self._control(ftype, flags, sid, buf, start, length, events)
        # PRIORITY is ignored (we do not prioritize), as are unknown frame types (RFC 9113 5.5).

    def _control(self, ftype: int, flags: int, sid: int, buf: bytes, start: int, length: int,
                 events: list[Event]) -> None:
        f.check_control(ftype, flags, sid, length)
        if ftype == f.RST_STREAM:
            if self.streams.pop(sid, None) is not None:
                events.append((EV_RESET, sid, _U32(buf, start)[0]))
        elif ftype == f.SETTINGS and not flags & f.ACK:
            for key, value in f.settings(buf, start, length):
                if key == f.MAX_CONCURRENT_STREAMS:
                    self.peer_max_streams = value
                elif key == f.MAX_FRAME_SIZE:
                    self.peer_max_frame = value
            self._out.append(f.frame(f.SETTINGS, f.ACK, 0))
        elif ftype == f.PING and not flags & f.ACK:
            self._out.append(f.frame(f.PING, f.ACK, 0, buf[start:start + 8]))
        elif ftype == f.GOAWAY:
            last = _U32(buf, start)[0] & 0x7FFFFFFF
            for above in [s for s in self.streams if s > last]:
                del self.streams[above]
            events.append((EV_GOAWAY, last))
        elif ftype == f.WINDOW_UPDATE and (sid >= self.next_sid or (sid and not sid & 1)):
            self._fail(ErrorCodes.PROTOCOL_ERROR, f"WINDOW_UPDATE on stream {sid}, never opened")
        # WINDOW_UPDATE otherwise: we send no DATA.

    def _head(self, sid: int, flags: int, block: bytes, events: list[Event]) -> None:
        """A complete header block: decoded whatever the stream's state (the HPACK table must stay in step)."""
        try:
            fields = self.decoder.decode(block)
        except HeaderBlockError as exc:
            self._fail(ErrorCodes.COMPRESSION_ERROR, f"header block: {exc}")
        stream = self.streams.get(sid)
        if stream is None:
            if sid >= self.next_sid:
                self._fail(ErrorCodes.PROTOCOL_ERROR, f"HEADERS on stream {sid}, never opened")
            return  # a stream we reset or forgot
        ended = flags & f.END_STREAM
        if stream.head:  # trailers: must end the stream, without pseudo-headers (RFC 9113 8.1); dropped
            if not ended or any(name[:1] == b":" for name, _ in fields):
                self._fail(ErrorCodes.PROTOCOL_ERROR, f"a second head that is not trailers on stream {sid}")
            del self.streams[sid]
            events.append((EV_DATA, sid, b"", True))
            return
        try:
            status, raw = response_head(fields)
        except ValueError as bad:
            self._fail(ErrorCodes.PROTOCOL_ERROR, str(bad))
        if status < 200:
            if ended:
                self._fail(ErrorCodes.PROTOCOL_ERROR, "an interim response ended the stream")
            return  # interim (1xx): the final head comes next
        stream.head = True
        if ended:
            del self.streams[sid]
        events.append((EV_HEAD, sid, status, raw, bool(ended)))

    def _on_data(self, flags: int, sid: int, buf: bytes, start: int, length: int, events: list[Event]) -> None:
        if not sid:
            self._fail(ErrorCodes.PROTOCOL_ERROR, "DATA on stream 0")
        first, size = f.unpad(flags, buf, start, length) if flags & f.PADDED else (start, length)
        self._take_window(length)
        self._ack_connection(length)  # the stream windows bound what is held: the connection's reopens at once
        stream = self.streams.get(sid)
        if stream is None:
            if sid >= self.next_sid or not sid & 1:
                self._fail(ErrorCodes.PROTOCOL_ERROR, f"DATA on stream {sid}, never opened")
            return  # a stream we reset: its bytes only counted for the connection window
        if not stream.head:
            self._fail(ErrorCodes.PROTOCOL_ERROR, f"DATA before the head on stream {sid}")
        if length > stream.recv_window:
            self._fail(ErrorCodes.FLOW_CONTROL_ERROR, f"stream {sid} over its window")
        stream.recv_window -= length
        if size < length:
            self.acknowledge_stream(sid, length - size)  # padding: nobody reads it
        ended = flags & f.END_STREAM
        if ended:
            del self.streams[sid]
        if size or ended:
            events.append((EV_DATA, sid, buf[first:first + size], bool(ended)))
