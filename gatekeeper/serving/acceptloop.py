"""The accept loop of a TLS port, shared by the proxy's listener and the webhook's (base layer: neither imports
the other).

Both accept for themselves rather than through ``loop.create_server(ssl=...)``: the proxy closes connections
over ``maxClientConnections`` before any TLS work, and both run the handshake under
:func:`gatekeeper.serving.tlshandshake.handshake_within`. What each does with a connection is its own
(``on_connection``); what is common is the loop, and its answer to a failing accept.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

ACCEPT_BACKOFF = 0.1
"""Seconds without accepting after an accept failed (EMFILE/ENFILE out of descriptors, ENOBUFS/ENOMEM): the
listening socket stays readable, so trying again at once would spin the event loop, starving the connections
it serves, for as long as the shortage lasts; meanwhile new connections wait in the kernel's backlog."""


async def accept_forever(sock: socket.socket, on_connection: Callable[[socket.socket], None], *,
                         log: logging.Logger, stopping: Callable[[], bool] = lambda: False) -> None:
    """Accept on ``sock`` and give each connection to ``on_connection`` (which must not block), until
    ``stopping()`` or until the task is cancelled; a failed accept is logged on ``log`` (the caller's, so the
    warning names the server) and retried after :data:`ACCEPT_BACKOFF`."""
    loop = asyncio.get_running_loop()
    while not stopping():
        try:
            conn, _ = await loop.sock_accept(sock)
        except OSError as exc:
            log.warning("accept failed: %s; accepting again in %.1fs", exc, ACCEPT_BACKOFF)
            await asyncio.sleep(ACCEPT_BACKOFF)
            continue
        on_connection(conn)
