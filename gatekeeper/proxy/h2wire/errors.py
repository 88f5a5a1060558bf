"""HTTP/2 error codes (RFC 9113 section 7) and the exceptions that carry them (pure). A :class:`ProtocolError` raised
while receiving is a connection error; its ``error_code`` goes in the GOAWAY."""

from __future__ import annotations

import enum


class ErrorCodes(enum.IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


class ProtocolError(Exception):
    """An HTTP/2 rule was broken; ``error_code`` says which kind (PROTOCOL_ERROR unless a subclass says)."""

    error_code: ErrorCodes = ErrorCodes.PROTOCOL_ERROR


class FrameError(ProtocolError):
    """A connection error with its ``code`` (the GOAWAY's), raised by the frame rules both sides share (``frames``)."""

    def __init__(self, code: ErrorCodes, message: str) -> None:
        super().__init__(message)
        self.error_code = code


class FlowControlError(ProtocolError):
    """More bytes than a flow-control window allows."""

    error_code = ErrorCodes.FLOW_CONTROL_ERROR


class StreamClosedError(ProtocolError):
    """A send or reset on a stream that is already closed (or never was open)."""

    error_code = ErrorCodes.STREAM_CLOSED

    def __init__(self, stream_id: int) -> None:
        super().__init__(f"stream {stream_id} is closed")
        self.stream_id = stream_id
