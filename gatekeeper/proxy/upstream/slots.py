"""What both upstream clients share (the waiting primitives and the pools' common part), in their own module so
neither imports the other."""

from __future__ import annotations

import asyncio
import collections
import ssl

from gatekeeper.proxy.upstream.errors import ConnectFailed, PoolTimeout, connect_cause


class Slots:
    """A FIFO counting gate for a pool's slots: a plain counter while slots are free. Cheaper than ``asyncio.Semaphore``
    uncontended; a released slot goes to the oldest live waiter, so a newcomer never overtakes those waiting."""

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
    """Mixin: a response's one consumer parks in :meth:`wait` until the protocol side calls :meth:`wake`; what a
    response body (``exchange.StreamedBody``) is read from: a pooled HTTP/1.1 connection or an HTTP/2 stream. Each
    class's ``take`` stays its own: a shared helper would cost a call per body chunk. Has slots because ``MuxStream``
    does."""

    __slots__ = ("loop", "waiter")
    loop: asyncio.AbstractEventLoop
    waiter: asyncio.Future[None] | None
    headers_done: bool
    error: BaseException | None
    chunks: collections.deque[bytes]
    complete: bool

    def take(self) -> bytes:
        """Everything buffered, as one chunk."""
        raise NotImplementedError

    def wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        """What to await until something changes. The future itself, no coroutine per wait; a cancelled
        consumer's done future is passed over by :meth:`wake` and replaced by the next wait."""
        waiter = self.waiter = self.loop.create_future()
        return waiter

    async def wait_head(self) -> None:
        """Until the response head is in; raises the error that ended the exchange first."""
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            await self.wait()


class BackendPool:
    """What both pools of one backend (HTTP/1.1 ``lean.Pool``, HTTP/2 ``mux_pool.MuxPool``) hold and do alike: the
    address, the slots bounding its requests, waiting for one, and the connect (so both fail it the same way)."""

    def __init__(self, host: str, port: int, *, limit: int, connect_timeout: float) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.slots = Slots(limit)

    async def wait_for_slot(self, seconds: float, what: str) -> None:
        """A slot once :meth:`Slots.try_take` failed (only a full pool pays for a future and a timeout scope)."""
        try:
            async with asyncio.timeout(seconds):
                await self.slots.take()
        except TimeoutError:
            raise PoolTimeout(f"no free {what} within {seconds:g}s") from None

    async def _dial(self, protocol: asyncio.Protocol, ctx: ssl.SSLContext) -> asyncio.Transport:
        """A TLS connection for ``protocol``; :class:`ConnectFailed` (nothing sent) when it cannot be had in time."""
        try:
            async with asyncio.timeout(self.connect_timeout):
                transport, _ = await asyncio.get_running_loop().create_connection(
                    lambda: protocol, self.host, self.port, ssl=ctx, server_hostname=self.host)
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            raise ConnectFailed(connect_cause(exc)) from exc
        return transport
