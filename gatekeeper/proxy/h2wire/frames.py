"""HTTP/2 wire constants, frame serialization and the frame rules both HTTP/2 sides apply on receipt (pure, RFC 9113
sections 4 and 6): the listener's codec and the upstream client read frames with the same checks."""

from __future__ import annotations

import struct

from gatekeeper.proxy.h2wire.errors import ErrorCodes, FrameError

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)

END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# SETTINGS parameters (RFC 9113 6.5.2, RFC 8441)
HEADER_TABLE_SIZE = 0x1
ENABLE_PUSH = 0x2
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5
MAX_HEADER_LIST_SIZE = 0x6
ENABLE_CONNECT_PROTOCOL = 0x8

DEFAULT_WINDOW = 65535
MAX_WINDOW = 2**31 - 1
MAX_SETTING = 2**32 - 1
MIN_FRAME_SIZE = 16384
MAX_FRAME_SIZE_LIMIT = 2**24 - 1
MAX_CONTINUATIONS = 64
"""CONTINUATION frames accepted per header block (the bound ``h2`` has, CVE-2024-27316)."""

FRAME_HEADER = struct.Struct(">IBI")
"""length (24 bits) and type share the first word; then flags and the stream id (reserved bit masked)."""
U32 = struct.Struct(">I")
U32X2 = struct.Struct(">II")
SETTING = struct.Struct(">HI")


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return FRAME_HEADER.pack(len(payload) << 8 | ftype, flags, sid) + payload


def header(ftype: int, flags: int, sid: int, length: int) -> bytes:
    return FRAME_HEADER.pack(length << 8 | ftype, flags, sid)


def headers_frames(sid: int, block: bytes, max_frame: int, flags: int) -> list[bytes]:
    """HEADERS with ``flags`` (END_STREAM or 0), then CONTINUATION frames when ``block`` is larger than one frame."""
    if len(block) <= max_frame:
        return [header(HEADERS, flags | END_HEADERS, sid, len(block)), block]
    parts = [block[i:i + max_frame] for i in range(0, len(block), max_frame)]
    out = [header(HEADERS, flags, sid, len(parts[0])), parts[0]]
    for i, part in enumerate(parts[1:], start=2):
        out += (header(CONTINUATION, END_HEADERS if i == len(parts) else 0, sid, len(part)), part)
    return out


def settings_frame(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(SETTING.pack(k, v) for k, v in values.items()))


def rst_stream(sid: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, sid, U32.pack(code))


def window_update(sid: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, sid, U32.pack(increment))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, U32X2.pack(last_stream_id, code) + debug)


def check_control(ftype: int, flags: int, sid: int, length: int) -> None:
    """The size and stream-0 rules of a received SETTINGS, PING, GOAWAY, RST_STREAM, WINDOW_UPDATE or PUSH_PROMISE
    (RFC 9113 6.4 to 6.9), the same for both sides (neither enables push); FrameError if one is broken."""
    if ftype == SETTINGS:
        if sid:
            raise FrameError(ErrorCodes.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK and length:
            raise FrameError(ErrorCodes.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
        if length % 6:
            raise FrameError(ErrorCodes.FRAME_SIZE_ERROR, "SETTINGS payload not a multiple of 6")
    elif ftype == PING:
        if length != 8:
            raise FrameError(ErrorCodes.FRAME_SIZE_ERROR, "PING payload must be 8 bytes")
        if sid:
            raise FrameError(ErrorCodes.PROTOCOL_ERROR, "PING on a stream")
    elif ftype == GOAWAY:
        if sid:
            raise FrameError(ErrorCodes.PROTOCOL_ERROR, "GOAWAY on a stream")
        if length < 8:
            raise FrameError(ErrorCodes.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
    elif ftype == RST_STREAM:
        if length != 4:
            raise FrameError(ErrorCodes.FRAME_SIZE_ERROR, "RST_STREAM payload must be 4 bytes")
        if not sid:
            raise FrameError(ErrorCodes.PROTOCOL_ERROR, "RST_STREAM on stream 0")
    elif ftype == WINDOW_UPDATE:
        if length != 4:
            raise FrameError(ErrorCodes.FRAME_SIZE_ERROR, "WINDOW_UPDATE payload must be 4 bytes")
    elif ftype == PUSH_PROMISE:
        raise FrameError(ErrorCodes.PROTOCOL_ERROR, "PUSH_PROMISE (push is never enabled)")


def settings(buf: bytes, start: int, length: int) -> list[tuple[int, int]]:
    """A SETTINGS payload (checked by :func:`check_control`) as (key, value) pairs; FrameError for a value out of its
    range (RFC 9113 6.5.2). What a value means is the receiving side's."""
    pairs = []
    for pos in range(start, start + length, 6):
        key, value = SETTING.unpack_from(buf, pos)
        if key == INITIAL_WINDOW_SIZE and value > MAX_WINDOW:
            raise FrameError(ErrorCodes.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE above 2^31-1")
        if key == MAX_FRAME_SIZE and not MIN_FRAME_SIZE <= value <= MAX_FRAME_SIZE_LIMIT:
            raise FrameError(ErrorCodes.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value} out of range")
        if key in (ENABLE_PUSH, ENABLE_CONNECT_PROTOCOL) and value > 1:
            raise FrameError(ErrorCodes.PROTOCOL_ERROR, f"setting {key} must be 0 or 1")
        pairs.append((key, value))
    return pairs


def unpad(flags: int, buf: bytes, start: int, length: int, fixed: int = 0) -> tuple[int, int]:
    """(start, length) of a DATA or HEADERS payload past the pad length byte and ``fixed`` bytes (HEADERS' priority),
    minus the padding; FrameError when the frame is too short for them."""
    if not flags & PADDED:
        if length < fixed:
            raise FrameError(ErrorCodes.FRAME_SIZE_ERROR, "frame too short")
        return start + fixed, length - fixed
    if length < 1 + fixed:
        raise FrameError(ErrorCodes.FRAME_SIZE_ERROR, "padded frame too short")
    body = length - 1 - fixed - buf[start]
    if body < 0:
        raise FrameError(ErrorCodes.PROTOCOL_ERROR, "padding longer than the frame")
    return start + 1 + fixed, body
