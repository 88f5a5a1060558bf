"""Stream one upstream response body to several clients without holding it whole.

A pump task reads the upstream body and appends each chunk to every
subscriber's own bounded buffer. It reads the next chunk only once the
*fastest* subscriber has drained below half its limit, so the upstream read is
paced by the best reader; a subscriber whose buffer would exceed the limit has
fallen too far behind and is cut off with :class:`FanOutOverrun` (its client
sees the stream reset and client-go retries the LIST) instead of stalling the
others or growing memory. Memory is therefore at most ``subscribers x limit``
plus one chunk, whatever the response size.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable


class FanOutOverrun(ConnectionError):
    """This reader fell more than the buffer limit behind the fastest one."""


class Subscriber:
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
        """Stop receiving (client gone); the others carry on."""
        if not self.closed:
            self.closed = True
            self.chunks.clear()
            self.buffered = 0
            self.fan._progress.set()

    async def aclose(self) -> None:
        self.close()


class FanOut:
    """One upstream body, many readers; see the module docstring for the memory bound."""

    def __init__(
        self,
        source: AsyncIterator[bytes],
        n: int,
        limit_bytes: int,
        on_done: Callable[[int, BaseException | None], None],
    ) -> None:
        self.source = source
        self.limit = limit_bytes
        self.subs = [Subscriber(self) for _ in range(n)]
        self.on_done = on_done
        self.total = 0
        self.cut_off = 0
        self.complete = False
        """True once the whole upstream body was read (the byte count is a real response size)."""
        self._progress = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._pump(), name="gatekeeper-flowcontrol-fanout")

    def _live(self) -> list[Subscriber]:
        return [s for s in self.subs if not s.closed and s.error is None]

    async def _pump(self) -> None:
        error: BaseException | None = None
        try:
            async for chunk in self.source:
                self.total += len(chunk)
                for s in self._live():
                    if s.buffered + len(chunk) > self.limit and s.buffered > 0:
                        s.error = FanOutOverrun(
                            f"coalesced LIST reader fell {self.limit} bytes behind; retry the request"
                        )
                        s.chunks.clear()
                        s.buffered = 0
                        self.cut_off += 1
                    else:
                        s.chunks.append(chunk)
                        s.buffered += len(chunk)
                    s.ready.set()
                while (live := self._live()) and min(s.buffered for s in live) > self.limit // 2:
                    self._progress.clear()
                    await self._progress.wait()
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
            for s in self.subs:
                s.ended = True
                s.ready.set()
            aclose = getattr(self.source, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            self.on_done(self.total, error)
        if error is not None and not isinstance(error, Exception):
            raise error
