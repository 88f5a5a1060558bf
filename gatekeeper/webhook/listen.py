"""The webhook's listening socket: aiohttp's TCPSite plus the two bounds it lacks.

Any pod that reaches the Service can connect, not only the apiserver, so the
listener must not let a caller hold connections for free:

* ``tlsHandshakeTimeoutSeconds``: a TCP connection that never finishes its TLS
  handshake is dropped (asyncio's default is 60 s; TCPSite cannot set it);
* ``maxConnections``: past that many open connections (per worker process), a
  new one is closed right after its handshake, before any request is read, and
  counted in ``gatekeeper_webhook_refused_connections_total{reason="connection-cap"}``.
  Handshakes still in progress are not counted; the handshake timeout bounds them.

Idle connections and slow request heads are bounded by aiohttp's keep-alive
timeout (``idleTimeoutSeconds``, set on the runner), slow bodies by the
handler's ``bodyTimeoutSeconds`` (app.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import sys
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError


class QuietClientErrors(logging.Logger):
    """aiohttp's per-connection logger, minus the ERROR and traceback for every malformed request.

    Any pod can send a bad chunk size or a broken request line, and aiohttp logs each one with
    ``logger.exception``: a log flood for the price of a connection. Malformed HTTP is the client's
    fault, so it is counted (``on_bad_request``) and logged at debug level; any other exception (a bug
    of ours) keeps its ERROR and traceback.
    """

    def __init__(self, on_bad_request: Callable[[], None]) -> None:
        super().__init__("aiohttp.server")
        self.parent = logging.getLogger("aiohttp.server")
        self.on_bad_request = on_bad_request

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            self.on_bad_request()
            self.debug("%s: %s", str(msg) % args if args else msg, exc)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


class _Refuse(asyncio.Protocol):
    """A connection over the cap: closed as soon as it is handed over, nothing read or written."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.abort()


class ConnectionCap:
    """Protocol factory in front of aiohttp's: a new connection over ``limit`` open ones gets :class:`_Refuse`.

    aiohttp's server keeps one handler per open connection (``connections``), so that is the count;
    no second bookkeeping can drift from it.
    """

    def __init__(self, server: web.Server, limit: int, on_refused: Callable[[], None]) -> None:
        self.server = server
        self.limit = limit
        self.on_refused = on_refused

    def __call__(self) -> asyncio.Protocol:
        if len(self.server.connections) >= self.limit:
            self.on_refused()
            return _Refuse()
        return self.server()


class LimitedSite(web.BaseSite):
    """A TCP site with a TLS handshake timeout and a connection cap (see the module docstring)."""

    __slots__ = ("_address", "_handshake_timeout", "_max_connections", "_on_refused", "_port")

    def __init__(self, runner: web.BaseRunner, address: str, port: int, *, ssl_context: ssl.SSLContext,
                 max_connections: int, handshake_timeout: float, on_refused: Callable[[], None],
                 backlog: int = 2048) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._address, self._port = address, port
        self._max_connections = max_connections
        self._handshake_timeout = handshake_timeout
        self._on_refused = on_refused

    @property
    def name(self) -> str:
        return f"https://{self._address}:{self._port}"

    @property
    def sockets(self) -> list[socket.socket]:
        # asyncio's Server and uvloop's (not a subclass of it) both have ``sockets``; AbstractServer does not.
        return list(getattr(self._server, "sockets", None) or ())

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert isinstance(server, web.Server)
        self._server = await asyncio.get_running_loop().create_server(
            ConnectionCap(server, self._max_connections, self._on_refused), self._address, self._port,
            ssl=self._ssl_context, ssl_handshake_timeout=self._handshake_timeout, backlog=self._backlog,
            reuse_port=True)
