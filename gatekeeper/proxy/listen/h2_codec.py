"""The proxy's sans-IO HTTP/2 server connection (RFC 9113): only the server half the proxy needs.

The ``h2`` library cost ~60 us of CPU per small request in general machinery; this codec unpacks frames with one
``struct`` call, keeps streams in a slots record and reports plain tuples (``EV_*``). It keeps every h2 server
behaviour the proxy relied on (the tests hold h2 as an oracle). The rules per received frame (RFC 9113 6) close the
class; error classes and closed-stream handling are summarized in docs/proxy/limits.md. The read loop, header
blocks and windows are the frame layer both sides share (``h2wire.connection``); the frames it sends are ``h2_send``'s
:class:`H2Sender`, which this codec extends."""

from __future__ import annotations

from collections.abc import Callable

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire.connection import Event, H2ConnectionError, StreamState
from gatekeeper.proxy.h2wire.errors import ErrorCodes
from gatekeeper.proxy.h2wire.hpack_decode import HeaderBlockError, HeaderListTooLarge
from gatekeeper.proxy.listen.body_budget import Share
from gatekeeper.proxy.listen.h2_headers import malformed_trailer
from gatekeeper.proxy.listen.h2_limits import CLOSED_STREAM, EMPTY_FRAME, PING, RST_STREAM, SETTINGS, FloodGuard
from gatekeeper.proxy.listen.h2_send import CLOSED_BY_END, RESET_BY_PEER, RESET_BY_US, H2Sender

EV_REQUEST, EV_DATA, EV_ENDED, EV_RESET, EV_WINDOW, EV_GOAWAY, EV_BAD_LENGTH = range(7)
"""Event tuples: (EV_REQUEST, sid, headers, ended), (EV_DATA, sid, data, flow_length), (EV_ENDED, sid), (EV_RESET, sid,
code), (EV_WINDOW, sid) (0: every stream), (EV_GOAWAY, 0, code), (EV_BAD_LENGTH, sid): the body disagreed with its
content-length and the stream was reset, reported in order so the adapter sees the request, then the cut."""


class HeaderBudgetExceeded(H2ConnectionError):
    """A header block in progress would pass the process's request buffer budget (``body_budget``)."""


_U32 = f.U32.unpack_from


class H2ServerCodec(H2Sender):
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
        super().__init__(max_concurrent_streams=max_concurrent_streams, stream_window=stream_window,
                         max_header_list=max_header_list, connection_window=connection_window)
        self._on_refused = on_refused
        self.header_budget = header_budget
        """Where a header block in progress is counted (the connection's share of the process budget)."""
        self._cont_bytes = 0
        self._guard = guard
        self._peer_initial_window = f.DEFAULT_WINDOW
        self._preface = True
        self._first_frame = True
        self._cont_bad_priority = False

    # ------------------------------------------------------------------ inbound

    def _start(self, buf: bytes) -> int:
        """Past the client preface's magic (its SETTINGS frame is ``_frame``'s first check)."""
        if len(buf) < len(f.PREFACE):
            if not f.PREFACE.startswith(buf):
                self._fail(ErrorCodes.PROTOCOL_ERROR, "invalid connection preface")
            return -1
        if not buf.startswith(f.PREFACE):
            self._fail(ErrorCodes.PROTOCOL_ERROR, "invalid connection preface")
        self._preface = False
        return len(f.PREFACE)

    def _frame(self, ftype: int, flags: int, sid: int, buf: bytes, start: int, length: int,
               events: list[Event]) -> None:
        if self._first_frame:
            if ftype != f.SETTINGS or flags & f.ACK:
                self._fail(ErrorCodes.PROTOCOL_ERROR, "the client preface must end with a SETTINGS frame")
            self._first_frame = False
        if ftype == f.HEADERS:
            self._on_headers(flags, sid, buf, start, length, events)
        elif ftype == f.DATA:
            self._on_data(flags, sid, buf, start, length, events)
        elif ftype == f.CONTINUATION:
            self._on_continuation(flags, sid, buf, start, length, events)
        elif ftype == f.PRIORITY:
            self._on_priority(sid, buf, start, length, events)
        else:
            f.check_control(ftype, flags, sid, length)
            if ftype == f.WINDOW_UPDATE:
                self._on_window_update(sid, buf, start, events)
            elif ftype == f.RST_STREAM:
                self._on_rst_stream(sid, buf, start, events)
            elif ftype == f.SETTINGS:
                self._on_settings(flags, buf, start, length, events)
            elif ftype == f.PING and not flags & f.ACK:
                self._count(PING)
                self._out.append(f.frame(f.PING, f.ACK, 0, buf[start:start + 8]))
            elif ftype == f.GOAWAY:
                events.append((EV_GOAWAY, 0, _U32(buf, start + 4)[0]))
        # unknown frame types are ignored (RFC 9113 5.5)

    # ------------------------------------------------------------------ inbound frames (RFC 9113 6)

    def _count(self, kind: str) -> None:
        if self._guard is not None:
            self._guard.count(kind)

    def _is_closed(self, sid: int) -> bool:
        return sid <= self.highest_inbound_stream_id and sid not in self.streams

    def _stream_error(self, sid: int, code: ErrorCodes, events: list[Event]) -> None:
        """RST_STREAM ``code``; the adapter hears of it if it knew the stream."""
        if self.streams.pop(sid, None) is not None and sid in self._held:
            events.append((EV_RESET, sid, code))
        self._remember(sid, RESET_BY_US)
        self._out.append(f.rst_stream(sid, code))

    def _closed_stream_frame(self, sid: int, what: str) -> None:
        """A frame that needs an open stream arrived for ``sid``, which is not open (RFC 9113 5.1)."""
        how = self._closed.get(sid)
        if how == RESET_BY_PEER:
            self._out.append(f.rst_stream(sid, ErrorCodes.STREAM_CLOSED))
        elif how is None:
            self._fail(ErrorCodes.PROTOCOL_ERROR, f"{what} on stream {sid}, which was never opened")
        elif how == CLOSED_BY_END:
            self._fail(ErrorCodes.STREAM_CLOSED, f"{what} on stream {sid} after END_STREAM")
        # RESET_BY_US: ignored (sent before our RST_STREAM arrived)

    # ------------------------------------------------------------------ HEADERS and CONTINUATION

    def _on_headers(self, flags: int, sid: int, buf: bytes, start: int, length: int, events: list[Event]) -> None:
        if not sid or not sid & 1:
            self._fail(ErrorCodes.PROTOCOL_ERROR, f"HEADERS on stream {sid}: client streams are odd and non-zero")
        fragment, bad_priority = self._fragment(flags, sid, buf, start, length)
        if sid not in self.streams and sid <= self.highest_inbound_stream_id:
            self._count(CLOSED_STREAM)
            if not self._closed.get(sid):
                self._closed_stream_frame(sid, "HEADERS")  # connection error
        if flags & f.END_HEADERS:
            self._header_block(sid, fragment, flags & f.END_STREAM, bad_priority, events)
        else:
            self._hold_header_bytes(len(fragment))
            self._begin_block(sid, flags, fragment)
            self._cont_bad_priority = bad_priority

    def _on_continuation(self, flags: int, sid: int, buf: bytes, start: int, length: int,
                         events: list[Event]) -> None:
        if not length:
            self._count(EMPTY_FRAME)
        if self._is_closed(sid):
            self._count(CLOSED_STREAM)
        self._hold_header_bytes(length)
        block = self._continuation(flags, buf, start, length)
        if block is not None:
            self.release_pending()
            self._header_block(sid, block, self._cont_flags & f.END_STREAM, self._cont_bad_priority, events)

    def _hold_header_bytes(self, size: int) -> None:
        """Count a header block in progress against the process's request buffer budget: trickled
        CONTINUATIONs hold up to a header list of our memory per connection."""
        budget = self.header_budget
        if budget is None or not size:
            return
        if not budget.take(size):
            self.close_connection(ErrorCodes.ENHANCE_YOUR_CALM)
            raise HeaderBudgetExceeded(ErrorCodes.ENHANCE_YOUR_CALM,
                                       "a header block in progress would pass the proxy's request buffer budget")
        self._cont_bytes += size

    def release_pending(self) -> None:
        """Give back what the header block in progress holds (it ended, or the connection did)."""
        if self._cont_bytes and self.header_budget is not None:
            self.header_budget.give(self._cont_bytes)
        self._cont_bytes = 0

    def _header_block(self, sid: int, block: bytes, end_stream: int, bad_priority: bool,
                      events: list[Event]) -> None:
        # Decoded first, whatever becomes of the stream: the HPACK table must stay in step.
        try:
            headers = self.decoder.decode(block)
        except HeaderListTooLarge as exc:
            self._fail(ErrorCodes.ENHANCE_YOUR_CALM, f"oversized header block: {exc}")
        except HeaderBlockError as bad:  # not ``exc`` again: mypyc types a name once, by its first handler
            self._fail(ErrorCodes.COMPRESSION_ERROR, f"undecodable header block: {bad}")
        stream = self.streams.get(sid)
        if sid > self.highest_inbound_stream_id:
            self.highest_inbound_stream_id = sid
            if bad_priority:
                self._stream_error(sid, ErrorCodes.PROTOCOL_ERROR, events)
            elif max(len(self.streams), len(self._held)) >= self.max_concurrent_streams:
                self._stream_error(sid, ErrorCodes.REFUSED_STREAM, events)
                if self._on_refused is not None:
                    self._on_refused(sid)
            else:
                stream = self.streams[sid] = StreamState(self._peer_initial_window, self._stream_window)
                for name, value in headers:
                    if name == b"content-length":
                        # at most 19 significant digits (Go's uint63): int() raises past 4300
                        length = int(value) if value.isdigit() and len(value.lstrip(b"0")) < 20 else -1
                        stream.length = length if stream.length in (None, length) else -1
                # Malformed (RFC 9113 8.1.1): forwarded, the HTTP/1.1 backend would read the next request as the body.
                if stream.length == -1 or (end_stream and stream.length):
                    self._bad_length(sid, events)
                    return
                if end_stream:
                    stream.remote_closed = True
                self._held.add(sid)
                events.append((EV_REQUEST, sid, headers, bool(end_stream)))
            return
        if stream is None:  # closed by RST_STREAM (the other cases failed in _on_headers)
            self._closed_stream_frame(sid, "HEADERS")
        elif stream.remote_closed:
            self._stream_error(sid, ErrorCodes.STREAM_CLOSED, events)
        elif bad_priority or not end_stream or any(map(malformed_trailer, headers)):
            # Trailers must end the stream and be valid fields (RFC 9113 8.1, 8.2.2), else malformed.
            self._stream_error(sid, ErrorCodes.PROTOCOL_ERROR, events)
        elif stream.length is not None and stream.length != stream.received:
            self._bad_length(sid, events)
        else:
            self._remote_close(sid, stream, events)

    # ------------------------------------------------------------------ DATA and flow control

    def _on_data(self, flags: int, sid: int, buf: bytes, start: int, length: int, events: list[Event]) -> None:
        if not sid:
            self._fail(ErrorCodes.PROTOCOL_ERROR, "DATA on stream 0")
        first, size = f.unpad(flags, buf, start, length) if flags & f.PADDED else (start, length)
        if not size and not flags & f.END_STREAM:
            self._count(EMPTY_FRAME)
        self._take_window(length)
        stream = self.streams.get(sid)
        if stream is None or stream.remote_closed:
            if sid > self.highest_inbound_stream_id or not sid & 1:
                self._fail(ErrorCodes.PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            if stream is None:
                self._count(CLOSED_STREAM)
            self.acknowledge_received_data(length, 0)  # nobody will read it
            if stream is None:
                self._closed_stream_frame(sid, "DATA")
            else:
                self._stream_error(sid, ErrorCodes.STREAM_CLOSED, events)
            return
        if length > stream.recv_window:
            self.acknowledge_received_data(length, 0)
            self._stream_error(sid, ErrorCodes.FLOW_CONTROL_ERROR, events)
            return
        stream.recv_window -= length
        stream.received += size
        ended = flags & f.END_STREAM
        if stream.length is not None and (stream.received > stream.length
                                          or (ended and stream.received != stream.length)):
            self.acknowledge_received_data(length, 0)
            self._bad_length(sid, events)
            return
        if length:
            events.append((EV_DATA, sid, buf[first:first + size], length))
        if ended:
            self._remote_close(sid, stream, events)

    def _remote_close(self, sid: int, stream: StreamState, events: list[Event]) -> None:
        stream.remote_closed = True
        events.append((EV_ENDED, sid))
        if stream.local_closed:
            del self.streams[sid]
            self._remember(sid, CLOSED_BY_END)

    def _bad_length(self, sid: int, events: list[Event]) -> None:
        """Body and content-length disagree: reset only this stream (RFC 9113 8.1.1), tell the adapter."""
        self.streams.pop(sid, None)
        self._remember(sid, RESET_BY_US)
        self._out.append(f.rst_stream(sid, ErrorCodes.PROTOCOL_ERROR))
        events.append((EV_BAD_LENGTH, sid))

    def _on_window_update(self, sid: int, buf: bytes, start: int, events: list[Event]) -> None:
        increment = _U32(buf, start)[0] & 0x7FFFFFFF
        if not increment:
            # As h2 does (h2spec accepts it); RFC 9113 6.9 allows a stream error on a stream.
            self._fail(ErrorCodes.PROTOCOL_ERROR, "WINDOW_UPDATE with increment 0")
        if not sid:
            self._send_window += increment
            if self._send_window > f.MAX_WINDOW:
                self._fail(ErrorCodes.FLOW_CONTROL_ERROR, "connection window above 2^31-1")
            events.append((EV_WINDOW, 0))
            return
        stream = self.streams.get(sid)
        if stream is None:
            if sid > self.highest_inbound_stream_id:
                self._fail(ErrorCodes.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
            return  # may trail a stream that just ended: not an error
        stream.send_window += increment
        if stream.send_window > f.MAX_WINDOW:
            self._stream_error(sid, ErrorCodes.FLOW_CONTROL_ERROR, events)
            return
        events.append((EV_WINDOW, sid))

    # ------------------------------------------------------------------ control frames

    def _on_rst_stream(self, sid: int, buf: bytes, start: int, events: list[Event]) -> None:
        self._count(RST_STREAM)
        if self.streams.pop(sid, None) is not None:
            self._remember(sid, RESET_BY_PEER)
            events.append((EV_RESET, sid, _U32(buf, start)[0]))
        elif sid > self.highest_inbound_stream_id:
            self._fail(ErrorCodes.PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
        else:
            self._count(CLOSED_STREAM)

    def _on_priority(self, sid: int, buf: bytes, start: int, length: int, events: list[Event]) -> None:
        if not sid:
            self._fail(ErrorCodes.PROTOCOL_ERROR, "PRIORITY on stream 0")
        if length != 5:
            self._count(RST_STREAM)  # each costs us a RST_STREAM: a reset flood unless counted (h2 fails at once)
            self._stream_error(sid, ErrorCodes.FRAME_SIZE_ERROR, events)
        elif _U32(buf, start)[0] & 0x7FFFFFFF == sid:
            self._count(RST_STREAM)
            self._stream_error(sid, ErrorCodes.PROTOCOL_ERROR, events)
        # otherwise ignored: the proxy does not prioritize (RFC 9113 5.3.2)

    def _on_settings(self, flags: int, buf: bytes, start: int, length: int, events: list[Event]) -> None:
        if flags & f.ACK:
            return
        self._count(SETTINGS)
        initial = self._peer_initial_window
        for key, value in f.settings(buf, start, length):
            if key == f.HEADER_TABLE_SIZE:
                self.encoder.header_table_size = value
            elif key == f.INITIAL_WINDOW_SIZE:
                initial = value  # applied once below: a frame of 2730 of these must not walk the streams 2730 times
            elif key == f.MAX_FRAME_SIZE:
                self.max_outbound_frame_size = value
        if initial != self._peer_initial_window:
            delta = initial - self._peer_initial_window
            self._peer_initial_window = initial
            for stream in self.streams.values():
                stream.send_window += delta
                if stream.send_window > f.MAX_WINDOW:
                    self._fail(ErrorCodes.FLOW_CONTROL_ERROR, "a stream window went above 2^31-1")
        self._out.append(f.frame(f.SETTINGS, f.ACK, 0))
        events.append((EV_WINDOW, 0))
