"""Event tuples, closed-stream bookkeeping and errors of the HTTP/2 codec (:mod:`h2_codec`), shared with :mod:`h2`."""

from __future__ import annotations

from typing import Any

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
