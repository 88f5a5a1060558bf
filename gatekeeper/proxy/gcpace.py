"""A full garbage collection on a timer, so memory in reference cycles goes back within seconds, not hours.

Why: ``tune_gc`` freezes startup's objects and raises the young threshold (``gcYoungThreshold``) to save CPU per
request. Python then runs a full (generation 2) collection only after ten middle ones, each after ten young ones,
each after ``gcYoungThreshold`` net new container objects, and only once the objects waiting are a quarter of the
long-lived ones: at the soak's load (issue 46) that was not once in ten minutes. Whatever a closed TLS connection
left in a cycle (a transport, its protocol, their TLS buffers of up to 256 KiB) waited there, and a worker's RSS grew
by tens of MiB an hour. A full collection of a worker's heap (startup frozen, so only what serving built) takes
milliseconds: every ``gcFullIntervalSeconds`` (60) it bounds that memory by what one interval of closed connections
leaves, whatever cycle a future change adds. Off the request path: a timer on the event loop.

With the cycles of closed connections fixed (tests/proxy/test_connection_cycles.py), what still grew was glibc's
free memory (freed, not given back: 2.4 -> 5.7 MiB per worker in 8 minutes of the soak, in-use flat), so each tick
also calls ``malloc_trim(0)``, which returns free pages from every arena (docs/proxy/memory.md has the numbers).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import time
from collections.abc import Callable

from prometheus_client import Counter

FULL_COLLECTIONS = Counter(
    "gatekeeper_proxy_gc_full_collections_total",
    "Full garbage collections the proxy ran on its timer (gcFullIntervalSeconds).",
)
COLLECTED = Counter(
    "gatekeeper_proxy_gc_full_collected_objects_total",
    "Unreachable objects (reference cycles) the timed full collections freed.",
)
SECONDS = Counter(
    "gatekeeper_proxy_gc_full_seconds_total",
    "Time the timed full collections (and malloc_trim) held the event loop, in seconds.",
)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere, e.g. musl)."""
    with contextlib.suppress(OSError, AttributeError):
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
        return trim
    return None


_TRIM = _malloc_trim()


class FullCollections:
    """Runs ``gc.collect()`` and glibc's ``malloc_trim(0)`` every ``interval`` seconds on the running loop until
    :meth:`stop`."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self.interval > 0:
            self._handle = asyncio.get_running_loop().call_later(self.interval, self._tick)

    def _tick(self) -> None:
        started = time.perf_counter()
        found = gc.collect()
        if _TRIM is not None:
            _TRIM(0)  # hand glibc's free pages back: what a burst of large buffers freed is not RSS for good
        SECONDS.inc(time.perf_counter() - started)
        FULL_COLLECTIONS.inc()
        COLLECTED.inc(found)
        self._handle = asyncio.get_running_loop().call_later(self.interval, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
