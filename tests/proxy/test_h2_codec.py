"""The HTTP/2 server codec (``h2_codec.H2ServerCodec``) driven with raw frames, no sockets.

Each test sends the bytes a client (or an attacker) would and checks the frames
and events that come out. The adapter-level behaviour (H2Protocol) is covered
by the ``h2pair`` tests; h2spec checks the whole proxy.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from hpack import Decoder, Encoder, NeverIndexedHeaderTuple

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire.errors import ErrorCodes, ProtocolError
from gatekeeper.proxy.listen.h2_codec import (
    EV_BAD_LENGTH,
    EV_DATA,
    EV_ENDED,
    EV_GOAWAY,
    EV_REQUEST,
    EV_RESET,
    EV_WINDOW,
    H2ServerCodec,
)
from gatekeeper.proxy.listen.h2_limits import FloodError, FloodGuard
from gatekeeper.proxy.listen.h2_send import CLOSED_MEMORY

GET = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"a.test"), (b":path", b"/api")]


class Client:
    """A raw-frame client: encodes header blocks, parses what the server sends back."""

    def __init__(self, **kwargs: Any) -> None:
        self.server = H2ServerCodec(**kwargs)
        self.server.initiate_connection()
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.frames: list[tuple[int, int, int, bytes]] = []
        self.events: list[tuple[Any, ...]] = []
        self.take()  # our SETTINGS and connection WINDOW_UPDATE

    def send(self, data: bytes) -> list[tuple[Any, ...]]:
        events = self.server.receive_data(data)
        self.events += events
        self.take()
        return events

    def open(self, settings: dict[int, int] | None = None) -> None:
        self.send(f.PREFACE + f.settings_frame(settings or {}))

    def block(self, headers: list[Any] = GET) -> bytes:
        return self.encoder.encode(headers)

    def headers(self, sid: int, headers: list[Any] = GET, *, end_stream: bool = True) -> list[tuple[Any, ...]]:
        flags = f.END_HEADERS | (f.END_STREAM if end_stream else 0)
        return self.send(f.frame(f.HEADERS, flags, sid, self.block(headers)))

    def take(self) -> list[tuple[int, int, int, bytes]]:
        data, new = self.server.data_to_send(), []
        pos = 0
        while pos < len(data):
            lt, flags, sid = f.FRAME_HEADER.unpack_from(data, pos)
            payload = data[pos + 9:pos + 9 + (lt >> 8)]
            new.append((lt & 0xFF, flags, sid, payload))
            pos += 9 + (lt >> 8)
        self.frames += new
        return new

    def of_type(self, ftype: int) -> list[tuple[int, int, int, bytes]]:
        return [fr for fr in self.frames if fr[0] == ftype]

    def resets(self) -> dict[int, int]:
        return {sid: struct.unpack(">I", p)[0] for t, _, sid, p in self.frames if t == f.RST_STREAM}

    def goaway_code(self) -> int | None:
        found = self.of_type(f.GOAWAY)
        return struct.unpack(">II", found[-1][3][:8])[1] if found else None

    def connection_error(self, data: bytes) -> int | None:
        with pytest.raises(ProtocolError):
            self.send(data)
        self.take()
        return self.goaway_code()


def test_request_headers_become_one_request_event_with_the_decoded_block():
    c = Client()
    c.open()
    token = NeverIndexedHeaderTuple(b"authorization", b"Bearer " + b"t" * 900)
    events = c.headers(1, [*GET, token])
    assert events == [(EV_REQUEST, 1, [*GET, (b"authorization", b"Bearer " + b"t" * 900)], True)]
    assert c.server.highest_inbound_stream_id == 1
    assert (f.SETTINGS, f.ACK, 0, b"") in c.frames


def test_headers_beyond_limit_refuses_only_that_stream():
    c = Client(max_concurrent_streams=2)
    c.open()
    c.headers(1)
    c.headers(3)
    events = c.headers(5)
    assert events == [] and c.resets() == {5: ErrorCodes.REFUSED_STREAM}
    assert c.goaway_code() is None
    c.server.send_headers(1, [(b":status", b"200")], end_stream=True)  # stream 1 done on both sides...
    assert c.headers(7) == []  # ...but still held: its handler has not finished
    c.server.release_stream(1)
    assert [e[:2] for e in c.headers(9)] == [(EV_REQUEST, 9)]
    c.server.reset_stream(3, ErrorCodes.NO_ERROR)
    c.server.release_stream(3)
    # the refused streams' blocks were decoded: the HPACK table is still in step
    assert c.headers(11, [*GET, (b"x-after", b"refusal")])[0][2][-1] == (b"x-after", b"refusal")


def test_stream_reset_by_client_keeps_its_slot_until_released():
    c = Client(max_concurrent_streams=1)
    c.open()
    c.headers(1, end_stream=False)
    assert c.send(f.rst_stream(1, ErrorCodes.CANCEL)) == [(EV_RESET, 1, ErrorCodes.CANCEL)]
    c.headers(3)
    assert c.resets() == {3: ErrorCodes.REFUSED_STREAM}  # rapid reset cannot run unbounded handlers
    c.server.release_stream(1)
    assert [e[0] for e in c.headers(5)] == [EV_REQUEST]


def test_data_beyond_the_connection_window_is_a_connection_error():
    c = Client(stream_window=65535, connection_window=65535)
    c.open()
    c.headers(1, end_stream=False)
    c.headers(3, end_stream=False)
    c.send(f.frame(f.DATA, 0, 1, b"x" * 16384) * 3)
    assert c.connection_error(f.frame(f.DATA, 0, 3, b"x" * 16384)) == ErrorCodes.FLOW_CONTROL_ERROR


def test_data_beyond_the_stream_window_resets_only_that_stream():
    c = Client(stream_window=1000, connection_window=1 << 20)
    c.open()
    c.headers(1, end_stream=False)
    c.headers(3, end_stream=False)
    events = c.send(f.frame(f.DATA, 0, 1, b"x" * 1001))
    assert events == [(EV_RESET, 1, ErrorCodes.FLOW_CONTROL_ERROR)]
    assert c.resets() == {1: ErrorCodes.FLOW_CONTROL_ERROR} and c.goaway_code() is None
    assert c.send(f.frame(f.DATA, f.END_STREAM, 3, b"y" * 1000)) == [(EV_DATA, 3, b"y" * 1000, 1000), (EV_ENDED, 3)]


def test_padding_counts_against_the_window_but_is_not_delivered():
    c = Client()
    c.open()
    c.headers(1, end_stream=False)
    events = c.send(f.frame(f.DATA, f.PADDED | f.END_STREAM, 1, bytes([5]) + b"abc" + b"\0" * 5))
    assert events == [(EV_DATA, 1, b"abc", 9), (EV_ENDED, 1)]


def test_acknowledged_data_reopens_both_windows_once_half_is_used():
    c = Client(stream_window=40000, connection_window=160000)
    c.open()
    c.headers(1, end_stream=False)
    c.send(f.frame(f.DATA, 0, 1, b"x" * 16000))
    c.server.acknowledge_received_data(16000, 1)
    assert c.take() == []  # more than half of each window left: no update yet
    c.send(f.frame(f.DATA, 0, 1, b"x" * 16000))
    c.server.acknowledge_received_data(16000, 1)
    assert [(t, sid, struct.unpack(">I", p)[0]) for t, _, sid, p in c.take()] == [(f.WINDOW_UPDATE, 1, 32000)]
    assert c.server.streams[1].recv_window == 40000


def test_initial_window_size_change_applies_to_open_streams():
    c = Client()
    c.open()
    c.headers(1)
    assert c.server.local_flow_control_window(1) == 65535
    c.server.send_data(1, b"x" * 1000)
    events = c.send(f.settings_frame({f.INITIAL_WINDOW_SIZE: 100}))
    assert (EV_WINDOW, 0) in events
    assert c.server.streams[1].send_window == 100 - 1000  # may go negative (RFC 9113 6.9.2)
    c.send(f.settings_frame({f.INITIAL_WINDOW_SIZE: 2000}))
    assert c.server.local_flow_control_window(1) == 1000


def test_window_update_overflow_is_a_stream_or_connection_error():
    c = Client()
    c.open()
    c.headers(1)
    assert c.send(f.window_update(1, f.MAX_WINDOW)) == [(EV_RESET, 1, ErrorCodes.FLOW_CONTROL_ERROR)]
    assert c.resets() == {1: ErrorCodes.FLOW_CONTROL_ERROR} and c.goaway_code() is None
    assert c.connection_error(f.window_update(0, f.MAX_WINDOW)) == ErrorCodes.FLOW_CONTROL_ERROR


def test_max_frame_size_from_the_client_splits_data_and_headers():
    c = Client()
    c.open({f.MAX_FRAME_SIZE: 16384})
    c.headers(1)
    c.server.send_headers(1, [(b":status", b"200"), (b"x-big", b"v" * 40000)])
    c.server.send_data(1, b"d" * 40000, end_stream=True)
    kinds = [(t, len(p), fl) for t, fl, sid, p in c.take() if sid == 1]
    assert [k[0] for k in kinds] == [f.HEADERS, f.CONTINUATION, f.CONTINUATION, f.DATA, f.DATA, f.DATA]
    assert all(n <= 16384 for _, n, _ in kinds)
    assert kinds[2][2] & f.END_HEADERS and kinds[5][2] & f.END_STREAM and not kinds[3][2] & f.END_STREAM
    assert sum(n for t, n, _ in kinds if t == f.DATA) == 40000
    assert c.connection_error(f.settings_frame({f.MAX_FRAME_SIZE: 100})) == ErrorCodes.PROTOCOL_ERROR


def test_frame_larger_than_our_max_frame_size_is_a_frame_size_error():
    c = Client()
    c.open()
    c.headers(1, end_stream=False)
    assert c.connection_error(f.frame(f.DATA, 0, 1, b"x" * 16385)) == ErrorCodes.FRAME_SIZE_ERROR


def test_header_block_split_over_continuation_frames_is_one_request():
    c = Client()
    c.open()
    block = c.block([*GET, (b"x-long", b"l" * 3000)])
    frames = f.frame(f.HEADERS, f.END_STREAM, 1, block[:1000]) + f.frame(f.CONTINUATION, 0, 1, block[1000:2000])
    assert c.send(frames) == []
    events = c.send(f.frame(f.CONTINUATION, f.END_HEADERS, 1, block[2000:]))
    assert events[0][:2] == (EV_REQUEST, 1) and events[0][2][-1] == (b"x-long", b"l" * 3000)


def test_another_frame_inside_a_header_block_is_a_connection_error():
    c = Client()
    c.open()
    c.send(f.frame(f.HEADERS, f.END_STREAM, 1, c.block()[:3]))
    assert c.connection_error(f.frame(f.PING, 0, 0, b"12345678")) == ErrorCodes.PROTOCOL_ERROR


def test_endless_continuation_frames_are_cut():
    c = Client()
    c.open()
    c.send(f.frame(f.HEADERS, 0, 1, c.block()[:1]))
    with pytest.raises(ProtocolError):
        for _ in range(100):
            c.send(f.frame(f.CONTINUATION, 0, 1, b"\x00"))
    c.take()
    assert c.goaway_code() == ErrorCodes.ENHANCE_YOUR_CALM


def test_header_list_over_the_limit_is_enhance_your_calm():
    c = Client(max_header_list=4096)
    c.open()
    big = f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, c.block([*GET, (b"x-big", b"b" * 5000)]))
    assert c.connection_error(big) == ErrorCodes.ENHANCE_YOUR_CALM


def test_undecodable_header_block_is_a_compression_error():
    c = Client()
    c.open()
    bad = f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, b"\xff\xff\xff\xff\xff\x7f")
    assert c.connection_error(bad) == ErrorCodes.COMPRESSION_ERROR


def test_body_longer_than_content_length_resets_only_that_stream():
    c = Client()
    c.open()
    c.headers(1, [*GET, (b"content-length", b"3")], end_stream=False)
    events = c.send(f.frame(f.DATA, 0, 1, b"abcd"))
    assert events == [(EV_BAD_LENGTH, 1)] and c.resets() == {1: ErrorCodes.PROTOCOL_ERROR}
    c.headers(3, [*GET, (b"content-length", b"3")], end_stream=False)
    assert c.send(f.frame(f.DATA, f.END_STREAM, 3, b"ab")) == [(EV_BAD_LENGTH, 3)]
    c.headers(5, [*GET, (b"content-length", b"+3")], end_stream=False)
    assert c.events[-1] == (EV_BAD_LENGTH, 5)  # not a number: malformed, never a request
    assert c.goaway_code() is None


def test_trailers_end_the_stream_and_must_carry_end_stream():
    c = Client()
    c.open()
    c.headers(1, end_stream=False)
    assert c.headers(1, [(b"x-trailer", b"1")]) == [(EV_ENDED, 1)]
    c.headers(3, end_stream=False)
    assert c.headers(3, [(b"x-trailer", b"1")], end_stream=False) == [(EV_RESET, 3, ErrorCodes.PROTOCOL_ERROR)]


def test_frames_on_closed_streams_get_the_error_their_closing_calls_for():
    c = Client()
    c.open()
    c.headers(3, end_stream=False)
    c.send(f.rst_stream(3, ErrorCodes.CANCEL))
    c.send(f.frame(f.DATA, 0, 3, b"late"))
    assert c.resets() == {3: ErrorCodes.STREAM_CLOSED} and c.goaway_code() is None  # closed by reset
    assert c.server._recv_window + c.server._recv_unacked == 65535  # its window is handed back
    c.headers(5)
    c.server.send_headers(5, [(b":status", b"204")], end_stream=True)
    assert c.connection_error(f.frame(f.DATA, 0, 5, b"x")) == ErrorCodes.STREAM_CLOSED  # closed by END_STREAM


def test_headers_on_a_lower_never_opened_stream_is_a_protocol_error():
    c = Client()
    c.open()
    c.headers(5)
    assert c.connection_error(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 3, c.block())) == \
        ErrorCodes.PROTOCOL_ERROR


def test_closed_stream_memory_is_bounded():
    c = Client(max_concurrent_streams=10**6)
    c.open()
    for sid in range(1, 2 * CLOSED_MEMORY + 200, 2):
        c.headers(sid)
        c.server.send_headers(sid, [(b":status", b"204")], end_stream=True)
        c.server.release_stream(sid)
    assert len(c.server._closed) <= CLOSED_MEMORY and not c.server.streams and not c.server.held_streams


def test_priority_is_ignored_unless_a_stream_depends_on_itself():
    c = Client()
    c.open()
    assert c.send(f.frame(f.PRIORITY, 0, 1, struct.pack(">IB", 3, 16))) == []
    assert [e[:2] for e in c.headers(1)] == [(EV_REQUEST, 1)]  # PRIORITY did not open stream 1
    c.send(f.frame(f.PRIORITY, 0, 7, struct.pack(">IB", 7, 16)))
    assert c.resets() == {7: ErrorCodes.PROTOCOL_ERROR} and c.goaway_code() is None


def test_unknown_frame_types_are_ignored():
    c = Client()
    c.open()
    assert c.send(f.frame(0xFA, 0xFF, 0, b"whatever")) == []
    assert [e[0] for e in c.headers(1)] == [EV_REQUEST]


def test_frames_split_at_every_byte_parse_the_same():
    c = Client()
    data = f.PREFACE + f.settings_frame({}) + f.frame(f.HEADERS, f.END_HEADERS, 1, c.block())
    data += f.frame(f.DATA, f.END_STREAM, 1, b"body")
    for i in range(len(data)):
        c.send(data[i:i + 1])
    assert [e[0] for e in c.events] == [EV_WINDOW, EV_REQUEST, EV_DATA, EV_ENDED]


def test_a_bad_preface_or_first_frame_is_a_protocol_error():
    assert Client().connection_error(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == ErrorCodes.PROTOCOL_ERROR
    assert Client().connection_error(f.PREFACE + f.frame(f.PING, 0, 0, b"12345678")) == ErrorCodes.PROTOCOL_ERROR


def test_ping_is_answered_and_a_ping_flood_ends_in_enhance_your_calm():
    guard = FloodGuard({"rst_stream": 10, "ping": 3, "settings": 10, "empty_frame": 10, "closed_stream": 10}, 10.0)
    c = Client(guard=guard)
    c.open()
    for _ in range(3):
        c.send(f.frame(f.PING, 0, 0, b"pingpong"))
    assert c.of_type(f.PING) == [(f.PING, f.ACK, 0, b"pingpong")] * 3
    with pytest.raises(FloodError):
        c.send(f.frame(f.PING, 0, 0, b"pingpong"))
    c.take()
    assert c.goaway_code() == ErrorCodes.ENHANCE_YOUR_CALM


def test_empty_data_and_closed_stream_frames_are_counted():
    guard = FloodGuard({"rst_stream": 100, "ping": 10, "settings": 10, "empty_frame": 2, "closed_stream": 2}, 10.0)
    c = Client(guard=guard)
    c.open()
    c.headers(1, end_stream=False)
    c.send(f.frame(f.DATA, 0, 1, b"") * 2)
    with pytest.raises(FloodError, match="empty_frame"):
        c.send(f.frame(f.DATA, 0, 1, b""))
    c2 = Client(guard=FloodGuard(dict(guard.limits), 10.0))
    c2.open()
    c2.headers(1, end_stream=False)
    c2.send(f.rst_stream(1, 0))
    c2.send(f.rst_stream(1, 0))  # closed stream: 1
    c2.send(f.rst_stream(1, 0))  # 2
    with pytest.raises(FloodError, match="closed_stream"):
        c2.send(f.rst_stream(1, 0))


def test_peer_goaway_is_reported_and_streams_can_still_be_answered():
    c = Client()
    c.open()
    c.headers(1)
    assert c.send(f.goaway(1, 0)) == [(EV_GOAWAY, 0, 0)]
    c.server.send_headers(1, [(b":status", b"200")], end_stream=True)
    assert [fr[0] for fr in c.take()] == [f.HEADERS]


def test_close_connection_sends_goaway_with_the_last_stream_and_stops_parsing():
    c = Client()
    c.open()
    c.headers(1)
    c.server.close_connection(last_stream_id=1)
    c.take()
    assert c.goaway_code() == 0 and struct.unpack(">I", c.of_type(f.GOAWAY)[0][3][:4])[0] == 1
    assert c.send(f.frame(f.PING, 0, 0, b"12345678")) == []


def test_headers_on_a_reset_stream_are_answered_and_counted_as_closed_stream_frames():
    guard = FloodGuard({"rst_stream": 100, "ping": 10, "settings": 10, "empty_frame": 10, "closed_stream": 2}, 10.0)
    c = Client(guard=guard)
    c.open()
    c.headers(1, end_stream=False)
    c.send(f.rst_stream(1, ErrorCodes.CANCEL))
    assert c.headers(1) == [] and c.resets() == {1: ErrorCodes.STREAM_CLOSED}
    c.headers(1)
    with pytest.raises(FloodError, match="closed_stream"):
        c.headers(1)


def test_frames_on_a_stream_we_reset_are_ignored_but_counted_and_their_window_returned():
    guard = FloodGuard({"rst_stream": 100, "ping": 10, "settings": 10, "empty_frame": 10, "closed_stream": 2}, 10.0)
    c = Client(max_concurrent_streams=1, guard=guard)
    c.open()
    c.headers(1, end_stream=False)
    c.headers(3, end_stream=False)  # refused: the client's body for it is already on the way
    assert c.resets() == {3: ErrorCodes.REFUSED_STREAM}
    c.send(f.frame(f.DATA, 0, 3, b"x" * 1000) + f.frame(f.DATA, f.END_STREAM, 3, b"x" * 10))
    assert c.resets() == {3: ErrorCodes.REFUSED_STREAM} and c.goaway_code() is None  # no RST_STREAM back
    assert c.server._recv_window + c.server._recv_unacked == 65535
    with pytest.raises(FloodError, match="closed_stream"):
        c.send(f.frame(f.DATA, 0, 3, b"x"))
