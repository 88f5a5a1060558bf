"""The supervisor's end of the hand-off: one thread accepts and sends each connection to the least-loaded worker."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import queue
import selectors
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable

from gatekeeper.proxy.handoff.protocol import BACKLOG, CONN, DRAINING, READY, ClosedCounts, least_loaded
from gatekeeper.serving.acceptloop import ACCEPT_BACKOFF

log = logging.getLogger("gatekeeper.proxy.handoff")

QUEUE_SNDBUF = 16 * 1024
"""About 40 queued connections: the default (208 KiB) queued hundreds on a stopped worker before the next got one."""
LAG_SECONDS = 0.05
"""A healthy worker reads its socket within milliseconds: one that leaves a connection unread this long is behind."""
STALL_SECONDS = 0.5
"""Behind this long: logged and counted as a stall (``gatekeeper_proxy_handoff_stalls_total``)."""
PASS_OVER_SECONDS = 0.5
"""A worker with nothing queued cannot show it reads again, so after a take-back it is passed over this long,
then tried again (at the cost of one connection delayed ~LAG_SECONDS per period while it stays stopped)."""


def unread_bytes(sock: socket.socket) -> int:
    """Bytes of hand-off messages the worker has not read (``SIOCOUTQ``); 0 if the socket cannot say."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except OSError:
        return 0


class HandoffDispatcher:
    """The supervisor's accepting thread (see the module docstring)."""

    def __init__(self, listeners: list[socket.socket], counts: ClosedCounts, workers: int,
                 on_handoff: Callable[[int], None] = lambda worker: None,
                 on_wait: Callable[[], None] = lambda: None,
                 on_stall: Callable[[int], None] = lambda worker: None,
                 on_take_back: Callable[[int], None] = lambda worker: None,
                 max_connections: int = 0, on_refused: Callable[[int], None] = lambda open_now: None) -> None:
        """``max_connections``: proxy-wide cap on open client connections (0 = none); refusals go to ``on_refused``."""
        self._listeners = listeners
        self._max, self._on_refused = max_connections, on_refused
        self._counts = counts
        self._on_handoff, self._on_wait = on_handoff, on_wait
        self._on_stall, self._on_take_back = on_stall, on_take_back
        self._pending: socket.socket | None = None
        """A connection no worker could take yet (every socket full, or none serving)."""
        self._channels: list[socket.socket | None] = [None] * workers
        self._inboxes: list[socket.socket | None] = [None] * workers
        """Our duplicate of each worker's end: what the worker has not read yet, we can read instead."""
        self._taken_back_at = [0.0] * workers
        """When we last took a worker's unread connections back (it is passed over for PASS_OVER_SECONDS)."""
        self._serving = [False] * workers
        self._sent = [0] * workers
        self._unread_since = [0.0] * workers
        """When the oldest connection a worker has not read yet was handed to it (0: it has read them all)."""
        self._stalled = [False] * workers
        self._closed: set[int] = set()
        """Workers whose socket the thread closed as it ended (see :meth:`stop`)."""
        self._last = workers - 1
        self._commands: queue.SimpleQueue[tuple[int, tuple[socket.socket, socket.socket] | None]] = \
            queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="gatekeeper-handoff", daemon=True)
        self._sel = selectors.DefaultSelector()
        self._accepting = False
        self._listening = False
        self._resume_at = 0.0
        """After a failed accept (EMFILE): not before this ``time.monotonic()``."""
        self._on_failure: Callable[[], object] = lambda: None

    # --------------------------------------------------------------- called from the event loop

    def channel(self, worker: int) -> socket.socket:
        """A fresh socket pair for ``worker`` (about to be started); returns the end it inherits."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, QUEUE_SNDBUF)
        ours.setblocking(False)
        self._command(worker, (ours, theirs.dup()))  # not inherited by later workers (dup is non-inheritable)
        return theirs

    def retire(self, worker: int) -> None:
        """``worker``'s process exited: the others get what it had not read (our duplicate keeps its socket open)."""
        self._command(worker, None)

    def start(self, on_failure: Callable[[], object] = lambda: None) -> None:
        """``on_failure`` runs if the thread dies of a bug: the port is closed then, so the caller must stop."""
        self._on_failure = on_failure
        self._thread.start()

    def stop(self) -> set[int]:
        """Close the listeners and the workers' sockets; returns the workers whose socket was closed (each
        drains). Any other worker may still hold an open socket and must be signalled otherwise."""
        self._stop = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(5)
        if self._thread.is_alive():
            return set()
        while True:
            try:
                _, sock = self._commands.get_nowait()
            except queue.Empty:
                return set(self._closed)
            if sock is not None:
                for s in sock:
                    s.close()

    def loads(self) -> list[int | None]:
        return [self._load(i) if self._serving[i] else None for i in range(len(self._serving))]

    def _command(self, worker: int, sock: tuple[socket.socket, socket.socket] | None) -> None:
        self._commands.put((worker, sock))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"w")

    # --------------------------------------------------------------- the thread

    def _load(self, worker: int) -> int:
        return self._sent[worker] - self._counts.read(worker)

    def _run(self) -> None:
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._stop:
                pause = self._timeout(time.monotonic())
                for key, mask in self._sel.select(pause):
                    if key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                        self._apply_commands()
                    elif key.data == "listener":
                        self._accept(key.fileobj)  # type: ignore[arg-type]
                    elif mask & selectors.EVENT_READ:
                        self._from_worker(int(key.data))
                self._take_back_lagging(time.monotonic())
                if self._pending is not None:
                    self._retry_pending()
                self._set_accepting(self._pending is None and any(self._serving)
                                    and time.monotonic() >= self._resume_at)
        except Exception:  # a bug here must not leave the port silently unserved (the supervisor exits 1)
            log.exception("connection hand-off thread failed; closing the listeners")
            with contextlib.suppress(Exception):  # e.g. the parent's loop already closed: the listeners still go
                self._on_failure()
        finally:
            self._sel.close()
            if self._pending is not None:
                self._pending.close()
            for s in self._listeners:
                s.close()
            for i, ch in enumerate(self._channels):
                if ch is not None:
                    ch.close()
                    self._closed.add(i)
            for inbox in self._inboxes:
                if inbox is not None:
                    inbox.close()  # what the workers have not read goes when they close their ends
            self._wake_r.close()
            self._wake_w.close()

    def _apply_commands(self) -> None:
        while True:
            try:
                worker, sock = self._commands.get_nowait()
            except queue.Empty:
                return
            self._drop(worker)
            if sock is not None:
                self._channels[worker], self._inboxes[worker] = sock
                self._sel.register(sock[0], self._channel_events(worker), str(worker))

    def _channel_events(self, worker: int) -> int:
        """A serving worker's writability matters only while a connection waits for a socket to drain."""
        wait = self._pending is not None and self._serving[worker]
        return selectors.EVENT_READ | (selectors.EVENT_WRITE if wait else 0)

    def _watch_channels(self) -> None:
        for i, ch in enumerate(self._channels):
            if ch is not None:
                self._sel.modify(ch, self._channel_events(i), str(i))

    def _retry_pending(self) -> None:
        conn, self._pending = self._pending, None
        assert conn is not None
        if self._hand_over(conn):
            conn.close()
            self._watch_channels()
        else:
            self._pending = conn

    def _drop(self, worker: int) -> None:
        self._serving[worker] = False
        self._take_back(worker)  # before its socket goes: the others serve what it did not read
        old = self._channels[worker]
        if old is not None:
            self._sel.unregister(old)
            old.close()
        inbox = self._inboxes[worker]
        if inbox is not None:
            inbox.close()
        self._channels[worker] = self._inboxes[worker] = None
        self._sent[worker] = 0
        self._unread_since[worker] = 0.0
        self._taken_back_at[worker] = 0.0
        self._stalled[worker] = False
        self._counts.reset(worker)

    def _timeout(self, now: float) -> float | None:
        """Until the accept back-off ends or a worker's oldest unread connection is LAG_SECONDS old."""
        wake = [self._resume_at] if self._resume_at > now else []
        # only deadlines ahead, never a spinning loop: a lone laggard is looked at again at the next event
        wake += [t + LAG_SECONDS for i, t in enumerate(self._unread_since)
                 if t and self._serving[i] and t + LAG_SECONDS > now]
        return max(0.0, min(wake) - now) if wake else None

    def _lag(self, worker: int, now: float) -> float:
        """How long ``worker`` has left a connection handed to it unread (0: it read every one)."""
        ch = self._channels[worker]
        if not self._unread_since[worker]:
            return 0.0
        if ch is None or unread_bytes(ch) == 0:
            self._unread_since[worker] = 0.0
            self._stalled[worker] = False  # it read what we handed it: a stall is over
            return 0.0
        return now - self._unread_since[worker]

    def _keeps_up(self, worker: int, now: float) -> bool:
        return (self._serving[worker] and now - self._taken_back_at[worker] >= PASS_OVER_SECONDS
                and self._lag(worker, now) < LAG_SECONDS)

    def _stall(self, worker: int, lag: float, what: str) -> None:
        """Logged and counted once per stall (until the worker is seen reading again)."""
        if not self._stalled[worker]:
            self._stalled[worker] = True
            log.info("worker %d has left a connection unread for %.2fs: %s", worker, lag, what)
            self._on_stall(worker)

    def _take_back_lagging(self, now: float) -> None:
        """A worker that left a connection unread for LAG_SECONDS loses its queue to one that keeps up."""
        n = len(self._serving)
        for i in range(n):
            if not self._serving[i] or self._inboxes[i] is None:
                continue
            lag = self._lag(i, now)
            if lag < LAG_SECONDS or not any(self._keeps_up(j, now) for j in range(n) if j != i):
                continue  # keeps up, or nobody else does: it keeps its queue (a stall at STALL_SECONDS)
            self._stall(i, lag, "handing its connections to another worker")
            self._taken_back_at[i] = now
            self._take_back(i)

    def _take_back(self, worker: int) -> None:
        """Receive ``worker``'s unread connections on our duplicate of its end and hand them on. Race-free: the kernel
        gives each message to one reader only."""
        inbox = self._inboxes[worker]
        if inbox is None:
            return
        taken: list[socket.socket] = []
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(inbox, 1, 8, socket.MSG_DONTWAIT)
            except OSError:  # BlockingIOError: nothing left; ENOBUFS/ENOMEM: what is left stays with the worker
                break
            if not msg and not fds:
                break
            if msg == CONN:
                self._sent[worker] -= 1  # never reached it
            taken += [socket.socket(fileno=fd) for fd in fds]  # none: we are out of descriptors, it is lost
        self._unread_since[worker] = 0.0
        if taken:
            log.info("took %d unread connection(s) back from worker %d", len(taken), worker)
        for conn in taken:
            self._on_take_back(worker)
            if self._hand_over(conn):
                conn.close()
            elif self._pending is None:
                self._pending = conn  # as at accept: accepting pauses until a worker can take it
                self._on_wait()
                self._watch_channels()
            else:
                log.warning("no worker can take a connection taken back from worker %d: closing it", worker)
                conn.close()

    def _from_worker(self, worker: int) -> None:
        ch = self._channels[worker]
        if ch is None:
            return
        try:
            msg = ch.recv(16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            # ECONNRESET cannot happen while we hold the duplicate (kept for safety); anything else drops a live
            # worker's socket: it drains and is restarted.
            if not isinstance(exc, ConnectionResetError):
                log.warning("worker %d's hand-off socket failed (%s): dropping it", worker, exc)
            msg = b""
        if msg == READY:
            self._serving[worker] = True
            log.debug("worker %d takes connections", worker)
            if self._pending is not None:
                self._watch_channels()
        elif msg == DRAINING:
            self._serving[worker] = False
            log.debug("worker %d drains", worker)
            self._take_back(worker)
        elif not msg:  # its end closed (not while we hold its duplicate: see retire); a successor gets a new one
            self._drop(worker)

    def _set_accepting(self, on: bool) -> None:
        """Accept only while a worker serves; the port opens when one first serves, so a TCP health check does
        not pass early."""
        if on == self._accepting:
            return
        self._accepting = on
        for s in self._listeners:
            if on:
                if not self._listening:
                    s.listen(BACKLOG)
                self._sel.register(s, selectors.EVENT_READ, "listener")
            else:
                self._sel.unregister(s)
        self._listening = self._listening or on

    def _accept(self, listener: socket.socket) -> None:
        if self._pending is not None:
            # Another listener already left a connection no worker could take: one more would replace and close it.
            return
        for _ in range(64):  # then let the workers' messages in
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: the listener stays readable, so back off
                log.warning("accept failed: %s; accepting again in %.1fs", exc, ACCEPT_BACKOFF)
                self._resume_at = time.monotonic() + ACCEPT_BACKOFF
                return
            if self._max and (open_now := sum(load or 0 for load in self.loads())) >= self._max:
                conn.close()  # the cap is the whole proxy's: each worker's own would let N times as many in
                self._on_refused(open_now)
                continue
            if not self._hand_over(conn):
                self._pending = conn  # accepting pauses (see _run) until a worker can take it
                self._on_wait()
                self._watch_channels()
                return
            conn.close()  # the worker has its own descriptor now

    def _hand_over(self, conn: socket.socket) -> bool:
        """Pass ``conn`` to the least-loaded worker that takes it, preferring ones that keep up; False if none."""
        now = time.monotonic()
        loads = self.loads()
        behind: list[int | None] = [None] * len(loads)
        for i, load in enumerate(loads):
            if load is None or self._channels[i] is None or self._keeps_up(i, now):
                continue
            behind[i], loads[i] = load, None
            lag = self._lag(i, now)
            if lag >= STALL_SECONDS:
                self._stall(i, lag, "passing it over")
        return self._send_least_loaded(conn, loads, now) or self._send_least_loaded(conn, behind, now)

    def _send_least_loaded(self, conn: socket.socket, loads: list[int | None], now: float) -> bool:
        while True:
            worker = least_loaded(loads, self._last)
            if worker is None:
                return False
            ch = self._channels[worker]
            assert ch is not None
            try:
                socket.send_fds(ch, [CONN], [conn.fileno()], socket.MSG_DONTWAIT)
            except OSError:  # BlockingIOError: its socket is full, it is not reading; else it just died
                loads[worker] = None
                continue
            self._sent[worker] += 1
            if not self._unread_since[worker]:
                self._unread_since[worker] = now
            self._last = worker
            self._on_handoff(worker)
            return True
