"""Protocol upgrades (WebSocket, SPDY/3.1: exec, attach, port-forward) to one apiserver, past every pool.

An upgraded connection belongs to its client until one side closes it, so it never comes from or goes back to a shared
pool: each upgrade has a pool of one. The request and the answer go through the pooled path's round trip (one parser,
one body framing, one error mapping); a refused upgrade is an ordinary response on a connection then closed, a 101
hands the socket to the adapter as streams."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse, Upgraded
from gatekeeper.proxy.upstream import lean
from gatekeeper.proxy.upstream.errors import BackendFailed
from gatekeeper.proxy.upstream.exchange import ClientBody
from gatekeeper.proxy.upstream.hop_by_hop import KEEP_UPGRADE, REQUEST_REMOVED, response_headers

UPGRADE_REMOVED = REQUEST_REMOVED - {"connection", "upgrade"}
"""What never leaves on an upgrade request: it keeps ``Connection: upgrade`` (all the front stage left of it)."""


class _UpgradeConn(lean.Conn):
    """A connection whose 101 is the answer: the socket then leaves the parser for the tunnel's streams."""

    final_1xx = 101
    streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    def _switched(self, rest: bytes) -> None:
        task = self.body_task
        if self.status != 101 or self.transport is None or (task is not None and not task.done()):
            # Tunnel bytes must not mix with a request body still going up (the old splice sent it whole first).
            super()._switched(rest)
            return
        transport = self.transport
        reader = asyncio.StreamReader(limit=lean.MAX_HEAD_BYTES, loop=self.loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=self.loop)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if rest:
            reader.feed_data(rest)
        self.streams = reader, asyncio.StreamWriter(transport, protocol, reader, self.loop)


class _UpgradePool(lean.Pool):
    conn_class = _UpgradeConn


async def open_upgrade(request: ProxyRequest, head: bytes, declared: int | None, *, name: str, host: str, port: int,
                       ssl_ctx: ssl.SSLContext, connect_timeout: float,
                       on_done: Callable[[BaseException | None], None]) -> ProxyResponse:
    """Open a TLS connection, send the upgrade request (framed as on the pooled path, :data:`UPGRADE_REMOVED`), hand a
    101 connection to the adapter. The errors are :func:`lean.round_trip`'s; there is no response-header timeout (the
    listener bounds an unanswered upgrade)."""
    pool = _UpgradePool(host, port, limit=1, connect_timeout=connect_timeout)

    def done(error: BaseException | None) -> None:
        pool.close()  # a refused upgrade's connection read whole is never reused
        on_done(error)

    status, raw, body = await lean.round_trip(
        pool, name, ssl_ctx, lambda: (ssl_ctx,), head, method=request.method,
        body=ClientBody(request.body) if request.body is not None else None, declared=declared, header_timeout=None,
        acquire_timeout=connect_timeout, pool_name="upgrade", swallow_body_errors=True, on_done=done)
    if status != 101:
        return ProxyResponse(status=status, headers=response_headers(raw), body=body)
    streams = body.conn.streams if isinstance(body.conn, _UpgradeConn) else None
    if streams is None:  # failed as round_trip fails: no on_done
        body.conn.abort()
        raise BackendFailed(f"{name}: upgrade failed: switched protocols before the request body was sent")

    async def on_close() -> None:
        on_done(None)

    return ProxyResponse(status=101, headers=response_headers(raw, KEEP_UPGRADE),
                         upgraded=Upgraded(streams[0], streams[1], on_close))
