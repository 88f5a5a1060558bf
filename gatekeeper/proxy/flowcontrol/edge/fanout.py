"""Stream one upstream response body to several clients without holding it whole.

The pump waits until every reader drained below half of ``limit_bytes`` before reading on, so memory stays
within ``readers x (limit/2 + one chunk)``; a reader stuck above it for ``stall_seconds`` is cut off
(:class:`FanOutOverrun`, its stream reset) so one slow client cannot stall the others.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable

from gatekeeper.proxy.messages import close_body


class FanOutOverrun(ConnectionError):
    """This reader stopped keeping up with the shared response."""


class Subscriber:
    """One client's view of the shared body: an async iterator over its own bounded buffer."""

    def __init__(self, fan: FanOut) -> None:
        self.fan = fan
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.error: BaseException | None = None
        self.ended = False
        self.closed = False
        self.ready = asyncio.Event()

    def __aiter__(self) -> Subscriber:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self.chunks:
                chunk = self.chunks.popleft()
                self.buffered -= len(chunk)
                self.fan._progress.set()
                return chunk
            if self.error is not None:
                raise self.error
            if self.ended or self.closed:
                raise StopAsyncIteration
            self.ready.clear()
            await self.ready.wait()

    def close(self) -> None:
        """Stop receiving (client gone); the others carry on. The last one gone stops the upstream read: a
        shared watch may send nothing for minutes, so the pump would not notice before then."""
        if not self.closed:
            self.closed = True
            self.chunks.clear()
            self.buffered = 0
            self.ready.set()  # a reader waiting for the next chunk ends now
            self.fan._progress.set()
            if not self.fan._live():
                self.fan.task.cancel()

    async def aclose(self) -> None:
        self.close()


class FanOut:
    """One upstream body, many readers; see the module docstring for the memory and delay bounds."""

    def __init__(
        self,
        source: AsyncIterator[bytes],
        n: int,
        limit_bytes: int,
        on_done: Callable[[int, BaseException | None], None],
        stall_seconds: float = 10.0,
    ) -> None:
        self.source = source
        self.limit = limit_bytes
        self.stall = stall_seconds
        self.subs = [Subscriber(self) for _ in range(n)]
        self.on_done = on_done
        self.total = 0
        self.timers: list[asyncio.TimerHandle] = []
        """The caller's per-reader timers, cancelled by its ``on_done``."""
        self.complete = False
        """True once the whole upstream body was read (the byte count is a real response size)."""
        self._progress = asyncio.Event()
        self._reported = False
        # The pump's first step runs after the caller has handed the subscribers out (it awaits nothing between).
        self.task = asyncio.get_running_loop().create_task(self._pump(), name="gatekeeper-flowcontrol-fanout")
        self.task.add_done_callback(self._never_ran)

    def _never_ran(self, task: asyncio.Task[None]) -> None:
        """A pump cancelled before its first step (every reader gone at once) never ran its ``finally``: the end is
        reported and the upstream body closed here, or the ticket and the upstream stream would stay for good."""
        if not self._reported:
            self._reported = True
            for s in self.subs:
                s.ended = True
                s.ready.set()
            asyncio.get_running_loop().create_task(close_body(self.source))
            self.on_done(self.total, asyncio.CancelledError())

    def _live(self) -> list[Subscriber]:
        return [s for s in self.subs if not s.closed and s.error is None]

    def _full(self) -> list[Subscriber]:
        return [s for s in self._live() if s.buffered > self.limit // 2]

    def _cut(self, s: Subscriber) -> None:
        s.error = FanOutOverrun(
            f"this client read a shared (coalesced) LIST response too slowly: no progress within "
            f"{self.stall:g}s with {s.buffered} bytes buffered; retry the request"
        )
        s.chunks.clear()
        s.buffered = 0
        s.ready.set()

    async def _wait_for_room(self) -> None:
        """Pace to the slowest reader; cut off readers that make no room within the stall time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.stall
        while self._full():
            remaining = deadline - loop.time()
            if remaining <= 0:
                for s in self._full():
                    self._cut(s)
                return
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), remaining)

    async def _pump(self) -> None:
        error: BaseException | None = None
        try:
            async for chunk in self.source:
                self.total += len(chunk)
                for s in self._live():
                    s.chunks.append(chunk)
                    s.buffered += len(chunk)
                    s.ready.set()
                await self._wait_for_room()
                if not self._live():
                    break
            else:
                self.complete = True
        except BaseException as exc:  # upstream failed mid-body: every reader gets the error
            error = exc
            for s in self._live():
                s.error = exc if isinstance(exc, Exception) else ConnectionError("upstream body cancelled")
                s.ready.set()
        finally:
            self._reported = True
            for s in self.subs:
                s.ended = True
                s.ready.set()
            await close_body(self.source)
            self.on_done(self.total, error)
        if error is not None and not isinstance(error, Exception):
            raise error
