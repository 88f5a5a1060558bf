"""A server-side TLS handshake under a deadline that counts the client's delay, not the server's.

Shared by the proxy's listener and the webhook's (base layer: neither imports the other).

``tlsHandshakeTimeoutSeconds`` exists so that a client cannot hold a connection
slot by connecting and never finishing TLS (the webhook's is
``server.tlsHandshakeTimeoutSeconds``). The event loop's own handshake
timer (``ssl_handshake_timeout``) cannot tell that client from one whose bytes
came in time while the proxy itself was behind: uvloop runs expired timers
before it reads sockets, so after a stall of the loop (a process starved of CPU
on a busy node, the seeds' LIST storm) the timer aborts handshakes whose
ClientHello or Finished waits, unread, in our own socket buffer. The storm
test saw exactly that: a probe's new HTTP/2 connection was cut 10 s into a
storm, and its first request failed.

So when the deadline passes, two checks say whether the delay was ours, and
then the handshake gets a fresh period, up to ``tlsHandshakeMaxSeconds`` in all
(a hard cap: a handshake never holds a slot longer, whatever the reason):

* the deadline's own timer ran late (by more than a quarter period, at least
  50 ms): the loop was stalled, so the client may not even have seen our last
  flight; it gets a period from now to answer it;
* the client's bytes wait unread in the kernel (``FIONREAD``): it answered, we
  did not read.

A client that sent nothing while we kept up is cut at the first deadline, as
before. Each extension is counted by the caller (``on_late``;
``gatekeeper_proxy_tls_handshakes_late_total``, ``gatekeeper_webhook_tls_handshakes_late_total``): a sign of a
server short of CPU.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import socket
import ssl
import termios
from collections.abc import Callable

MIN_LATENESS = 0.05
"""A deadline timer that ran this late (or a quarter period, if more) was held up by the loop, not the client."""


def unread_bytes(sock: socket.socket) -> int:
    """Bytes the kernel holds for ``sock`` that nobody has read yet (0 if it cannot tell)."""
    fd = sock.fileno()
    if fd < 0:
        return 0
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    except OSError:
        return 0
    return buf[0]


async def handshake_within(
    loop: asyncio.AbstractEventLoop,
    conn: socket.socket,
    protocol_factory: Callable[[], asyncio.Protocol],
    ssl_context: ssl.SSLContext,
    period: float,
    max_seconds: float,
    on_late: Callable[[], None],
) -> asyncio.Transport:
    """``loop.connect_accepted_socket(..., ssl=...)``, cut at ``period`` unless the client's bytes wait unread.

    Raises TimeoutError past the deadline, and whatever the handshake raises (ssl.SSLError, OSError) on
    failure. The event loop's own timer stays armed at ``max_seconds``, the hard cap.
    """
    handshake = asyncio.ensure_future(loop.connect_accepted_socket(
        protocol_factory, conn, ssl=ssl_context, ssl_handshake_timeout=max_seconds))
    deadline = loop.time() + period
    cap = loop.time() + max_seconds
    try:
        while True:
            done, _ = await asyncio.wait((handshake,), timeout=max(0.0, deadline - loop.time()))
            if done:
                transport, _protocol = handshake.result()
                return transport
            now = loop.time()
            if now >= deadline:
                ours = now - deadline > max(MIN_LATENESS, period / 4) or unread_bytes(conn) > 0
                if now >= cap or not ours:
                    raise TimeoutError(f"TLS handshake not done in {period:g}s")
                on_late()
                deadline = min(cap, now + period)
    except BaseException:
        if not handshake.done():
            handshake.cancel()
            with contextlib.suppress(BaseException):
                await handshake
        raise
