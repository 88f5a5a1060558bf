"""Adversarial input for the HTTP/2 server codec, with the ``h2`` library (``h2_oracle``) as the reference.

Every byte from a client is hostile. Each test sends raw frames (or raw HPACK
blocks) built to break one rule: hold memory, make us decode a block
differently from ``hpack``, slip a request past a check, or make the server do
work the flood accounting never sees. A passing test documents a defence that
holds; the ones written for a bug failed before its fix.
"""

from __future__ import annotations

import asyncio
import random
import struct
from typing import Any

import h2.exceptions
import pytest
from h2.settings import SettingCodes, Settings
from h2_oracle import ProxyH2Connection
from hpack import Decoder, Encoder
from hpack.exceptions import HPACKError
from test_h2_codec import GET, Client

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire.errors import ErrorCodes, ProtocolError
from gatekeeper.proxy.h2wire.hpack_decode import BlockDecoder, HeaderBlockError, HeaderListTooLarge
from gatekeeper.proxy.h2wire.hpack_encode import MAX_TABLE_SIZE
from gatekeeper.proxy.listen.h2_codec import EV_BAD_LENGTH, EV_DATA, EV_ENDED, EV_REQUEST, EV_RESET, H2ServerCodec
from gatekeeper.proxy.listen.h2_limits import FloodError, FloodGuard
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import ProtocolSettings

POST = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"a.test"), (b":path", b"/api")]
LIMITS = {"rst_stream": 50, "ping": 50, "settings": 50, "empty_frame": 50, "closed_stream": 50}


def _h2_oracle(max_header_list: int = 1 << 16) -> ProxyH2Connection:
    """The h2 library's server (the oracle, ``h2_oracle``), set up as the proxy once ran it, its preface taken."""
    conn = ProxyH2Connection(guard=FloodGuard(dict(LIMITS), 10.0))
    conn.local_settings = Settings(client=False, initial_values={SettingCodes.MAX_HEADER_LIST_SIZE: max_header_list})
    conn.decoder.max_header_list_size = max_header_list
    conn.initiate_connection()
    conn.data_to_send()
    return conn


def _h2_goaway(conn: ProxyH2Connection, data: bytes) -> int | None:
    """Feed ``data`` to the oracle; the GOAWAY code it answered with (None: no connection error)."""
    try:
        conn.receive_events(data)
    except (h2.exceptions.ProtocolError, ProtocolError):  # h2's own, or the codec's limits it runs with
        pass
    return _goaway_code(conn.data_to_send())


def _goaway_code(data: bytes) -> int | None:
    """The error code of the last GOAWAY in ``data`` (frames as the server wrote them)."""
    code, pos = None, 0
    while pos + 9 <= len(data):
        lt, _, _ = f.FRAME_HEADER.unpack_from(data, pos)
        if lt & 0xFF == f.GOAWAY:
            code = struct.unpack_from(">I", data, pos + 13)[0]
        pos += 9 + (lt >> 8)
    return code


def _huffman_literal(name: bytes, huffman_value: bytes) -> bytes:
    """A literal field without indexing, new name, with a raw (possibly invalid) Huffman value."""
    assert len(name) < 127 and len(huffman_value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([0x80 | len(huffman_value)]) + huffman_value


# ---------------------------------------------------------------------------- HPACK bombs and limits


def test_hpack_bomb_of_indexed_references_is_cut_by_header_list_limit():
    # One ~4 KB entry in the dynamic table, then 1-byte references to it: 4 KB of headers per wire byte.
    entry = Encoder().encode([(b"x", b"b" * 4000)], huffman=False)  # literal with indexing: dynamic index 62
    assert entry[0] == 0x40
    bomb = entry + b"\xbe" * 12000  # index 62 (the entry), 12000 times: 48 MB if nothing stopped it
    assert len(bomb) <= f.MIN_FRAME_SIZE
    c = Client(max_header_list=1 << 16)
    c.open()
    assert c.connection_error(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, bomb)) == ErrorCodes.ENHANCE_YOUR_CALM


def test_header_list_limit_counts_decoded_bytes_not_wire_bytes():
    # 'a' Huffman-codes to 5 bits: 1000 wire bytes are 1600 decoded bytes.
    block = Encoder().encode([(b"x-h", b"a" * 1600)], huffman=True)
    assert len(block) < 1100
    with pytest.raises(HeaderListTooLarge):
        BlockDecoder(1500).decode(block)
    assert BlockDecoder(1600 + 3 + 32).decode(block) == [(b"x-h", b"a" * 1600)]


def test_hpack_integer_with_too_many_continuation_bytes_is_rejected():
    # index 127 + 2^35-ish: an integer longer than any sane index, length or table size
    for block in (b"\xff" + b"\xff" * 6 + b"\x01", b"\x3f" + b"\xff" * 6 + b"\x01",
                  b"\x00\x7f" + b"\xff" * 6 + b"\x01"):
        with pytest.raises(HeaderBlockError):
            BlockDecoder(1 << 20).decode(block)


def test_string_length_far_past_the_block_is_rejected_before_any_copy():
    block = b"\x00\x7f" + b"\xff\xff\xff\xff\x0f" + b"x"  # name length ~2^35
    with pytest.raises(HeaderBlockError, match="past the block"):
        BlockDecoder(1 << 20).decode(block)


@pytest.mark.parametrize("value", [
    b"\xff\xff\xff\xff",  # 32 one bits: contains EOS (30 ones), RFC 7541 5.2 decoding error
    b"\x1f\xff",  # 'a' (00011) then 11 bits of padding: more than 7 bits of padding
    b"\x18",  # 'a' then padding 000: padding that is not the EOS prefix
])
def test_invalid_huffman_padding_or_eos_is_a_compression_error(value):
    block = _huffman_literal(b"x-h", value)
    with pytest.raises(HPACKError):
        Decoder().decode(block)
    with pytest.raises(HeaderBlockError):
        BlockDecoder(1 << 20).decode(block)
    c = Client()
    c.open()
    assert c.connection_error(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, block)) == \
        ErrorCodes.COMPRESSION_ERROR


@pytest.mark.parametrize("block", [
    b"\x82\x20",  # size update after a field
    b"\x3f\xe2\x1f",  # size update to 4097: above the HEADER_TABLE_SIZE we allow (4096)
    b"\x3f\xff\xff\xff\xff\x0f",  # size update to ~2^35
])
def test_misplaced_or_oversized_table_size_update_is_a_compression_error(block):
    c = Client()
    c.open()
    assert c.connection_error(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, block)) == \
        ErrorCodes.COMPRESSION_ERROR
    # RFC 7541 2.3.3/4.2: COMPRESSION_ERROR (the h2 library answers PROTOCOL_ERROR for every undecodable block)


def test_table_size_update_to_zero_evicts_everything_and_later_references_fail():
    d = BlockDecoder(1 << 20)
    d.decode(b"\x40\x01x\x01y")  # x: y into the table
    assert d.decode(b"\xbe") == [(b"x", b"y")]
    d.decode(b"\x20")  # size 0
    assert d._used == 0 and not d._table
    with pytest.raises(HeaderBlockError):
        d.decode(b"\xbe")


# ---------------------------------------------------------------------------- differential HPACK fuzz


def _mutated(rng: random.Random, encoder: Encoder) -> bytes:
    fields = [(rng.choice([b":path", b"x-a", b"x-b", b"authorization", b"accept"]),
               bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 5, 40, 300]))))
              for _ in range(rng.randint(0, 6))]
    block = bytearray(encoder.encode(fields, huffman=rng.random() < 0.5))
    kind = rng.random()
    if kind < 0.3:  # random bytes, biased to the representations' prefixes
        return bytes(rng.choice([0x00, 0x10, 0x20, 0x3f, 0x40, 0x7f, 0x80, 0xbe, 0xff, rng.randrange(256)])
                     for _ in range(rng.randint(1, 24)))
    if kind < 0.6 and block:
        for _ in range(rng.randint(1, 3)):
            block[rng.randrange(len(block))] = rng.randrange(256)
    elif kind < 0.8:
        block[:0] = rng.choice([b"\x20", b"\x3f\xe1\x1f", b"\x3f\xe2\x1f", b"\x3f\x81\x0f", b"\x20\x3f\xe1\x1f"])
    return bytes(block)


def test_random_and_mutated_blocks_decode_exactly_as_hpack_decoder_does():
    """Blocks in sequence on one table (so eviction and size updates carry over), 3000 seeded cases."""
    rng = random.Random(20261201)
    cases = rejected = 0
    while cases < 3000:
        encoder, theirs, ours = Encoder(), Decoder(), BlockDecoder(1 << 12)
        theirs.max_header_list_size = 1 << 12
        for _ in range(rng.randint(1, 12)):
            cases += 1
            block = _mutated(rng, encoder)
            try:
                expected = [(bytes(n), bytes(v)) for n, v in theirs.decode(block, raw=True)]
            except (HPACKError, IndexError, TypeError, ValueError) as exc:
                rejected += 1
                with pytest.raises(HeaderBlockError) as ours_exc:
                    ours.decode(block)
                # the same kind of error: an oversized list is ENHANCE_YOUR_CALM for both
                assert (type(exc).__name__ == "OversizedHeaderListError") == \
                    isinstance(ours_exc.value, HeaderListTooLarge), block
                break  # a connection error ends the connection: its table is gone
            assert ours.decode(block) == expected, block
            assert list(ours._table) == [(bytes(n), bytes(v)) for n, v in theirs.header_table.dynamic_entries]
            assert ours.table_size == theirs.header_table.maxsize
    assert rejected > 300


# ---------------------------------------------------------------------------- header blocks and streams


def test_continuation_for_another_stream_is_a_connection_error():
    c = Client()
    c.open()
    block = c.block()
    c.send(f.frame(f.HEADERS, f.END_STREAM, 1, block[:3]))
    assert c.connection_error(f.frame(f.CONTINUATION, f.END_HEADERS, 3, block[3:])) == ErrorCodes.PROTOCOL_ERROR
    assert not [e for e in c.events if e[0] == EV_REQUEST]


def test_headers_of_another_stream_inside_a_header_block_is_a_connection_error():
    c = Client()
    c.open()
    block = c.block()
    c.send(f.frame(f.HEADERS, f.END_STREAM, 1, block[:3]))
    assert c.connection_error(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 3, block)) == \
        ErrorCodes.PROTOCOL_ERROR


def test_continuation_after_end_headers_is_a_connection_error():
    c = Client()
    c.open()
    c.headers(1)
    assert c.connection_error(f.frame(f.CONTINUATION, f.END_HEADERS, 1, b"\x82")) == ErrorCodes.PROTOCOL_ERROR


def test_header_block_buffer_is_bounded_by_continuation_count_and_frame_size():
    c = Client(max_header_list=1 << 30)
    c.open()
    c.send(f.frame(f.HEADERS, 0, 1, b"\x00" * f.MIN_FRAME_SIZE))
    held = 0
    with pytest.raises(ProtocolError):
        for _ in range(1000):
            c.send(f.frame(f.CONTINUATION, 0, 1, b"\x00" * f.MIN_FRAME_SIZE))
            held = max(held, sum(map(len, c.server._cont_parts)))
    c.take()
    assert held <= (f.MAX_CONTINUATIONS + 1) * f.MIN_FRAME_SIZE
    assert c.goaway_code() == ErrorCodes.ENHANCE_YOUR_CALM


def test_partial_frame_buffer_never_holds_more_than_one_max_size_frame():
    c = Client()
    c.open()
    c.send(f.header(f.DATA, 0, 1, f.MIN_FRAME_SIZE))
    for _ in range(f.MIN_FRAME_SIZE - 1):
        c.send(b"\x00")
    assert len(c.server._buf) == 9 + f.MIN_FRAME_SIZE - 1
    # a header announcing more than MAX_FRAME_SIZE is refused at once, before any payload is buffered
    d = Client()
    d.open()
    assert d.connection_error(f.header(f.DATA, 0, 1, f.MAX_FRAME_SIZE_LIMIT)) == ErrorCodes.FRAME_SIZE_ERROR
    assert d.server._buf == b""


def test_data_after_end_stream_never_reaches_the_request_body():
    c = Client()
    c.open()
    c.headers(1, POST, end_stream=True)
    events = c.send(f.frame(f.DATA, f.END_STREAM, 1, b"smuggled"))
    assert not [e for e in events if e[0] == EV_DATA]
    assert c.resets() == {1: ErrorCodes.STREAM_CLOSED}


def test_conflicting_content_lengths_are_malformed():
    c = Client()
    c.open()
    events = c.headers(1, [*POST, (b"content-length", b"1"), (b"content-length", b"2")], end_stream=False)
    assert [e[:2] for e in events] == [(EV_BAD_LENGTH, 1)]


def test_content_length_on_a_request_ended_by_its_headers_is_malformed():
    """HEADERS+END_STREAM with content-length: 5 would go upstream as a 5-byte body that never comes:
    the HTTP/1.1 backend then reads the next request's first bytes as that body (RFC 9113 8.1.1)."""
    c = Client()
    c.open()
    events = c.headers(1, [*POST, (b"content-length", b"5")], end_stream=True)
    assert not [e for e in events if e[0] == EV_REQUEST]
    assert c.resets() == {1: ErrorCodes.PROTOCOL_ERROR}
    assert [e[:2] for e in events] == [(EV_BAD_LENGTH, 1)]
    assert c.goaway_code() is None  # only that stream
    # zero is what an ended request has: fine; and the HPACK table stayed in step
    assert [e[:2] for e in c.headers(3, [*POST, (b"content-length", b"0")])] == [(EV_REQUEST, 3)]


def test_content_length_of_thousands_of_digits_is_a_stream_error_not_a_crash():
    # int() refuses more than 4300 digits with ValueError: it must not escape receive_data.
    c = Client(max_header_list=1 << 16)
    c.open()
    events = c.headers(1, [*POST, (b"content-length", b"9" * 5000)], end_stream=False)
    assert [e[:2] for e in events] == [(EV_BAD_LENGTH, 1)]
    assert c.resets() == {1: ErrorCodes.PROTOCOL_ERROR}
    assert c.goaway_code() is None


def test_trailers_with_a_pseudo_header_reset_the_stream_and_reach_nobody():
    c = Client()
    c.open()
    c.headers(1, POST, end_stream=False)
    events = c.headers(1, [(b":path", b"/other")], end_stream=True)
    assert not [e for e in events if e[0] == EV_REQUEST]
    assert c.resets() == {1: ErrorCodes.PROTOCOL_ERROR}


@pytest.mark.parametrize("field", [(b"connection", b"close"), (b"transfer-encoding", b"chunked"),
                                   (b"te", b"gzip"), (b"X-Upper", b"1"), (b"upgrade", b"websocket")])
def test_trailers_with_a_connection_specific_field_reset_the_stream(field: tuple[bytes, bytes]) -> None:
    """RFC 9113 8.2.2: the fields a request's headers may not carry are malformed in its trailers too."""
    c = Client()
    c.open()
    c.headers(1, POST, end_stream=False)
    events = c.headers(1, [field], end_stream=True)
    assert not [e for e in events if e[0] == EV_ENDED]  # the request never looks complete
    assert c.resets() == {1: ErrorCodes.PROTOCOL_ERROR}
    assert c.goaway_code() is None  # a stream error: the connection's other streams go on


def test_ordinary_trailers_still_end_the_request() -> None:
    c = Client()
    c.open()
    c.headers(1, POST, end_stream=False)
    events = c.headers(1, [(b"x-checksum", b"abc"), (b"te", b"trailers")], end_stream=True)
    assert [e[:2] for e in events if e[0] == EV_ENDED] == [(EV_ENDED, 1)]
    assert c.resets() == {}


def test_end_stream_flag_on_continuation_does_not_end_the_request():
    """CONTINUATION has no END_STREAM flag (0x1 is undefined there): a client setting it must not get a
    request classified as bodiless while its DATA follows (the h2 library agrees)."""
    block = Encoder().encode(POST)
    frames = f.frame(f.HEADERS, 0, 1, block[:2]) + f.frame(f.CONTINUATION, f.END_HEADERS | 0x1, 1, block[2:])
    c = Client()
    c.open()
    assert [(e[0], e[3]) for e in c.send(frames)] == [(EV_REQUEST, False)]


def test_padding_longer_than_the_frame_is_a_protocol_error():
    block = Encoder().encode(GET)
    frame = f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM | f.PADDED, 1, bytes([255]) + block)
    c = Client()
    c.open()
    assert c.connection_error(frame) == ErrorCodes.PROTOCOL_ERROR


# ---------------------------------------------------------------------------- control frames


def test_huge_header_table_size_setting_does_not_grow_our_encoder_table():
    c = Client()
    c.open({f.HEADER_TABLE_SIZE: 2**32 - 1})
    assert c.server.encoder.header_table_size == MAX_TABLE_SIZE


class _CountingStreams(dict):
    """The codec's stream table, counting the passes over it."""

    passes = 0

    def values(self):
        self.passes += 1
        return super().values()


def test_settings_frame_full_of_window_changes_costs_one_pass_over_the_streams():
    """2730 INITIAL_WINDOW_SIZE entries in one 16 KB frame: one pass over the streams (as h2 does), not one
    per entry (2730 x 250 window updates: ~30 ms of CPU per frame, 100 frames allowed per interval)."""
    c = Client(max_concurrent_streams=250)
    c.open()
    for sid in range(1, 500, 2):
        c.headers(sid, POST, end_stream=False)
    c.server.streams = streams = _CountingStreams(c.server.streams)
    count = f.MIN_FRAME_SIZE // 6
    c.send(f.frame(f.SETTINGS, 0, 0, b"".join(f.SETTING.pack(f.INITIAL_WINDOW_SIZE, 1000 + i % 2)
                                               for i in range(count))))
    assert streams.passes <= 1
    assert {s.send_window for s in streams.values()} == {1000 + (count - 1) % 2}  # the last value counts


def test_window_overflow_through_initial_window_size_is_a_flow_control_error():
    c = Client()
    c.open()
    c.headers(1, POST, end_stream=False)
    c.send(f.window_update(1, f.MAX_WINDOW - f.DEFAULT_WINDOW))
    assert c.connection_error(f.settings_frame({f.INITIAL_WINDOW_SIZE: f.DEFAULT_WINDOW + 1})) == \
        ErrorCodes.FLOW_CONTROL_ERROR


def test_window_updates_on_a_closed_stream_cost_no_output_and_no_memory():
    c = Client(guard=FloodGuard(dict(LIMITS), 10.0))
    c.open()
    c.headers(1)
    c.server.send_headers(1, [(b":status", b"200")], end_stream=True)  # stream 1 closed on both sides
    c.take()
    closed = dict(c.server._closed)
    c.send(f.window_update(1, 1) * 10_000)
    assert c.take() == [] and c.server._closed == closed and c.server.streams == {}


@pytest.mark.parametrize("payload", [
    lambda sid: b"\x00" * 6,  # length 6, not 5: stream error FRAME_SIZE_ERROR
    lambda sid: struct.pack(">IB", sid, 16),  # depends on itself: stream error PROTOCOL_ERROR
], ids=["bad-length", "self-dependency"])
def test_priority_frames_that_force_a_reset_are_counted_as_a_flood(payload):
    """A PRIORITY frame the server must answer with RST_STREAM costs the client 14 bytes: in volume it
    is a reset flood (CVE-2019-9514) unless counted. The h2 library fails the connection at once."""
    c = Client(guard=FloodGuard(dict(LIMITS), 10.0))
    c.open()
    with pytest.raises(FloodError):
        for sid in range(3, 20_001, 2):
            c.send(f.frame(f.PRIORITY, 0, sid, payload(sid)))
    c.take()
    assert c.goaway_code() == ErrorCodes.ENHANCE_YOUR_CALM
    assert len(c.of_type(f.RST_STREAM)) <= LIMITS["rst_stream"]


@pytest.mark.parametrize("provoke", [
    lambda sid: f.window_update(sid, f.MAX_WINDOW),  # stream window overflow: FLOW_CONTROL_ERROR
    lambda sid: f.frame(f.PRIORITY, 0, sid, b"\x00" * 6),  # bad PRIORITY length: FRAME_SIZE_ERROR
    lambda sid: f.frame(f.DATA, 0, sid, b"x" * 200),  # beyond the 100-byte stream window: FLOW_CONTROL_ERROR
], ids=["window-overflow", "priority-length", "data-over-window"])
def test_streams_the_client_makes_us_reset_keep_their_slot_until_the_handler_is_done(provoke):
    """MadeYouReset (CVE-2025-8671): a stream error the client provokes closes the stream at once; if that
    freed its MAX_CONCURRENT_STREAMS slot while the handler (and its upstream request) still ran, a client
    could run unbounded backend work. The adapter is told (EV_RESET) and the slot stays held."""
    c = Client(max_concurrent_streams=1, stream_window=100)
    c.open()
    c.headers(1, POST, end_stream=False)
    events = c.send(provoke(1))
    assert [e[:2] for e in events if e[0] == EV_RESET] == [(EV_RESET, 1)]
    assert c.headers(3) == [] and c.resets()[3] == ErrorCodes.REFUSED_STREAM  # slot still held
    c.server.release_stream(1)  # the handler finished
    assert [e[:2] for e in c.headers(5)] == [(EV_REQUEST, 5)]


def test_request_after_refusal_decodes_with_the_table_the_refused_block_built():
    c = Client(max_concurrent_streams=1)
    c.open()
    c.headers(1, POST, end_stream=False)
    c.headers(3, [*GET, (b"x-indexed", b"1")])  # refused, but its literal entered both tables
    c.server.reset_stream(1, ErrorCodes.NO_ERROR)
    c.server.release_stream(1)
    events = c.headers(5, [*GET, (b"x-indexed", b"1")])
    assert events[0][2][-1] == (b"x-indexed", b"1")


# ---------------------------------------------------------------------------- differential frame fuzz


def _random_frames(rng: random.Random) -> list[bytes]:
    """A preface and a request on stream 1, then 1..12 frames, mostly on opened streams: requests (some
    with content-length, some split over CONTINUATION, some trailers), DATA (some padded), RST_STREAM,
    WINDOW_UPDATE, PRIORITY."""
    encoder = Encoder()
    frames = [f.PREFACE + f.settings_frame({}), f.frame(f.HEADERS, f.END_HEADERS, 1, encoder.encode(POST))]
    opened = [1]
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        sid = rng.choice(opened) if rng.random() < 0.8 else rng.choice([1, 3, 5, 7])
        if kind < 0.35:
            if rng.random() < 0.5:
                sid = opened[-1] + 2
                opened.append(sid)
            fields = list(POST) if rng.random() < 0.8 else [(b"x-t", b"1")]
            if rng.random() < 0.4:
                fields.append((b"content-length", rng.choice([b"0", b"3", b"5", b"x"])))
            block = encoder.encode(fields)
            flags = f.END_STREAM if rng.random() < 0.5 else 0
            if rng.random() < 0.3 and len(block) > 1:
                cut = rng.randrange(1, len(block))
                frames.append(f.frame(f.HEADERS, flags, sid, block[:cut]))
                frames.append(f.frame(f.CONTINUATION, f.END_HEADERS | (rng.random() < 0.3),
                                      rng.choice([sid, sid, 3]), block[cut:]))
            else:
                frames.append(f.frame(f.HEADERS, flags | f.END_HEADERS, sid, block))
        elif kind < 0.7:
            data, flags = b"d" * rng.choice([0, 1, 3, 5]), f.END_STREAM if rng.random() < 0.5 else 0
            padded = rng.random() < 0.2
            frames.append(f.frame(f.DATA, flags | (f.PADDED if padded else 0), sid,
                                  bytes([2]) + data + b"\0\0" if padded else data))
        elif kind < 0.8:
            frames.append(f.rst_stream(sid, ErrorCodes.CANCEL))
        elif kind < 0.9:
            frames.append(f.window_update(rng.choice([0, sid]), rng.choice([1, 1000])))
        else:
            frames.append(f.frame(f.PRIORITY, 0, sid, struct.pack(">IB", rng.choice([0, 1]), 1)))
    return frames


def _delivered(events: list[tuple[Any, ...]], cut: set[int]) -> list[tuple[Any, ...]]:
    """What reaches the pipeline: requests, body bytes and ends, of the streams neither side cut."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if e[1] in cut:
            continue
        if e[0] == EV_REQUEST:
            out.append(("request", e[1], [(bytes(n), bytes(v)) for n, v in e[2]], e[3]))
        elif e[0] == EV_DATA and e[2]:
            out.append(("data", e[1], bytes(e[2])))
        elif e[0] == EV_ENDED and ("request", e[1]) not in {(x[0], x[1]) for x in out if x[-1] is True}:
            out.append(("end", e[1]))  # h2 also reports the end of a request its HEADERS ended
    return out


def test_random_frame_sequences_deliver_the_same_requests_as_the_h2_library():
    """3000 seeded frame sequences, frame by frame through the codec and the h2 library (the oracle) until
    either fails the connection: the same requests, bodies and ends reach the pipeline (no stream is
    classified one way by the codec and another way by the library)."""
    rng = random.Random(9113)
    compared = 0
    for _ in range(3000):
        frames = _random_frames(rng)
        codec = H2ServerCodec(max_header_list=1 << 16)
        codec.initiate_connection()
        h2c = _h2_oracle()
        ours: list[tuple[Any, ...]] = []
        theirs: list[tuple[Any, ...]] = []
        for frame in frames:
            try:
                a = codec.receive_data(frame)
                b = h2c.receive_events(frame)
            except (ProtocolError, h2.exceptions.ProtocolError):
                break
            ours += a
            theirs += b
        cut = {e[1] for e in ours + theirs if e[0] in (EV_BAD_LENGTH, EV_RESET)}
        delivered = _delivered(ours, cut)
        assert delivered == _delivered(theirs, cut), frames
        compared += len(delivered)
    assert compared > 3000  # requests, bodies and ends actually compared, not just early failures


# ---------------------------------------------------------------------------- through H2Protocol


async def test_request_data_queued_when_the_stream_is_cut_goes_back_to_the_connection_window(h2pair):
    """DATA waiting for a handler that is then cut (client reset) was never acknowledged: each cancelled
    upload shrank the connection window for good, until no stream on that connection could send a byte."""
    started: list[int] = []

    async def handler(req: ProxyRequest) -> ProxyResponse:
        started.append(req.stream_id)
        await asyncio.Event().wait()  # never reads the body; cancelled when the stream is cut
        raise AssertionError("not reached")

    pair = h2pair(handler, ProtocolSettings(stream_window_bytes=16384))  # connection window 65535
    client = pair.client
    for _ in range(6):  # 6 x 16000 bytes left unread: more than the whole connection window
        await pair.until(lambda: client.outbound_flow_control_window >= 16000, limit=2.0)
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, [(":method", "POST"), (":path", "/api"), (":scheme", "https"),
                                  (":authority", "proxy.test")])
        client.send_data(sid, b"x" * 16000)
        pair.pump()
        await pair.until(lambda s=sid: s in started)
        client.reset_stream(sid, ErrorCodes.CANCEL)
        pair.pump()
        await pair.until(lambda: pair.server.open_streams == 0)
