"""The client codec's flow control and stream bookkeeping, which the h2 differential test does not see: a caller who
stops reading holds one stream window, never the connection, and frames the codec sends are exactly the expected."""

from __future__ import annotations

import pytest
from hpack import Encoder

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire.client_codec import EV_DATA, EV_GOAWAY, EV_HEAD, H2ClientCodec
from gatekeeper.proxy.h2wire.errors import ErrorCodes, ProtocolError

WINDOW = 1 << 16


def _sent(codec: H2ClientCodec) -> list[tuple[int, int, int, bytes]]:
    """The frames the codec has to send, as (type, flags, stream, payload)."""
    data, out, pos = codec.data_to_send(), [], 0
    if data.startswith(f.PREFACE):
        pos = len(f.PREFACE)
    while pos < len(data):
        lt, flags, sid = f.FRAME_HEADER.unpack_from(data, pos)
        out.append((lt & 0xFF, flags, sid, data[pos + 9:pos + 9 + (lt >> 8)]))
        pos += 9 + (lt >> 8)
    return out


def _codec_with_a_head(streams: int = 1) -> H2ClientCodec:
    codec = H2ClientCodec(max_streams=4, stream_window=WINDOW, max_header_list=1 << 16)
    codec.initiate_connection()
    for _ in range(streams):
        codec.send_request(b"\x82\x87\x84")
    codec.data_to_send()
    block = Encoder().encode([(b":status", b"200")])
    for sid in range(1, 2 * streams, 2):
        assert codec.receive_data(f.frame(f.HEADERS, f.END_HEADERS, sid, block))[0][0] == EV_HEAD
    return codec


def test_the_client_preface_opens_the_connection_window_for_every_stream_at_once() -> None:
    codec = H2ClientCodec(max_streams=4, stream_window=WINDOW, max_header_list=1 << 16)
    codec.initiate_connection()
    settings, update = _sent(codec)
    assert settings[0] == f.SETTINGS and (f.INITIAL_WINDOW_SIZE, WINDOW) in f.settings(settings[3], 0, 18)
    assert update == (f.WINDOW_UPDATE, 0, 0, f.U32.pack(4 * WINDOW - f.DEFAULT_WINDOW))


def test_a_stream_window_reopens_only_as_its_consumer_reads() -> None:
    codec = _codec_with_a_head()
    for _ in range(3):
        codec.receive_data(f.frame(f.DATA, 0, 1, b"x" * 12000))
    assert _sent(codec) == []  # 36000 bytes unread: nothing given back to the stream
    codec.acknowledge_stream(1, 36000)
    assert _sent(codec) == [(f.WINDOW_UPDATE, 0, 1, f.U32.pack(36000))]


def test_data_past_a_stream_window_fails_the_connection_with_flow_control_error() -> None:
    codec = _codec_with_a_head()
    for _ in range(4):
        codec.receive_data(f.frame(f.DATA, 0, 1, b"x" * 16000))
    with pytest.raises(ProtocolError) as caught:
        codec.receive_data(f.frame(f.DATA, 0, 1, b"x" * 2000))  # 66000 > 65536 unread
    assert caught.value.error_code == ErrorCodes.FLOW_CONTROL_ERROR
    assert _sent(codec)[-1] == (f.GOAWAY, 0, 0, f.U32X2.pack(0, ErrorCodes.FLOW_CONTROL_ERROR))


def test_the_connection_window_reopens_as_data_arrives_even_unread() -> None:
    codec = _codec_with_a_head(streams=4)
    for sid in (1, 3, 5):
        for _ in range(4):
            codec.receive_data(f.frame(f.DATA, 0, sid, b"x" * 16000))
    assert [(t, s) for t, _, s, _ in _sent(codec)] == [(f.WINDOW_UPDATE, 0)]  # past half of 4 x 65536


def test_padding_goes_back_to_the_stream_window_unread() -> None:
    """130 DATA frames of one byte and 255 of padding: past half the stream window without one byte read, the
    padding alone comes back (nobody reads it), the byte does not."""
    codec = _codec_with_a_head()
    frame = f.frame(f.DATA, f.PADDED, 1, bytes([255]) + b"a" + b"\0" * 255)
    events = [e for _ in range(130) for e in codec.receive_data(frame)]
    assert events == [(EV_DATA, 1, b"a", False)] * 130
    updates = [f.U32.unpack(p)[0] for t, _, sid, p in _sent(codec) if t == f.WINDOW_UPDATE and sid == 1]
    assert len(updates) == 1 and updates[0] % 256 == 0 and updates[0] >= 256 * 100


def test_streams_above_a_goaway_are_forgotten_and_their_late_frames_ignored() -> None:
    codec = _codec_with_a_head(streams=3)
    assert codec.receive_data(f.goaway(1, 0)) == [(EV_GOAWAY, 1)]
    assert codec.receive_data(f.frame(f.DATA, f.END_STREAM, 5, b"late")) == []
    assert codec.receive_data(f.frame(f.DATA, f.END_STREAM, 1, b"ok")) == [(EV_DATA, 1, b"ok", True)]


def test_a_header_block_past_the_header_list_limit_is_enhance_your_calm_before_it_ends() -> None:
    codec = H2ClientCodec(max_streams=4, stream_window=WINDOW, max_header_list=20000)
    codec.initiate_connection()
    codec.send_request(b"\x82")
    codec.receive_data(f.frame(f.HEADERS, 0, 1, b"\x00" * 16000))
    with pytest.raises(ProtocolError) as caught:
        codec.receive_data(f.frame(f.CONTINUATION, 0, 1, b"\x00" * 5000))
    assert caught.value.error_code == ErrorCodes.ENHANCE_YOUR_CALM


def test_a_request_block_larger_than_the_peers_frame_goes_out_in_continuation_frames() -> None:
    codec = H2ClientCodec(max_streams=4, stream_window=WINDOW, max_header_list=1 << 16)
    assert codec.send_request(b"a" * 20000) == 1 and codec.send_request(b"b") == 3
    assert [(t, fl, s, len(p)) for t, fl, s, p in _sent(codec)] == [
        (f.HEADERS, f.END_STREAM, 1, 16384), (f.CONTINUATION, f.END_HEADERS, 1, 3616),
        (f.HEADERS, f.END_STREAM | f.END_HEADERS, 3, 1)]
