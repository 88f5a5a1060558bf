"""The counting gate both upstream pools use for their slots (HTTP/1.1 connections, HTTP/2 streams).

Its own module because both pools share it: ``lean.Pool`` bounds the requests
out on its connections with it, ``mux_pool.MuxPool`` the streams out on its
connections, each to ``upstream.maxConnectionsPerBackend``.
"""

from __future__ import annotations

import asyncio
import collections


class Slots:
    """A FIFO counting gate for a pool's connection slots: a plain counter while slots are free.

    ``asyncio.Semaphore`` costs a coroutine and a scan of its waiters on every
    acquire; the uncontended path here is one comparison. Only a full pool
    creates a future to wait on. A released slot goes straight to the oldest
    live waiter, so callers that wait are served in order and a newcomer never
    overtakes them (free slots exist only while nobody waits).
    """

    __slots__ = ("free", "waiters")

    def __init__(self, limit: int) -> None:
        self.free = limit
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def try_take(self) -> bool:
        if self.free > 0:
            self.free -= 1
            return True
        return False

    async def take(self) -> None:
        """Wait for a released slot; cancellation (the acquire timeout) gives up the place in line."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just as we were cancelled: pass the slot on
            else:
                fut.cancel()
                try:
                    self.waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def release(self) -> None:
        waiters = self.waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot changes hands; ``free`` stays as it is
                return
        self.free += 1
