"""A request that goes away while it opens the shared HTTP/2 connection must not take the others with it.

Requests of the same TLS context that arrive while a connection is being opened wait on that one connect
(``MuxPool.opening``). When the request doing the connect was cancelled (its client went away), its
CancelledError was handed to every waiter: their tasks were not cancelled, yet they raised CancelledError,
which the listeners take for the client going away, so they sent no answer at all.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

from gatekeeper.proxy.upstream.mux_pool import MuxPool


class _Conn:
    def available(self) -> bool:
        return True


async def test_waiters_on_a_connect_whose_request_went_away_connect_themselves() -> None:
    pool = MuxPool("127.0.0.1", 1, limit=10, max_streams=10, connect_timeout=5)
    ctx = ssl.create_default_context()
    started = asyncio.Event()
    calls = 0
    fresh = _Conn()

    async def connect(_ctx: ssl.SSLContext) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            started.set()
            await asyncio.Event().wait()  # the first connect hangs until its request is cancelled
        return fresh

    pool._connect = connect  # type: ignore[method-assign,assignment]
    live = lambda: (ctx,)  # noqa: E731
    first = asyncio.create_task(pool.conn(ctx, live))
    await started.wait()
    second = asyncio.create_task(pool.conn(ctx, live))
    await asyncio.sleep(0)
    first.cancel()
    assert await second is fresh
    assert first.cancelled()
    assert calls == 2
