"""A worker's end of the hand-off: connections arrive here, closes are counted, ``R`` announces it serves."""

from __future__ import annotations

import contextlib
import socket

from gatekeeper.proxy.handoff.protocol import CONN, DRAINING, READY, RECEIVE_RETRY, ClosedCounts


class Inbox:
    """A worker's end: connections arrive here, closes are counted, ``R`` announces it serves."""

    def __init__(self, fd: int, counts: ClosedCounts, index: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)
        self._counts = counts
        self._index = index
        self.ended = False
        """The supervisor's end closed (it is exiting, or dropped this worker): nothing more will arrive."""
        self.error: OSError | None = None
        """The error that stopped the last :meth:`receive`: fatal with ``ended``, else one of RECEIVE_RETRY."""
        self.lost = 0
        """Connections whose descriptor never arrived (out of descriptors); each is counted closed, else the
        supervisor would count them open for this worker's whole life."""

    def announce(self) -> None:
        try:
            self.sock.send(READY)
        except (BrokenPipeError, ConnectionResetError):
            # The supervisor closed its end while we started (SIGTERM early in its life): the reader sees the end
            # of stream next and drains this worker, as for any stop; a traceback and exit 1 said otherwise.
            pass

    def receive(self) -> list[socket.socket]:
        """Every connection waiting now (never blocks); stops at one whose descriptor was lost (see ``lost``)."""
        out: list[socket.socket] = []
        self.lost = 0
        self.error = None
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self.sock, 1, 8)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError as exc:
                # Not all ends: taking ENOBUFS/ENOMEM for the end left a worker serving but handed nothing more.
                self.error = exc
                self.ended = exc.errno not in RECEIVE_RETRY
                return out
            for fd in fds:
                conn = socket.socket(fileno=fd)
                conn.setblocking(False)
                out.append(conn)
            if msg == CONN and not fds:  # EMFILE on receipt: the kernel dropped it (MSG_CTRUNC)
                self.lost += 1
                self.closed()
                return out  # the next ones would be lost too: the caller backs off
            if not msg and not fds:
                self.ended = True
                return out

    def closed(self) -> None:
        self._counts.add(self._index)

    def leave(self) -> None:
        """Say we drain (the supervisor takes back what we have not read), then close our end; nothing to say
        if the supervisor already closed its end."""
        with contextlib.suppress(OSError):
            self.sock.send(DRAINING)
        self.close()

    def close(self) -> None:
        self.sock.close()
