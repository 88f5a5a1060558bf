"""The upstream's HTTP/2 client codec (``h2wire.client_codec``) against the ``h2`` library's client as the oracle.

Both open the same three streams, then read the same seeded server frame sequences frame by frame: the responses they
deliver (heads, body bytes, ends) must be the same, and so must the frame at which the connection fails."""

from __future__ import annotations

import random
import re
import struct
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
from hpack import Encoder

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire.client_codec import EV_DATA, EV_GOAWAY, EV_HEAD, EV_RESET, H2ClientCodec
from gatekeeper.proxy.h2wire.errors import ErrorCodes, ProtocolError

OPENED = (1, 3, 5)
WINDOW = 1 << 16


def _ours() -> H2ClientCodec:
    codec = H2ClientCodec(max_streams=4, stream_window=WINDOW, max_header_list=1 << 16)
    codec.initiate_connection()
    for _ in OPENED:
        codec.send_request(b"\x82\x87\x84")
    codec.data_to_send()
    return codec


def _theirs() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW})
    for sid in OPENED:
        conn.send_headers(sid, [(":method", "GET"), (":scheme", "https"), (":path", "/"), (":authority", "a")],
                          end_stream=True)
    conn.data_to_send()
    return conn


def _our_events(codec: H2ClientCodec, frame: bytes) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for e in codec.receive_data(frame):
        if e[0] == EV_HEAD:
            out += [("head", e[1], e[2], e[3])] + ([("end", e[1])] if e[4] else [])
        elif e[0] == EV_DATA:
            out += ([("data", e[1], e[2])] if e[2] else []) + ([("end", e[1])] if e[3] else [])
        elif e[0] == EV_RESET:
            out.append(("reset", e[1]))
        elif e[0] == EV_GOAWAY:
            out.append(("goaway", e[1]))
    return out


def _their_events(conn: h2.connection.H2Connection, frame: bytes) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for e in conn.receive_data(frame):
        if isinstance(e, h2.events.RequestReceived):  # h2 lets the server open a stream; push is off: an error
            raise h2.exceptions.ProtocolError(f"HEADERS on stream {e.stream_id}")
        if isinstance(e, h2.events.ResponseReceived):
            fields = [(bytes(n), bytes(v)) for n, v in e.headers or []]
            if not re.fullmatch(rb"[1-9][0-9][0-9]", fields[0][1]):  # h2 takes any :status; the codec does not
                raise h2.exceptions.ProtocolError(f"status {fields[0][1]!r}")
            out.append(("head", e.stream_id, int(fields[0][1]), fields[1:]))
        elif isinstance(e, h2.events.DataReceived) and e.data:
            out.append(("data", e.stream_id, bytes(e.data)))
        elif isinstance(e, h2.events.StreamEnded):
            out.append(("end", e.stream_id))
        elif isinstance(e, h2.events.StreamReset):
            out.append(("reset", e.stream_id))
        elif isinstance(e, h2.events.ConnectionTerminated):
            out.append(("goaway", e.last_stream_id))
    return out


def _head(rng: random.Random, encoder: Encoder) -> bytes:
    status = rng.choice([b"200"] * 40 + [b"404", b"401"] + [b"103"] * 4 + [b"2000", b"abc"])
    fields = [(b"content-type", b"application/json"), (b"audit-id", b"%d" % rng.randrange(1000))]
    if rng.random() < 0.98:
        fields.insert(0 if rng.random() < 0.97 else 1, (b":status", status))
    return encoder.encode(fields, huffman=rng.random() < 0.5)


def _random_frames(rng: random.Random) -> list[bytes]:
    """The server's SETTINGS, then 1..12 frames, mostly on the three opened streams: response heads (some interim,
    some malformed, some split over CONTINUATION), DATA (some padded, some before the head), trailers, RST_STREAM,
    WINDOW_UPDATE, PING, PRIORITY, now and then a GOAWAY or a frame on a stream never opened. No frame follows one
    with END_STREAM or RST_STREAM on its stream: h2 fails the connection on some of those, the codec ignores them (a
    stream it forgot, as one it reset)."""
    encoder = Encoder()
    frames = [f.settings_frame({f.MAX_CONCURRENT_STREAMS: 100})]
    open_ = list(OPENED)
    headed: set[int] = set()
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        if not open_:
            break
        sid = rng.choice(open_) if rng.random() < 0.9 else rng.choice([2, 7, 9])
        end = f.END_STREAM if rng.random() < 0.4 else 0
        if sid not in headed and rng.random() < 0.8:
            kind = 0.0  # mostly a head first: DATA before it fails the connection
        if end and sid in open_ and kind < 0.7:
            open_.remove(sid)
        if kind < 0.35:
            sid = 7 if sid == 2 else sid  # the codec fails HEADERS on an even stream at once, h2 at END_HEADERS
            trailers = sid in headed and rng.random() < 0.3
            block = encoder.encode([(b"x-trailer", b"1")]) if trailers else _head(rng, encoder)
            headed.add(sid)
            if rng.random() < 0.2 and len(block) > 1:
                cut = rng.randrange(1, len(block))
                frames.append(f.frame(f.HEADERS, end, sid, block[:cut]))
                frames.append(f.frame(f.CONTINUATION, f.END_HEADERS, rng.choice([sid] * 5 + [2]), block[cut:]))
            else:
                frames.append(f.frame(f.HEADERS, end | f.END_HEADERS, sid, block))
        elif kind < 0.7:
            data = b"d" * rng.choice([0, 1, 5, 300])
            padded = rng.random() < 0.2
            frames.append(f.frame(f.DATA, end | (f.PADDED if padded else 0), sid,
                                  bytes([3]) + data + b"\0\0\0" if padded else data))
        elif kind < 0.78:
            if sid in open_:
                open_.remove(sid)
            frames.append(f.rst_stream(sid, rng.choice([ErrorCodes.CANCEL, ErrorCodes.REFUSED_STREAM])))
        elif kind < 0.84:
            frames.append(f.window_update(rng.choice([0, sid]), rng.choice([1, 1000])))
        elif kind < 0.9:
            frames.append(f.frame(f.PING, 0, 0, b"12345678"))
        elif kind < 0.96:
            frames.append(f.frame(f.PRIORITY, 0, sid, struct.pack(">IB", 0, 1)))
        else:
            frames.append(f.goaway(rng.choice([1, 3]), 0))
    return frames


def _delivered(events: list[tuple[Any, ...]], cut: set[int]) -> list[tuple[Any, ...]]:
    return [e for e in events if e[0] != "reset" and e[1] not in cut]


def test_random_server_frames_deliver_the_same_responses_and_fail_at_the_same_frame_as_the_h2_library() -> None:
    """3000 seeded sequences: until the first GOAWAY, both deliver the same heads, body bytes and ends for the
    streams neither reset, and both fail the connection at the same frame or neither does."""
    rng = random.Random(9113)
    compared = failed = 0
    for _ in range(3000):
        frames = _random_frames(rng)
        codec, conn = _ours(), _theirs()
        ours: list[tuple[Any, ...]] = []
        theirs: list[tuple[Any, ...]] = []
        for i, frame in enumerate(frames):
            our_error = their_error = False
            try:
                ours += _our_events(codec, frame)
            except ProtocolError:
                our_error = True
            try:
                theirs += _their_events(conn, frame)
            except h2.exceptions.ProtocolError:
                their_error = True
            assert our_error == their_error, (i, frames)
            if our_error or any(e[0] == "goaway" for e in ours + theirs):
                failed += our_error
                break
        cut = {e[1] for e in ours + theirs if e[0] == "reset"}
        delivered = _delivered(ours, cut)
        assert delivered == _delivered(theirs, cut), frames
        compared += len(delivered)
    assert compared > 4000 and failed > 1000  # responses actually compared, and failures too
