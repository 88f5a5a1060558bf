"""The receive side of the HTTP/2 codec: what each client frame does to the connection (RFC 9113 6). A mixin of
:class:`h2_codec.H2ServerCodec`; handlers append ``h2_state.EV_*`` tuples to ``events``."""

from __future__ import annotations

from collections.abc import Callable

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire.errors import ErrorCodes
from gatekeeper.proxy.h2wire.hpack_decode import BlockDecoder, HeaderBlockError, HeaderListTooLarge
from gatekeeper.proxy.h2wire.hpack_encode import ResponseEncoder
from gatekeeper.proxy.listen.body_budget import Share
from gatekeeper.proxy.listen.h2_headers import malformed_trailer
from gatekeeper.proxy.listen.h2_limits import CLOSED_STREAM, EMPTY_FRAME, RST_STREAM, SETTINGS, FloodGuard
from gatekeeper.proxy.listen.h2_state import (
    CLOSED_BY_END,
    EV_BAD_LENGTH,
    EV_DATA,
    EV_ENDED,
    EV_REQUEST,
    EV_RESET,
    EV_WINDOW,
    RESET_BY_PEER,
    RESET_BY_US,
    Event,
    H2ConnectionError,
    HeaderBudgetExceeded,
    StreamState,
)

_U32 = f.U32.unpack_from


class InboundFrames:
    """Frame handlers over the connection state that :class:`h2_codec.H2ServerCodec` sets up."""

    streams: dict[int, StreamState]
    _held: set[int]
    _closed: dict[int, int]
    highest_inbound_stream_id: int
    decoder: BlockDecoder
    encoder: ResponseEncoder
    _guard: FloodGuard | None
    _on_refused: Callable[[int], None] | None
    max_concurrent_streams: int
    _stream_window: int
    _peer_initial_window: int
    max_outbound_frame_size: int
    _recv_window: int
    _send_window: int
    _out: list[bytes]
    _cont_sid: int
    _cont_parts: list[bytes]
    _cont_end_stream: bool
    _cont_bad_priority: bool
    _cont_bytes: int
    header_budget: Share | None

    def acknowledge_received_data(self, acknowledged_size: int, stream_id: int) -> None:
        raise NotImplementedError

    def close_connection(self, error_code: int = 0, last_stream_id: int | None = None) -> None:
        raise NotImplementedError

    def _remember(self, sid: int, how: int) -> None:
        raise NotImplementedError

    def _fail(self, code: ErrorCodes, message: str) -> None:
        self.close_connection(code)
        raise H2ConnectionError(code, message)

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

    def _unpad(self, flags: int, buf: bytes, start: int, length: int, fixed: int = 0) -> tuple[int, int]:
        """(start, length) of the payload past the pad length byte and ``fixed`` bytes, minus padding."""
        if not flags & f.PADDED:
            if length < fixed:
                self._fail(ErrorCodes.FRAME_SIZE_ERROR, "frame too short")
            return start + fixed, length - fixed
        if length < 1 + fixed:
            self._fail(ErrorCodes.FRAME_SIZE_ERROR, "padded frame too short")
        pad = buf[start]
        body = length - 1 - fixed - pad
        if body < 0:
            self._fail(ErrorCodes.PROTOCOL_ERROR, "padding longer than the frame")
        return start + 1 + fixed, body

    # ------------------------------------------------------------------ HEADERS and CONTINUATION

    def _on_headers(self, flags: int, sid: int, buf: bytes, start: int, length: int, events: list[Event]) -> None:
        if not sid or not sid & 1:
            self._fail(ErrorCodes.PROTOCOL_ERROR, f"HEADERS on stream {sid}: client streams are odd and non-zero")
        bad_priority = False
        if flags & f.PRIORITY_FLAG:
            first, length = self._unpad(flags, buf, start, length, 5)
            bad_priority = (_U32(buf, first - 5)[0] & 0x7FFFFFFF) == sid
        elif flags & f.PADDED:
            first, length = self._unpad(flags, buf, start, length)
        else:
            first = start
        if sid not in self.streams and sid <= self.highest_inbound_stream_id:
            self._count(CLOSED_STREAM)
            if not self._closed.get(sid):
                self._closed_stream_frame(sid, "HEADERS")  # connection error
        fragment = buf[first:first + length]
        if flags & f.END_HEADERS:
            self._header_block(sid, fragment, flags & f.END_STREAM, bad_priority, events)
        else:
            self._hold_header_bytes(length)
            self._cont_sid = sid
            self._cont_parts = [fragment]
            self._cont_end_stream = bool(flags & f.END_STREAM)
            self._cont_bad_priority = bad_priority

    def _on_continuation(self, flags: int, sid: int, buf: bytes, start: int, length: int,
                         events: list[Event]) -> None:
        if not self._cont_sid:
            self._fail(ErrorCodes.PROTOCOL_ERROR, "CONTINUATION without a header block in progress")
        if not length:
            self._count(EMPTY_FRAME)
        if self._is_closed(sid):
            self._count(CLOSED_STREAM)
        parts = self._cont_parts
        self._hold_header_bytes(length)
        parts.append(buf[start:start + length])
        if len(parts) > f.MAX_CONTINUATIONS:
            self._fail(ErrorCodes.ENHANCE_YOUR_CALM, "too many CONTINUATION frames")
        if flags & f.END_HEADERS:
            self.release_pending()
            self._cont_sid = 0
            self._cont_parts = []
            self._header_block(sid, b"".join(parts), self._cont_end_stream, self._cont_bad_priority, events)

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
        except HeaderBlockError as exc:
            self._fail(ErrorCodes.COMPRESSION_ERROR, f"undecodable header block: {exc}")
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
        first, size = self._unpad(flags, buf, start, length) if flags & f.PADDED else (start, length)
        if not size and not flags & f.END_STREAM:
            self._count(EMPTY_FRAME)
        if length > self._recv_window:
            self._fail(ErrorCodes.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._recv_window -= length
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

    def _on_window_update(self, sid: int, buf: bytes, start: int, length: int, events: list[Event]) -> None:
        if length != 4:
            self._fail(ErrorCodes.FRAME_SIZE_ERROR, "WINDOW_UPDATE payload must be 4 bytes")
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

    def _on_rst_stream(self, sid: int, buf: bytes, start: int, length: int, events: list[Event]) -> None:
        if length != 4:
            self._fail(ErrorCodes.FRAME_SIZE_ERROR, "RST_STREAM payload must be 4 bytes")
        if not sid:
            self._fail(ErrorCodes.PROTOCOL_ERROR, "RST_STREAM on stream 0")
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

    def _on_settings(self, flags: int, sid: int, buf: bytes, start: int, length: int, events: list[Event]) -> None:
        if sid:
            self._fail(ErrorCodes.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & f.ACK:
            if length:
                self._fail(ErrorCodes.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if length % 6:
            self._fail(ErrorCodes.FRAME_SIZE_ERROR, "SETTINGS payload not a multiple of 6")
        self._count(SETTINGS)
        initial = self._peer_initial_window
        for pos in range(start, start + length, 6):
            key, value = f.SETTING.unpack_from(buf, pos)
            if key == f.HEADER_TABLE_SIZE:
                self.encoder.header_table_size = value
            elif key == f.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    self._fail(ErrorCodes.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE above 2^31-1")
                initial = value  # applied once below: a frame of 2730 of these must not walk the streams 2730 times
            elif key == f.MAX_FRAME_SIZE:
                if not f.MIN_FRAME_SIZE <= value <= f.MAX_FRAME_SIZE_LIMIT:
                    self._fail(ErrorCodes.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value} out of range")
                self.max_outbound_frame_size = value
            elif key in (f.ENABLE_PUSH, f.ENABLE_CONNECT_PROTOCOL) and value > 1:
                self._fail(ErrorCodes.PROTOCOL_ERROR, f"setting {key} must be 0 or 1")
        if initial != self._peer_initial_window:
            delta = initial - self._peer_initial_window
            self._peer_initial_window = initial
            for stream in self.streams.values():
                stream.send_window += delta
                if stream.send_window > f.MAX_WINDOW:
                    self._fail(ErrorCodes.FLOW_CONTROL_ERROR, "a stream window went above 2^31-1")
        self._out.append(f.frame(f.SETTINGS, f.ACK, 0))
        events.append((EV_WINDOW, 0))
