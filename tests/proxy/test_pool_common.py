"""Both upstream pools wait for a slot and connect through one shared part: a full pool and a refused connect read
the same on HTTP/1.1 and HTTP/2, and nothing was sent in either case."""

from __future__ import annotations

import socket
import ssl

import pytest

from gatekeeper.proxy.upstream import lean, mux_pool
from gatekeeper.proxy.upstream.errors import ConnectFailed, PoolTimeout


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_full_pool_says_what_it_waited_for_on_either_protocol() -> None:
    ctx = ssl.create_default_context()
    pool = lean.Pool("127.0.0.1", 1, limit=0, connect_timeout=1.0)
    with pytest.raises(PoolTimeout, match=r"^no free short-request connection to b within 0\.01s$"):
        await lean.round_trip(pool, "b", ctx, lambda: (ctx,), b"GET / HTTP/1.1\r\n\r\n", method="GET", body=None,
                              declared=None, header_timeout=1.0, acquire_timeout=0.01, pool_name="short-request",
                              swallow_body_errors=False, on_done=lambda _e: None)
    mux = mux_pool.MuxPool("127.0.0.1", 1, limit=0, max_streams=10, connect_timeout=1.0)
    with pytest.raises(PoolTimeout, match=r"^no free HTTP/2 stream to b within 0\.01s$"):
        await mux_pool.exchange(mux, "b", ctx, lambda: (ctx,), b"", head_only=False, header_timeout=1.0,
                                acquire_timeout=0.01, on_done=lambda _e: None)
    assert (pool.slots.free, mux.slots.free) == (0, 0)


async def test_a_refused_connect_is_a_connect_failure_on_either_protocol() -> None:
    ctx = ssl.create_default_context()
    port = closed_port()
    pool = lean.Pool("127.0.0.1", port, limit=1, connect_timeout=1.0)
    with pytest.raises(ConnectFailed, match=r"^connection refused$"):
        await lean.round_trip(pool, "b", ctx, lambda: (ctx,), b"GET / HTTP/1.1\r\n\r\n", method="GET", body=None,
                              declared=None, header_timeout=1.0, acquire_timeout=1.0, pool_name="short-request",
                              swallow_body_errors=False, on_done=lambda _e: None)
    mux = mux_pool.MuxPool("127.0.0.1", port, limit=1, max_streams=10, connect_timeout=1.0)
    with pytest.raises(ConnectFailed, match=r"^connection refused$"):
        await mux_pool.exchange(mux, "b", ctx, lambda: (ctx,), b"", head_only=False, header_timeout=1.0,
                                acquire_timeout=1.0, on_done=lambda _e: None)
    assert (pool.slots.free, mux.slots.free, pool.open) == (1, 1, 0)
