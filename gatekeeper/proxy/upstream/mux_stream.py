"""One stream of a multiplexed HTTP/2 upstream connection, as its consumer sees it.

:mod:`mux` owns the wire; a :class:`MuxStream` holds one request's head, unread chunks and waiter, and gives the stream
window back as the bytes are taken."""

from __future__ import annotations

import asyncio
import collections
from typing import Protocol

from gatekeeper.proxy.upstream.slots import OneWaiter


class StreamOwner(Protocol):
    """What a stream needs of its connection (``mux.MuxConn``, which imports this module)."""

    loop: asyncio.AbstractEventLoop

    def consumed(self, sid: int, size: int) -> None: ...

    def cancel(self, stream: MuxStream) -> None: ...

STREAM_WINDOW = 256 * 1024
"""Per-stream receive window (as ``lean.READ_HIGH``: what a client that stops reading can make us hold)."""


class StreamRefused(ConnectionError):
    """The backend did not process the stream (GOAWAY above it, or REFUSED_STREAM): safe to send again."""


class StreamReset(ConnectionResetError):
    """The backend reset this one stream (not REFUSED_STREAM); says something about the request (Go resets
    malformed ones), not by itself about the backend."""


class MuxStream(OneWaiter):
    """One request's response as it arrives on a shared connection."""

    __slots__ = (
        "buffered",
        "chunks",
        "complete",
        "conn",
        "error",
        "head_only",
        "headers_done",
        "raw_headers",
        "sid",
        "status",
        "timer",
    )

    def __init__(self, sid: int, conn: StreamOwner, head_only: bool) -> None:
        self.sid = sid
        self.conn = conn
        self.loop = conn.loop
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        """Bytes received and not yet taken by the consumer (bounded by the stream window)."""
        self.complete = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.head_only = head_only

    def fail(self, error: BaseException) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self.stop_timer()
        self.wake()

    def stop_timer(self) -> None:
        timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()

    def take(self) -> bytes:
        """Everything buffered, as one chunk; its bytes go back to the backend as stream window."""
        chunks = self.chunks
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if not self.complete:
            self.conn.consumed(self.sid, len(chunk))
        return chunk
