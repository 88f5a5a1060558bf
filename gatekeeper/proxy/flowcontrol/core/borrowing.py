"""Seat borrowing between priority levels, as upstream APF (``apf_controller.go``) does it; pure, time passed in.

Formulas: docs/flowcontrol/seats.md#borrowing. The total never exceeds the nominal total. Exempt levels take no
part (upstream also counts their demand against the others).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gatekeeper.proxy.flowcontrol.core.objects import PriorityLevel

SMOOTHING = 0.977
"""Upstream's seatDemandSmoothingCoefficient."""
MIN_TARGET = 0.001
"""A zero target is treated as this (upstream's MinTarget), so every level keeps a share of fairFrac."""


def go_round(x: float) -> int:
    """Go's math.Round (half away from zero): Python's round() rounds half to even, unlike upstream."""
    return math.floor(x + 0.5)


@dataclass(frozen=True)
class Bounds:
    nominal: int
    lower: int
    """minCL: nominal minus what the level may lend."""
    upper: int
    """maxCL: nominal plus what the level may borrow."""


def bounds_of(spec: PriorityLevel, nominal: int, server_concurrency_limit: int) -> Bounds:
    lendable = go_round(nominal * spec.lendable_percent / 100)
    if spec.borrowing_limit_percent is None:
        borrowing = server_concurrency_limit
    else:
        borrowing = go_round(nominal * spec.borrowing_limit_percent / 100)
    return Bounds(nominal, nominal - lendable, nominal + borrowing)


class DemandIntegrator:
    """Time-weighted mean, deviation and maximum of a level's seat demand over one period."""

    def __init__(self, now: float = 0.0, value: float = 0.0) -> None:
        self.reset(now, value)

    def reset(self, now: float, value: float | None = None) -> None:
        self.start = self.last = now
        if value is not None:
            self.value = value
        self.area = self.area2 = 0.0
        self.max = self.value

    def set(self, value: float, now: float) -> None:
        if now > self.last:
            dt = now - self.last
            self.area += self.value * dt
            self.area2 += self.value * self.value * dt
            self.last = now
        self.value = value
        if value > self.max:
            self.max = value

    def results(self, now: float) -> tuple[float, float, float, float]:
        """(average, standard deviation, high watermark, duration) up to ``now``."""
        self.set(self.value, now)
        duration = self.last - self.start
        if duration <= 0:
            return self.value, 0.0, self.max, 0.0
        avg = self.area / duration
        var = max(0.0, self.area2 / duration - avg * avg)
        return avg, math.sqrt(var), self.max, duration


@dataclass
class DemandStats:
    """A level's seat-demand statistics after the last adjustment (upstream's seatDemandStats)."""

    avg: float = 0.0
    stddev: float = 0.0
    high_watermark: float = 0.0
    smoothed: float = 0.0

    def update(self, avg: float, stddev: float, high: float, duration: float) -> None:
        self.high_watermark = high
        if duration <= 0:
            return
        self.avg, self.stddev = avg, stddev
        envelope = avg + stddev
        self.smoothed = max(envelope, SMOOTHING * self.smoothed + (1 - SMOOTHING) * envelope)


@dataclass(frozen=True)
class Item:
    """One level in the allocation problem."""

    target: float
    lower: float
    upper: float


def allocate(required: float, items: Sequence[Item]) -> tuple[list[float], float]:
    """The allocations (summing to ``required``) and fairFrac, as upstream's computeConcurrencyAllocation, by
    bisection. Raises ValueError for ``upper < lower`` or ``lower < 0``."""
    for it in items:
        if it.lower < 0 or it.upper < it.lower:
            raise ValueError(f"bad allocation bounds {it}")
    if not items:
        return [], 0.0
    targets = [max(MIN_TARGET, it.target) for it in items]

    def total(frac: float) -> float:
        return sum(min(it.upper, max(it.lower, frac * t)) for it, t in zip(items, targets, strict=True))

    lo = min(it.lower / t for it, t in zip(items, targets, strict=True))
    hi = max(it.upper / t for it, t in zip(items, targets, strict=True))
    if total(lo) >= required:
        frac = lo
    elif total(hi) <= required:
        frac = hi
    else:
        for _ in range(200):
            mid = (lo + hi) / 2
            if total(mid) < required:
                lo = mid
            else:
                hi = mid
            if hi - lo <= 1e-12 * max(1.0, hi):
                break
        frac = (lo + hi) / 2
    return [min(it.upper, max(it.lower, frac * t)) for it, t in zip(items, targets, strict=True)], frac


def item_for(bounds: Bounds, stats: DemandStats) -> Item:
    lower = max(bounds.lower, min(bounds.nominal, stats.high_watermark))
    return Item(target=max(lower, stats.smoothed), lower=lower, upper=bounds.upper)
