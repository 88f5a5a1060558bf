"""The webhook's accept loop: TLS handshakes under :func:`gatekeeper.serving.tlshandshake.handshake_within`.

Why not ``loop.create_server(ssl=..., ssl_handshake_timeout=...)`` any more: the
event loop's handshake timer runs before the loop reads sockets, so a worker
that stalled (starved of CPU when the node is busiest) cut the apiserver's new
connections whose TLS bytes waited unread in our own buffer, and with
``failurePolicy: Fail`` the apiserver then refused the requests under review.
Accepting here lets the handshake deadline tell the client's delay from ours.

:class:`AcceptServer` stands where aiohttp's site keeps its ``asyncio`` server:
``close()`` stops accepting and cuts handshakes still in progress; connections
past their handshake belong to aiohttp's server (drained by the runner).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable

from gatekeeper.serving.acceptloop import accept_forever
from gatekeeper.serving.tlshandshake import handshake_within

log = logging.getLogger("gatekeeper.webhook.accept")


class AcceptServer(asyncio.AbstractServer):
    """Accept on ``sockets``; each connection's handshake gets ``protocol_factory``'s protocol when it completes."""

    def __init__(self, sockets: list[socket.socket], protocol_factory: Callable[[], asyncio.Protocol],
                 ssl_context: ssl.SSLContext, *, period: float, max_seconds: float,
                 on_timeout: Callable[[], None], on_late: Callable[[], None],
                 on_accepted: Callable[[], None] = lambda: None) -> None:
        self._sockets = sockets
        self._factory = protocol_factory
        self._ssl = ssl_context
        self._period, self._max_seconds = period, max_seconds
        self._on_timeout, self._on_late = on_timeout, on_late
        self._on_accepted = on_accepted
        self._loop = asyncio.get_running_loop()
        self._accepters = [self._loop.create_task(accept_forever(s, self._start_handshake, log=log))
                           for s in sockets]
        self._handshakes: set[asyncio.Task[None]] = set()
        self._closed = asyncio.Event()

    @property
    def sockets(self) -> list[socket.socket]:
        return list(self._sockets)

    def _start_handshake(self, conn: socket.socket) -> None:
        task = self._loop.create_task(self._handshake(conn))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, conn: socket.socket) -> None:
        try:
            await handshake_within(self._loop, conn, self._factory, self._ssl, self._period, self._max_seconds,
                                   self._on_late)
            self._on_accepted()
        except (ConnectionAbortedError, TimeoutError):
            self._on_timeout()
            conn.close()
        except (ssl.SSLError, OSError, EOFError) as exc:
            log.debug("TLS handshake failed: %s", exc)
            conn.close()
        # Past its handshake the connection is the protocol's (aiohttp's), and the transport owns the socket.

    def close(self) -> None:
        for task in [*self._accepters, *self._handshakes]:
            task.cancel()
        for sock in self._sockets:
            sock.close()
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self._accepters, *self._handshakes, return_exceptions=True)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return not self._closed.is_set()

    async def start_serving(self) -> None:
        return None

    async def serve_forever(self) -> None:
        await self._closed.wait()

    async def __aenter__(self) -> AcceptServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()
