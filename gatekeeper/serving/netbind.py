"""Binding a server's TCP port, shared by the webhook's and the proxy's (base layer: neither imports the other).

Both bind the same way: every address the configured one resolves to (``localhost`` may be
``127.0.0.1`` and ``::1``), one port for all of them, and with several processes a parent that
takes the port first, without listening, so that port 0 resolves once and a port that cannot be
bound is reported once, by the parent, naming the address. The callers turn ``OSError`` into
their own one-line error naming their setting (``webhook.server``, ``proxy.listener``).
"""

from __future__ import annotations

import socket


def bind_listeners(address: str, port: int, *, reuse_port: bool = False,
                   backlog: int | None = None) -> list[socket.socket]:
    """Non-blocking sockets bound on every address ``address`` resolves to, all on one port.

    Port 0 resolves once: every address shares the first one's port. ``reuse_port`` sets SO_REUSEPORT,
    so that worker processes can bind the same port beside this socket. ``backlog=None`` binds only (the
    port is taken, but connections are refused until someone calls ``listen``): a parent that only
    reserves the port for its workers, or the proxy supervisor's hand-off, which listens once a worker
    serves, so a TCP health check does not see the port open early. An IPv6 socket is IPv6 only
    (``::`` does not also take IPv4), as asyncio's and uvloop's ``create_server`` bind it.

    Raises ``OSError`` (``socket.gaierror`` for a name that does not resolve) with nothing left open.
    """
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    out: list[socket.socket] = []
    try:
        for family, *_, addr in dict.fromkeys((i[0], i[4][0]) for i in infos):
            sock = socket.socket(family, socket.SOCK_STREAM)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((addr, port))
            if backlog is not None:
                sock.listen(backlog)
            sock.setblocking(False)
            port = int(sock.getsockname()[1])
    except OSError:
        for sock in out:
            sock.close()
        raise
    return out
