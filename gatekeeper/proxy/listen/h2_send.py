"""The outbound half of the proxy's HTTP/2 server connection (RFC 9113), under ``h2_codec``'s inbound half.

:class:`H2Sender` adds to the shared frame layer (``h2wire.connection``) what the server side keeps (recently closed
streams, held streams, the response encoder) and writes HEADERS, DATA and RST_STREAM;
:class:`~gatekeeper.proxy.listen.h2_codec.H2ServerCodec` extends it with the per-frame rules. Compiled with mypyc
together (docs/proxy/compiled.md): the subclass's calls and field reads stay native."""

from __future__ import annotations

from typing import Any

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire.connection import H2Connection, StreamState
from gatekeeper.proxy.h2wire.errors import FlowControlError, StreamClosedError
from gatekeeper.proxy.h2wire.hpack_encode import ResponseEncoder

CLOSED_MEMORY = 4096
"""Closed stream ids remembered (how each closed decides the error for a late frame on it)."""
CLOSED_BY_END, RESET_BY_PEER, RESET_BY_US = range(3)
"""How a remembered stream closed; a late frame on it is a connection error after END_STREAM, answered with
RST_STREAM after the client's reset, and ignored after ours (it may have crossed our RST_STREAM)."""


class H2Sender(H2Connection):
    """The server side's state and the frames the proxy sends on it (see the module docstring)."""

    def __init__(self, *, max_concurrent_streams: int, stream_window: int, max_header_list: int,
                 connection_window: int) -> None:
        super().__init__(stream_window=stream_window, connection_window=connection_window,
                         max_header_list=max_header_list, max_block=1 << 30)  # bounded by the header budget
        self.max_concurrent_streams = max_concurrent_streams
        self.encoder = ResponseEncoder()
        self._held: set[int] = set()
        self._closed: dict[int, int] = {}
        """Recently closed stream id -> how it closed (``CLOSED_BY_END``, ...)."""
        self._send_window = f.DEFAULT_WINDOW
        self.max_outbound_frame_size = f.MIN_FRAME_SIZE

    # ------------------------------------------------------------------ outbound API

    def initiate_connection(self) -> None:
        self._initiate({
            f.MAX_CONCURRENT_STREAMS: self.max_concurrent_streams,
            f.INITIAL_WINDOW_SIZE: self._stream_window,
            f.MAX_FRAME_SIZE: f.MIN_FRAME_SIZE,
            f.MAX_HEADER_LIST_SIZE: self._max_header_list,
        })

    @property
    def held_streams(self) -> int:
        return len(self._held)

    def release_stream(self, stream_id: int) -> None:
        """The adapter is done with a stream: it stops counting against MAX_CONCURRENT_STREAMS."""
        self._held.discard(stream_id)

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
