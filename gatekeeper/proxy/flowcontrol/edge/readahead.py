"""Read a LIST's response from the apiserver ahead of its client, so the seats go back when the apiserver is done.

A seat protects the apiserver, which is done once it sent the last byte; without this a client reading at 1 KiB/s
held the seats until its deadline. Memory is bounded per connection and per worker: past either the pump stops
reading upstream and the request keeps its seats (docs/proxy/deadline.md#list-read-ahead).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from prometheus_client import Counter, Gauge

from gatekeeper.proxy.messages import close_body, is_exhausted
from gatekeeper.runtime.tasks import stop_task

READ_AHEAD_BYTES = Gauge(
    "gatekeeper_flowcontrol_read_ahead_bytes",
    "LIST response bytes read from the apiservers and not yet taken by their clients (readAheadBytes).",
    multiprocess_mode="livesum",
)
READ_AHEAD_FULL = Counter(
    "gatekeeper_flowcontrol_read_ahead_full",
    "LIST responses whose read ahead reached readAheadBytesPerConnection or readAheadBytes: the proxy stopped "
    "reading upstream, and the request held its seats until its client caught up or its deadline.",
    ["scope"],
)


class ReadAheadBudget:
    """Unsent response bytes held by each client connection and by the process, against their limits."""

    __slots__ = ("by_connection", "held", "per_connection", "total")

    def __init__(self, total: int, per_connection: int) -> None:
        self.total = total
        self.per_connection = per_connection
        self.held = 0
        self.by_connection: dict[int, int] = {}

    def refusal(self, connection: int, size: int) -> str:
        """Why ``connection`` may not hold ``size`` more bytes ("" if it may); an empty one may hold one chunk."""
        mine = self.by_connection.get(connection, 0)
        if mine == 0:
            return ""
        if mine + size > self.per_connection:
            return "connection"
        if self.held + size > self.total:
            return "process"
        return ""

    def take(self, connection: int, size: int) -> None:
        self.by_connection[connection] = self.by_connection.get(connection, 0) + size
        self.held += size
        READ_AHEAD_BYTES.set(self.held)

    def give(self, connection: int, size: int) -> None:
        left = self.by_connection.get(connection, 0) - size
        if left > 0:
            self.by_connection[connection] = left
        else:
            self.by_connection.pop(connection, None)
        self.held -= size
        READ_AHEAD_BYTES.set(self.held)


class ReadAhead:
    """A response body read ahead of its client within a :class:`ReadAheadBudget` (see the module docstring)."""

    def __init__(
        self,
        source: AsyncIterator[bytes],
        budget: ReadAheadBudget,
        connection: int,
        on_upstream_end: Callable[[int, bool, BaseException | None, bytes], None],
        until: Callable[[bytes], bool] | None = None,
        drain_seconds: float = 60.0,
    ) -> None:
        self.source = source
        self.budget = budget
        self.connection = connection
        self.on_upstream_end = on_upstream_end
        """``(bytes, complete, error, head)``: once, when the upstream body ended, failed or was closed."""
        self.until = until
        """A watch-list's sync: True once the apiserver's part is done; from then on the client reads the source."""
        self.handed_over = False
        self.drain_seconds = drain_seconds
        """After the hand-over, how long the client may take to read what was read ahead: a watch has no deadline,
        and an idle one must not hold the worker's read-ahead budget for its whole life."""
        self.full = False
        """The pump waits for its client to make room (not for the apiserver)."""
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.total = 0
        self.head = b""
        self.ended = False
        self.error: BaseException | None = None
        self._reported = False
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._pump = asyncio.get_running_loop().create_task(self._run(), name="gatekeeper-flowcontrol-readahead")

    def __aiter__(self) -> ReadAhead:
        return self

    @property
    def exhausted(self) -> bool:
        """The chunk just returned was the last (the h2 adapter ends the stream on it)."""
        if self.handed_over:
            return not self.chunks and is_exhausted(self.source)
        return self.ended and self.error is None and not self.chunks

    async def __anext__(self) -> bytes:
        while True:
            if self.chunks:
                chunk = self.chunks.popleft()
                self.buffered -= len(chunk)
                self.budget.give(self.connection, len(chunk))
                self._room.set()
                return chunk
            if self.error is not None:
                raise self.error
            if self.handed_over:
                return await self.source.__anext__()
            if self.ended:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()

    def _report(self, complete: bool, error: BaseException | None) -> None:
        if not self._reported:
            self._reported = True
            self.on_upstream_end(self.total, complete, error, self.head)

    async def _run(self) -> None:
        complete = False
        error: BaseException | None = None
        full = False
        try:
            async for chunk in self.source:
                if not chunk:
                    continue
                if not self.head:
                    self.head = chunk[:4096]
                while (why := self.budget.refusal(self.connection, len(chunk))) != "":
                    if not full:
                        full = True
                        READ_AHEAD_FULL.labels(why).inc()
                    self._room.clear()
                    self.full = True
                    try:
                        await self._room.wait()
                    finally:
                        self.full = False
                self.total += len(chunk)
                self.budget.take(self.connection, len(chunk))
                self.buffered += len(chunk)
                self.chunks.append(chunk)
                self._ready.set()
                if self.until is not None and self.until(chunk):
                    self.handed_over = True  # the rest is a plain watch: no pump, no buffer
                    if self.chunks:
                        asyncio.get_running_loop().call_later(self.drain_seconds, self._drain_deadline)
                    return
            complete = True
        except asyncio.CancelledError as exc:
            error = exc
            raise
        except Exception as exc:  # the backend failed mid-body: the client sees it after what it got
            error = exc
            self.error = exc
        finally:
            self._ready.set()
            if not self.handed_over:
                self.ended = True
                await close_body(self.source)
                self._report(complete, error)

    def waiting_for_room(self) -> bool:
        return self.full

    def _drain_deadline(self) -> None:
        """The client did not take the initial events read ahead for it in time: they go, and its stream is cut."""
        if self.buffered:
            self.budget.give(self.connection, self.buffered)
            self.buffered = 0
            self.chunks.clear()
            self.error = ConnectionError(
                f"the client did not read a watch's initial events within {self.drain_seconds:g}s")
            self._ready.set()

    async def aclose(self) -> None:
        """The client is gone or done: stop reading upstream, give the buffered bytes back."""
        await stop_task(self._pump)
        if self.handed_over:
            await close_body(self.source)
        self._report(False, None)  # a pump cancelled before its first step never ran its finally
        if self.buffered:
            self.budget.give(self.connection, self.buffered)
            self.buffered = 0
            self.chunks.clear()
            self._room.set()
