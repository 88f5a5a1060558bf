"""Per-request metric updates as plain Python arithmetic, handed to prometheus-client in batches.

prometheus-client locks (or writes an mmap) per update, and a request makes half a dozen. :func:`flush` runs
before every collection (:class:`_Flush` registers on import, ahead of the metrics), at most
:data:`FLUSH_SECONDS` after an update, and at exit; all on the loop's thread, so tally and flush never interleave.
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

FLUSH_SECONDS = 1.0
"""Longest time an update waits in a tally before it reaches prometheus-client."""

_dirty: list[CounterTally | HistogramTally] = []
_timer_loop: asyncio.AbstractEventLoop | None = None
"""The loop a timed flush is pending on, if any."""


def _mark(tally: CounterTally | HistogramTally) -> None:
    """First update since the last flush: remember the tally and make sure a flush comes."""
    global _timer_loop
    tally.dirty = True
    _dirty.append(tally)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no running loop (a synchronous caller): the next scrape or exit flushes
        return
    if _timer_loop is not loop:  # none pending, or pending on a loop that is gone (tests run one per test)
        _timer_loop = loop
        loop.call_later(FLUSH_SECONDS, _timed_flush, loop)


def _timed_flush(loop: asyncio.AbstractEventLoop) -> None:
    global _timer_loop
    if _timer_loop is loop:
        _timer_loop = None
    flush()


def flush() -> None:
    """Move every pending update into its prometheus-client child."""
    while _dirty:
        _dirty.pop()._flush()


class CounterTally:
    """A labelled counter child's pending increments."""

    __slots__ = ("child", "dirty", "pending")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.pending = 0.0
        self.dirty = False

    def inc(self, amount: float = 1.0) -> None:
        self.pending += amount
        if not self.dirty:
            _mark(self)

    def _flush(self) -> None:
        amount, self.pending, self.dirty = self.pending, 0.0, False
        if amount:
            self.child.inc(amount)


class HistogramTally:
    """A labelled histogram child's pending per-bucket counts and sum, bucketed as ``Histogram.observe`` does."""

    __slots__ = ("bounds", "child", "counts", "dirty", "total")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.bounds: list[float] = list(child._upper_bounds)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.dirty = False

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1
        self.total += amount
        if not self.dirty:
            _mark(self)

    def _flush(self) -> None:
        counts, total = self.counts, self.total
        self.counts, self.total, self.dirty = [0] * len(counts), 0.0, False
        child = self.child
        # The child's own value cells (one per bucket, non-cumulative, plus the sum): what observe() adds to.
        child._sum.inc(total)
        for cell, n in zip(child._buckets, counts, strict=True):
            if n:
                cell.inc(n)


class _Flush(Collector):
    """Registered first, so every collection of the default registry sees every update made before it."""

    def collect(self) -> Iterator[Metric]:
        flush()
        return iter(())


REGISTRY.register(_Flush())
atexit.register(flush)
