"""The two waiting primitives both upstream clients share (HTTP/1.1 connections, HTTP/2 streams).

Their own module because both clients use them and neither imports the other:

* :class:`Slots`: ``lean.Pool`` bounds the requests out on its connections with
  it, ``mux_pool.MuxPool`` the streams out on its connections, each to
  ``upstream.maxConnectionsPerBackend``;
* :class:`OneWaiter`: the response's one consumer (``exchange.StreamedBody``)
  waits on a ``lean.Conn`` or a ``mux_stream.MuxStream`` the same way.
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


class OneWaiter:
    """Mixin: a response's one consumer parks in :meth:`wait` until the protocol side calls :meth:`wake`.

    Headers, a body chunk, the end and an error all wake it; the consumer then looks at the state
    itself. ``lean.Conn`` and ``mux_stream.MuxStream`` set ``loop``, ``waiter``, ``headers_done`` and
    ``error``; what each does after taking bytes (resume the socket, re-open the stream window) stays
    theirs, in their ``take``: a shared helper for its first four lines would cost a call per body chunk
    (cProfile, one small GET through ``BackendClient.send`` and its body: 278 -> 279 calls on HTTP/1.1,
    and the same +1 on HTTP/2; this mixin: 278 either way). Its slots hold ``loop`` and ``waiter``
    (``MuxStream`` has slots, so the mixin must too).
    """

    __slots__ = ("loop", "waiter")
    loop: asyncio.AbstractEventLoop
    waiter: asyncio.Future[None] | None
    headers_done: bool
    error: BaseException | None

    def wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        """What to await until something changes: headers, a body chunk, the end, or an error.

        The future itself, not a coroutine: awaiting it costs no coroutine per wait, on every request's head
        and every body chunk that is not in yet. A consumer cancelled while it waits leaves its future
        cancelled behind; :meth:`wake` passes over a done one, and the next wait replaces it.
        """
        waiter = self.waiter = self.loop.create_future()
        return waiter

    async def wait_head(self) -> None:
        """Until the response head is in; raises the error that ended the exchange first.

        The protocol side sets ``error`` whenever the exchange ends without a head (the connection
        lost, closed before it began, the stream reset or refused).
        """
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            await self.wait()
