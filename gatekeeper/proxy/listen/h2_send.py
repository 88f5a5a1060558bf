"""The state and outbound half of the proxy's HTTP/2 server connection (RFC 9113), under ``h2_codec``'s inbound half.

:class:`H2Sender` holds what both directions share (streams, windows, recently closed streams, the frames to send)
and writes HEADERS, DATA, RST_STREAM, WINDOW_UPDATE and GOAWAY; :class:`~gatekeeper.proxy.listen.h2_codec.H2ServerCodec`
extends it with frame parsing. Compiled with mypyc together (docs/proxy/compiled.md): the subclass's calls and field
reads stay native."""

from __future__ import annotations

from typing import Any

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire.errors import ErrorCodes, FlowControlError, FrameError, StreamClosedError
from gatekeeper.proxy.h2wire.hpack_encode import ResponseEncoder

CLOSED_MEMORY = 4096
"""Closed stream ids remembered (how each closed decides the error for a late frame on it)."""
CLOSED_BY_END, RESET_BY_PEER, RESET_BY_US = range(3)
"""How a remembered stream closed; a late frame on it is a connection error after END_STREAM, answered with
RST_STREAM after the client's reset, and ignored after ours (it may have crossed our RST_STREAM)."""


class H2ConnectionError(FrameError):
    """A connection error: the GOAWAY with ``error_code`` is already queued."""


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


class H2Sender:
    """One connection's shared state and the frames the proxy sends on it (see the module docstring)."""

    def __init__(self, *, max_concurrent_streams: int, stream_window: int, max_header_list: int,
                 connection_window: int) -> None:
        self.max_concurrent_streams = max_concurrent_streams
        self._stream_window = stream_window
        self._conn_window_size = max(connection_window, f.DEFAULT_WINDOW)
        self._max_header_list = max_header_list
        self.encoder = ResponseEncoder()
        self.streams: dict[int, StreamState] = {}
        self._held: set[int] = set()
        self._closed: dict[int, int] = {}
        """Recently closed stream id -> how it closed (``CLOSED_BY_END``, ...)."""
        self.highest_inbound_stream_id = 0
        self._send_window = f.DEFAULT_WINDOW
        self.max_outbound_frame_size = f.MIN_FRAME_SIZE
        self._recv_window = f.DEFAULT_WINDOW
        self._recv_unacked = 0
        self._out: list[bytes] = []
        self.closed = False

    # ------------------------------------------------------------------ outbound API

    def initiate_connection(self) -> None:
        """Our SETTINGS, then a connection WINDOW_UPDATE up to the configured connection window."""
        self._out.append(f.settings_frame({
            f.MAX_CONCURRENT_STREAMS: self.max_concurrent_streams,
            f.INITIAL_WINDOW_SIZE: self._stream_window,
            f.MAX_FRAME_SIZE: f.MIN_FRAME_SIZE,
            f.MAX_HEADER_LIST_SIZE: self._max_header_list,
        }))
        extra = self._conn_window_size - f.DEFAULT_WINDOW
        if extra > 0:
            self._recv_window += extra
            self._out.append(f.window_update(0, extra))

    @property
    def inbound_flow_control_window(self) -> int:
        return self._recv_window

    @property
    def held_streams(self) -> int:
        return len(self._held)

    def release_stream(self, stream_id: int) -> None:
        """The adapter is done with a stream: it stops counting against MAX_CONCURRENT_STREAMS."""
        self._held.discard(stream_id)

    def data_to_send(self) -> bytes:
        out = self._out
        if not out:
            return b""
        self._out = []
        return out[0] if len(out) == 1 else b"".join(out)

    def send_headers(self, stream_id: int, headers: Any, end_stream: bool = False) -> None:
        sid = stream_id
        stream = self._sendable(sid)
        block = self.encoder.encode(headers)
        self._out += f.headers_frames(sid, block, self.max_outbound_frame_size, f.END_STREAM if end_stream else 0)
        if end_stream:
            self._local_close(sid, stream)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        sid = stream_id
        stream = self._sendable(sid)
        n = len(data)
        if n > self._send_window or n > stream.send_window:
            raise FlowControlError(f"{n} bytes exceed the flow-control window of stream {sid}")
        if n > self.max_outbound_frame_size:
            size = self.max_outbound_frame_size
            for i in range(0, n - size, size):
                self._out += (f.header(f.DATA, 0, sid, size), data[i:i + size])
            data = data[(n - 1) // size * size:]
        self._send_window -= n
        stream.send_window -= n
        self._out += (f.header(f.DATA, f.END_STREAM if end_stream else 0, sid, len(data)), data)
        if end_stream:
            self._local_close(sid, stream)

    def end_stream(self, stream_id: int) -> None:
        self.send_data(stream_id, b"", end_stream=True)

    def reset_stream(self, stream_id: int, error_code: Any = 0) -> None:
        sid = stream_id
        if self.streams.pop(sid, None) is None:
            raise StreamClosedError(sid)
        self._remember(sid, RESET_BY_US)
        self._out.append(f.rst_stream(sid, error_code))

    def local_flow_control_window(self, stream_id: int) -> int:
        stream = self._sendable(stream_id)
        return min(self._send_window, stream.send_window)

    def acknowledge_received_data(self, acknowledged_size: int, stream_id: int) -> None:
        """The adapter consumed ``size`` flow-controlled bytes: reopen the windows in batches (once under half),
        so a steady upload costs one WINDOW_UPDATE per half window, not one per DATA frame."""
        size, sid = acknowledged_size, stream_id
        if size <= 0:
            return
        self._recv_unacked += size
        if self._recv_window < self._conn_window_size // 2:
            self._recv_window += self._recv_unacked
            self._out.append(f.window_update(0, self._recv_unacked))
            self._recv_unacked = 0
        stream = self.streams.get(sid)
        if stream is not None and not stream.remote_closed:
            stream.unacked += size
            if stream.recv_window < self._stream_window // 2:
                stream.recv_window += stream.unacked
                self._out.append(f.window_update(sid, stream.unacked))
                stream.unacked = 0

    def close_connection(self, error_code: int = 0, last_stream_id: int | None = None) -> None:
        if self.closed:
            return
        last = self.highest_inbound_stream_id if last_stream_id is None else last_stream_id
        self._out.append(f.goaway(last, error_code))
        self.closed = True

    def _sendable(self, sid: int) -> StreamState:
        stream = self.streams.get(sid)
        if stream is None or stream.local_closed or self.closed:
            raise StreamClosedError(sid)
        return stream

    def _local_close(self, sid: int, stream: StreamState) -> None:
        stream.local_closed = True
        if stream.remote_closed:
            del self.streams[sid]
            self._remember(sid, CLOSED_BY_END)

    def _remember(self, sid: int, how: int) -> None:
        closed = self._closed
        closed[sid] = how
        if len(closed) > CLOSED_MEMORY:
            del closed[next(iter(closed))]

    def _fail(self, code: ErrorCodes, message: str) -> None:
        self.close_connection(code)
        raise H2ConnectionError(code, message)
