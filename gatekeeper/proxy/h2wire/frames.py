"""HTTP/2 wire constants and frame serialization (pure, RFC 9113 sections 4 and 6), for both HTTP/2 sides."""

from __future__ import annotations

import struct

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


def settings_frame(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(SETTING.pack(k, v) for k, v in values.items()))


def rst_stream(sid: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, sid, U32.pack(code))


def window_update(sid: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, sid, U32.pack(increment))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, U32X2.pack(last_stream_id, code) + debug)
