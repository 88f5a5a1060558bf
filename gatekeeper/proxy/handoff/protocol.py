"""What the supervisor and its workers say on a hand-off socket, and the close counts they share."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

READY = b"R"
"""What a worker sends on its hand-off socket once it serves."""
DRAINING = b"D"
"""A worker begins to drain: hand it nothing more, and take back what it has not read (its own close no
longer ends the socket: the supervisor holds a duplicate of its end)."""
CONN = b"C"
"""A connection follows (its descriptor rides along as SCM_RIGHTS)."""
BACKLOG = 1024
"""Pending connections the kernel queues on the TLS port once it listens (the workers' own listeners too)."""
RECEIVE_RETRY = frozenset({errno.ENOBUFS, errno.ENOMEM})
"""Receive errors that pass (kernel short of memory); any other (ECONNRESET, EBADF, ...) ends the hand-off."""
RECEIVE_BACKOFF_MAX = 1.0
"""Max seconds of a worker's doubling back-off after failed receives: never spin on a readable socket."""


def least_loaded(loads: Sequence[int | None], after: int) -> int | None:
    """The index with the smallest load (``None``: not serving); ties go to the first one after ``after``."""
    n = len(loads)
    best: int | None = None
    best_load = 0
    for k in range(1, n + 1):
        i = (after + k) % n
        load = loads[i]
        if load is not None and (best is None or load < best_load):
            best, best_load = i, load
    return best


class ClosedCounts:
    """Per worker: connections it closed since it started (shared memory; the worker writes, the parent reads)."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self._slots = memoryview(self._mm).cast("q")

    @classmethod
    def create(cls, path: Path, workers: int) -> ClosedCounts:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, 8 * workers)
        finally:
            os.close(fd)
        return cls(path)

    def add(self, worker: int) -> None:
        self._slots[worker] += 1  # one writer per slot

    def read(self, worker: int) -> int:
        return int(self._slots[worker])

    def reset(self, worker: int) -> None:
        self._slots[worker] = 0
