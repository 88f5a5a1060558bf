"""Proxy-wide seats for N worker processes: a shared-memory ledger under a file lock (docs/proxy/workers.md).

Queues stay per worker; only seats (and the LIST byte budget, and expensive LISTs per apiserver) are proxy-wide,
so a level's limit holds with any number of workers. Each worker writes only its own column; taking seats holds
one ``fcntl.lockf`` record lock, which the kernel drops if its holder dies, so a killed worker cannot wedge the
others, and the supervisor zeroes its columns (:meth:`SeatLedger.clear_worker`). Across workers a free seat goes
to the waiting worker with the lowest virtual time, weighted by its non-empty queues (start-time fair queuing:
every queue of the proxy gets an equal share, as upstream); the next one is woken through ``wake-N.sock``, and a
50 ms poll backs up lost wake-ups.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import hashlib
import mmap
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from gatekeeper.proxy.flowcontrol.core.objects import PriorityLevel
from gatekeeper.proxy.flowcontrol.core.queueset import LevelState, ListBudget, Ticket

if TYPE_CHECKING:
    from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl

MAX_LEVELS = 64
MAX_BACKENDS = 64
NAME_BYTES = 64
_HEADER = 3  # magic, workers, levels
_MAGIC = 0x6B6C6564676572  # "ledger"
_HEAD = 3  # per level: last_granted, peak holders, virtual time V
_PER_WORKER = 5  # seats, holders, waiting, active queues, virtual time
_SEATS, _HOLDERS, _WAITING, _ACTIVE, _VT = 0, 1, 2, 3, 4
VT_SCALE = 1 << 20
"""One grant to a worker with one active queue advances its virtual time by this much."""


def _name_key(name: str) -> bytes:
    raw = name.encode()
    if len(raw) <= NAME_BYTES:
        return raw.ljust(NAME_BYTES, b"\0")
    return raw[:NAME_BYTES - 16] + hashlib.sha256(raw).hexdigest()[:16].encode()


class SeatLedger:
    """One mmap'ed ledger file; ``worker`` is this process's column (-1 in the supervisor)."""

    def __init__(self, path: Path, worker: int = -1) -> None:
        self.path = Path(path)
        self.worker = worker
        self.poller: asyncio.Task[None] | None = None
        """The lost-wake-up backstop of :func:`attach`, held here for the worker's life."""
        self._fd = os.open(self.path, os.O_RDWR)
        self._mm = mmap.mmap(self._fd, os.fstat(self._fd).st_size)
        head = memoryview(self._mm)[: _HEADER * 8].cast("q")
        if head[0] != _MAGIC:
            raise ValueError(f"{self.path}: not a seat ledger")
        self.workers = int(head[1])
        self.levels = int(head[2])
        self._names_off = _HEADER * 8
        ints_off = self._names_off + self.levels * NAME_BYTES
        self._ints = memoryview(self._mm)[ints_off:].cast("q")
        self._row = _HEAD + self.workers * _PER_WORKER
        self._list_off = self.levels * self._row
        self._backend_off = self._list_off + 2 * self.workers
        self.backend_rows: dict[str, int] = {}
        """Apiserver name -> its row (its place among the configured backends, the same in every worker)."""
        self._slots: dict[str, int] = {}
        self._wake: socket.socket | None = None

    @classmethod
    def create(cls, path: Path, workers: int, levels: int = MAX_LEVELS) -> SeatLedger:
        """The supervisor's call: a zeroed ledger for ``workers`` columns."""
        size = 8 * (_HEADER + levels * (_HEAD + workers * _PER_WORKER) + 2 * workers + MAX_BACKENDS * workers)
        size += levels * NAME_BYTES
        with open(path, "wb") as f:
            f.write(b"\0" * size)
        fd = os.open(path, os.O_RDWR)
        try:
            with mmap.mmap(fd, size) as mm:
                head = memoryview(mm)[: _HEADER * 8].cast("q")
                head[0], head[1], head[2] = _MAGIC, workers, levels
                head.release()
        finally:
            os.close(fd)
        return cls(path, -1)

    def close(self) -> None:
        self._ints.release()
        self._mm.close()
        os.close(self._fd)
        if self._wake is not None:
            self._wake.close()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[memoryview]:
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            yield self._ints
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

    # -- levels ---------------------------------------------------------------------------------
    def slot(self, name: str) -> int:
        """The level's row, found or allocated (levels are matched by name across workers)."""
        got = self._slots.get(name)
        if got is not None:
            return got
        key = _name_key(name)
        with self._locked():
            for i in range(self.levels):
                off = self._names_off + i * NAME_BYTES
                cur = self._mm[off:off + NAME_BYTES]
                if cur == key or cur == b"\0" * NAME_BYTES:
                    self._mm[off:off + NAME_BYTES] = key
                    self._slots[name] = i
                    return i
        raise RuntimeError(f"seat ledger {self.path}: more than {self.levels} priority levels")

    def names(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in range(self.levels):
            off = self._names_off + i * NAME_BYTES
            raw = self._mm[off:off + NAME_BYTES].rstrip(b"\0")
            if raw:
                out[raw.decode(errors="replace")] = i
        return out

    def _col(self, slot: int, worker: int, field: int) -> int:
        return slot * self._row + _HEAD + worker * _PER_WORKER + field

    def try_take(self, slot: int, limit: int, seats: int, list_bytes: int, list_cap: int,
                 backend: int = -1, backend_cap: int = 0, *, seated: bool = True) -> bool:
        """Take ``seats`` for this worker if they fit proxy-wide and it has the lowest virtual time of the waiting.
        ``seated=False``: only the LIST bytes and the apiserver's slot (a leased level's seats are its Leases)."""
        me = self.worker
        if seated and limit <= 0:
            return False
        v = self._ints
        b = slot * self._row
        fd = self._fd
        fcntl.lockf(fd, fcntl.LOCK_EX)
        try:
            total = holders = 0
            c = b + _HEAD
            mine = c + me * _PER_WORKER
            my_vt = max(v[mine + _VT], v[b + 2])
            turn = me
            turn_vt = my_vt
            for w in range(self.workers if seated else 0):
                total += v[c]
                holders += v[c + 1]
                if w != me and v[c + _WAITING] > 0 and v[c + _VT] < turn_vt:
                    turn, turn_vt = w, v[c + _VT]
                c += _PER_WORKER
            if seated and total + seats > limit and holders > 0:
                return False
            if list_bytes:
                used = count = 0
                for w in range(self.workers):
                    used += v[self._list_off + 2 * w]
                    count += v[self._list_off + 2 * w + 1]
                if count > 0 and used + list_bytes > list_cap:
                    return False
            if backend >= 0 and self._backend_total(backend) >= backend_cap:
                return False
            if turn != me:
                self.signal(turn)
                return False
            if seated:
                v[mine] += seats
                v[mine + 1] += 1
                v[mine + _VT] = my_vt + VT_SCALE // max(1, v[mine + _ACTIVE])
                v[b] = me
                v[b + 2] = my_vt
                if holders >= v[b + 1]:
                    v[b + 1] = holders + 1
            if list_bytes:
                v[self._list_off + 2 * me] += list_bytes
                v[self._list_off + 2 * me + 1] += 1
            if backend >= 0:
                v[self._backend_off + backend * self.workers + me] += 1
            return True
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN)

    def _backend_total(self, backend: int) -> int:
        row = self._backend_off + backend * self.workers
        return sum(self._ints[row:row + self.workers])

    def backend_count(self, name: str) -> int:
        """Expensive LISTs all workers run on an apiserver (read without the lock: :meth:`try_take` checks again)."""
        row = self.backend_rows.get(name)
        return 0 if row is None else self._backend_total(row)

    def give(self, slot: int, seats: int, list_bytes: int, backend: int = -1, *, seated: bool = True) -> None:
        """Return what :meth:`try_take` took; wake the waiting worker whose turn is next. No lock: only
        this worker writes its column, in aligned 8-byte stores, and a stale higher value only refuses a seat."""
        me = self.worker
        v = self._ints
        b = slot * self._row
        c = b + _HEAD + me * _PER_WORKER
        if seated:
            # Holders first, then seats: a reader mid-way never over-counts the peak and sees at worst more seats.
            v[c + 1] = max(0, v[c + 1] - 1)
            v[c] = max(0, v[c] - seats)
        if backend >= 0:
            cell = self._backend_off + backend * self.workers + me
            v[cell] = max(0, v[cell] - 1)
        if list_bytes:
            v[self._list_off + 2 * me] = max(0, v[self._list_off + 2 * me] - list_bytes)
            v[self._list_off + 2 * me + 1] = max(0, v[self._list_off + 2 * me + 1] - 1)
        if list_bytes or backend >= 0:  # bytes or an apiserver's slot freed: any worker's level may go on
            for w in self._waiting_anywhere(v, me):
                self.signal(w)
            return
        if not seated:
            return
        nxt = self._next_waiting(v, b)
        if nxt is not None and nxt != me:
            self.signal(nxt)

    def _next_waiting(self, v: memoryview, b: int) -> int | None:
        best: tuple[int, int] | None = None
        for w in range(self.workers):
            c = b + _HEAD + w * _PER_WORKER
            if v[c + _WAITING] > 0 and (best is None or v[c + _VT] < best[0]):
                best = (int(v[c + _VT]), w)
        return None if best is None else best[1]

    def set_waiting(self, slot: int, waiting: int, active: int) -> None:
        """This worker's queued requests and non-empty queues in the level. A worker whose queues were empty
        starts at the level's virtual time: no credit for idle time, no falling behind."""
        c = self._col(slot, self.worker, 0)
        v = self._ints
        if v[c + _WAITING] == 0 and waiting > 0:
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
            try:
                v[c + _VT] = max(v[c + _VT], v[slot * self._row + 2])
                v[c + _ACTIVE], v[c + _WAITING] = active, waiting
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)
            return
        v[c + _ACTIVE], v[c + _WAITING] = active, waiting

    def _waiting_anywhere(self, v: memoryview, but: int) -> list[int]:
        """Workers other than ``but`` with requests queued in any level."""
        return [w for w in range(self.workers) if w != but
                and any(v[self._col(s, w, _WAITING)] > 0 for s in range(self.levels))]

    def clear_worker(self, worker: int) -> None:
        """A worker died: drop its seats, holders and queue counts, and wake whoever waits."""
        with self._locked() as v:
            for s in range(self.levels):
                for f in (_SEATS, _HOLDERS, _WAITING, _ACTIVE):
                    v[self._col(s, worker, f)] = 0
            v[self._list_off + 2 * worker] = 0
            v[self._list_off + 2 * worker + 1] = 0
            for b in range(MAX_BACKENDS):
                v[self._backend_off + b * self.workers + worker] = 0
            wake = self._waiting_anywhere(v, worker)
        for w in wake:
            self.signal(w)

    def view(self) -> dict[str, dict[str, int]]:
        """Per level name: proxy-wide seats, holders, waiting and peak holders (for /metrics and tests)."""
        out: dict[str, dict[str, int]] = {}
        with self._locked() as v:
            for name, s in self.names().items():
                out[name] = {
                    "seats": sum(int(v[self._col(s, w, _SEATS)]) for w in range(self.workers)),
                    "holders": sum(int(v[self._col(s, w, _HOLDERS)]) for w in range(self.workers)),
                    "waiting": sum(int(v[self._col(s, w, _WAITING)]) for w in range(self.workers)),
                    "peak": int(v[s * self._row + 1]),
                }
        return out

    # -- wake-ups -------------------------------------------------------------------------------
    def wake_path(self, worker: int) -> str:
        return str(self.path.with_name(f"wake-{worker}.sock"))

    def bind_wake(self) -> socket.socket:
        """This worker's wake socket (non-blocking; the caller reads it from its event loop)."""
        path = self.wake_path(self.worker)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(path)
        s.setblocking(False)
        self._wake = s
        return s

    def signal(self, worker: int) -> None:
        if self._wake is None:
            self._wake = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._wake.setblocking(False)
        with contextlib.suppress(OSError):  # not bound yet, restarting, or its buffer is full: the poll covers it
            self._wake.sendto(b"w", self.wake_path(worker))


class LedgerLevel(LevelState):
    """A level whose seats are checked and charged in the shared ledger as well as locally."""

    ledger: SeatLedger

    def __init__(self, spec: PriorityLevel, limit: int, budget: ListBudget, ledger: SeatLedger) -> None:
        self.ledger = ledger
        self.slot = ledger.slot(spec.name)
        self._waiting = 0
        self._leased = False
        self.queues = []
        super().__init__(spec, limit, budget)

    @property
    def leased(self) -> bool:
        return self._leased

    @leased.setter
    def leased(self, value: bool) -> None:
        if value != getattr(self, "_leased", False):
            self._leased = value
            n, self._waiting = self._waiting, -1
            self.waiting = n  # publish (or withdraw) the queue for the new kind of seats
        self._leased = value

    @property
    def waiting(self) -> int:
        return self._waiting

    @waiting.setter
    def waiting(self, n: int) -> None:
        if n != self._waiting:
            self._waiting = n
            # A leased level's queue waits for Leases, not for the ledger's seats: published, it would hold the
            # turn in the ledger for good (its virtual time never moves) and starve the other workers.
            active = sum(1 for q in self.queues if q.items) if n and not self.leased else 0
            self.ledger.set_waiting(self.slot, 0 if self.leased else n, active)

    def _fits(self, t: Ticket) -> bool:
        if not super()._fits(t):
            return False
        backend = self.ledger.backend_rows.get(t.backend, -1)
        seated = not self.leased  # a leased level's seats are this worker's Leases; bytes and slots stay shared
        if not seated and not t.list_bytes and backend < 0:
            return True
        if self.ledger.try_take(self.slot, self.limit, t.seats, t.list_bytes, self.budget.cap, backend,
                                self.budget.backends.picked_limit, seated=seated):
            t.ledgered = "seats" if seated else "bytes"
            return True
        return False

    def release(self, t: Ticket) -> list[Ticket]:
        if t.holds_seats and t.ledgered:
            self.ledger.give(self.slot, t.seats, t.list_bytes, self.ledger.backend_rows.get(t.backend, -1),
                             seated=t.ledgered == "seats")
            t.ledgered = ""
        return super().release(t)


POLL_SECONDS = 0.05
"""Backstop for a lost wake-up: a worker with queued requests retries dispatch this often."""


def attach(flow: FlowControl, ledger: SeatLedger) -> asyncio.Task[None]:
    """Make a worker's flow control use the ledger (before any request is admitted) for the worker's life; returns
    the task that backs up lost wake-ups."""
    ctl = flow.controller
    caps = ctl.budget.backends
    if len(caps.names) > MAX_BACKENDS:
        raise ValueError(f"at most {MAX_BACKENDS} backends (upstream.backends) with worker processes")
    ledger.backend_rows = {name: i for i, name in enumerate(caps.names)}
    caps.count = ledger.backend_count
    ctl.level_factory = functools.partial(LedgerLevel, ledger=ledger)
    ctl.levels, ctl.draining = {}, []
    flow.apply(ctl.policy)
    loop = asyncio.get_running_loop()
    sock = ledger.bind_wake()

    def levels() -> list[LevelState]:
        return [*ctl.levels.values(), *ctl.draining]

    def redispatch() -> None:
        flow._wake([t for lv in levels() for t in lv.dispatch()])

    def on_wake() -> None:
        with contextlib.suppress(OSError):
            while sock.recv(64):
                pass
        redispatch()

    async def poll() -> None:
        while True:
            await asyncio.sleep(POLL_SECONDS)
            if any(lv.waiting for lv in levels()):
                redispatch()

    loop.add_reader(sock.fileno(), on_wake)
    ledger.poller = loop.create_task(poll(), name="gatekeeper-ledger-poll")  # the loop only holds tasks weakly
    return ledger.poller

