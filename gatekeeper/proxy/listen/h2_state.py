"""Shared pieces of the HTTP/2 codec, apart from :mod:`h2_codec` to avoid an import cycle with :mod:`h2_inbound`."""

from __future__ import annotations

from typing import Any, Protocol

from gatekeeper.proxy.h2wire.errors import ErrorCodes, ProtocolError

EV_REQUEST, EV_DATA, EV_ENDED, EV_RESET, EV_WINDOW, EV_GOAWAY, EV_BAD_LENGTH = range(7)
"""Event tuples: (EV_REQUEST, sid, headers, ended), (EV_DATA, sid, data, flow_length), (EV_ENDED, sid), (EV_RESET, sid,
code), (EV_WINDOW, sid) (0: every stream), (EV_GOAWAY, 0, code), (EV_BAD_LENGTH, sid): the body disagreed with its
content-length and the stream was reset, reported in order so the adapter sees the request, then the cut."""

Event = tuple[Any, ...]
CLOSED_MEMORY = 4096
"""Closed stream ids remembered (how each closed decides the error for a late frame on it)."""
CLOSED_BY_END, RESET_BY_PEER, RESET_BY_US = range(3)
"""How a remembered stream closed; a late frame on it is a connection error after END_STREAM, answered with
RST_STREAM after the client's reset, and ignored after ours (it may have crossed our RST_STREAM)."""


class ServerConnection(Protocol):
    """What the adapter's mixins need of the codec, typed without importing it."""

    highest_inbound_stream_id: Any
    max_outbound_frame_size: Any

    def initiate_connection(self) -> None: ...
    def release_stream(self, stream_id: int) -> None: ...
    def data_to_send(self) -> bytes: ...
    def send_headers(self, stream_id: int, headers: Any, end_stream: bool = False) -> None: ...
    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None: ...
    def end_stream(self, stream_id: int) -> None: ...
    def reset_stream(self, stream_id: int, error_code: Any = 0) -> None: ...
    def local_flow_control_window(self, stream_id: int) -> int: ...
    def acknowledge_received_data(self, acknowledged_size: int, stream_id: int) -> None: ...
    def release_pending(self) -> None: ...

    @property
    def inbound_flow_control_window(self) -> int: ...

    def close_connection(self, error_code: int = 0, last_stream_id: int | None = None) -> None: ...


class H2ConnectionError(ProtocolError):
    """A connection error: the GOAWAY with ``error_code`` is already queued."""

    def __init__(self, code: ErrorCodes, message: str) -> None:
        super().__init__(message)
        self.error_code = code


class StreamState:
    __slots__ = ("length", "local_closed", "received", "recv_window", "remote_closed", "send_window", "unacked")

    def __init__(self, send_window: int, recv_window: int) -> None:
        self.send_window = send_window
        self.recv_window = recv_window
        self.unacked = 0
        self.remote_closed = False
        self.local_closed = False
        self.length: int | None = None
        """content-length of the request, when given; checked against the DATA received."""
        self.received = 0


class HeaderBudgetExceeded(H2ConnectionError):
    """A header block in progress would pass the process's request buffer budget (``body_budget``)."""
