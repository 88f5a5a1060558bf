"""Per-request metric updates as plain Python arithmetic, handed to prometheus-client in batches.

Why: every ``Counter.inc`` and ``Histogram.observe`` of prometheus-client takes
a lock (``MutexValue``, or an mmap write in multiprocess mode), and a histogram
walks its bucket bounds one by one; a proxied request makes half a dozen of
them. Here the hot path adds to an integer (:class:`CounterTally`) or to one
bucket found by ``bisect`` (:class:`HistogramTally`), and :func:`flush` moves
the totals into the ordinary labelled children, whose names, labels, buckets
and exposition stay exactly what they were.

When the totals move:

* before every collection of the default registry: :class:`_Flush` is
  registered on ``REGISTRY`` when this module is imported, before the metrics
  that use tallies are defined, so it runs ahead of them on every scrape (the
  single-process page, a worker's ``/metrics/worker`` page, and so also the
  supervisor's merged page, which fetches the workers' pages before it reads
  the multiprocess files);
* at most :data:`FLUSH_SECONDS` after the first update since the last flush
  (one event-loop timer, so multiprocess files are never far behind even if no
  one scrapes), and at interpreter exit.

Everything runs on the event loop's thread (the scrape handlers too), so a
tally and its flush never interleave.
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
    """A labelled histogram child's pending observations: per-bucket counts and their sum.

    A value lands in the first bucket whose upper bound is >= it, as in
    ``Histogram.observe`` (``bisect_left`` over the same bounds, ``+Inf`` last).
    """

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
