"""gogc's arithmetic, kept apart from the sandbox so that it can be checked on made-up samples.

Figures come from one window per apiserver life: ``[start + warm-up, start + warm-up + window]``, in the
sampler's seconds. Gauges (RSS, heap) are averaged per apiserver and the averages summed; counters (CPU
seconds, GC cycles, requests) become a rate per apiserver (last minus first sample over the time between
them) and the rates are summed. Per apiserver first, because the /proc and /metrics ticks of the three
apiservers do not fall at the same instants, and a counter must never be differenced across a restart.

The verdicts are computed here from the runs' figures and the thresholds below, never written by hand: the
report must say "contradicted" when the numbers do, whatever was expected.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Series = dict[str, list[tuple[float, float]]]
"""Per component (e.g. ``kube-apiserver-2``): [(seconds, value)], as ``Sampler.series`` returns them."""

MIB = 1 << 20

FREED_MIN = 0.10
"""A restart "frees memory" when every run's equal-load RSS after it is at least 10 % below the RSS before."""
GROWTH_MIN = 2.0
"""An arm "grows" when every run's RSS slope over the measured window exceeds 2 % of its mean RSS per minute;
it is "flat" when no run's does. GC sawtooth on a window of tens of seconds moves a slope by a few %/min."""


@dataclass(frozen=True)
class Spread:
    """Median and range of one figure over an arm's runs."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        vs = [v for v in values if v == v]  # NaN (a figure a run could not measure) is left out, and n says so
        if not vs:
            return cls(float("nan"), float("nan"), float("nan"), 0)
        return cls(statistics.median(vs), min(vs), max(vs), len(vs))

    def fmt(self, digits: int = 0, unit: str = "") -> str:
        return f"{self.median:.{digits}f}{unit} ({self.low:.{digits}f} to {self.high:.{digits}f})"

    def below(self, other: Spread) -> bool:
        """Lower beyond run-to-run noise: the median is lower and the ranges do not overlap."""
        return self.median < other.median and self.high < other.low


def in_window(points: Sequence[tuple[float, float]], t0: float, t1: float) -> list[tuple[float, float]]:
    return [(t, v) for t, v in points if t0 <= t <= t1]


def gauge_sum(series: Series, t0: float, t1: float) -> float:
    """Sum over components of each one's mean in [t0, t1]; NaN if any component has no sample there."""
    total = 0.0
    for points in series.values():
        inside = in_window(points, t0, t1)
        if not inside:
            return float("nan")
        total += sum(v for _, v in inside) / len(inside)
    return total if series else float("nan")


def rate_sum(series: Series, t0: float, t1: float) -> float:
    """Sum over components of each counter's rate per second in [t0, t1]; NaN without two samples each."""
    total = 0.0
    for points in series.values():
        inside = in_window(points, t0, t1)
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return float("nan")
        total += (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
    return total if series else float("nan")


def slope_per_min(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, in value per minute (NaN for fewer than 3 points)."""
    if len(points) < 3:
        return float("nan")
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / den * 60 if den else float("nan")


@dataclass(frozen=True)
class Verdict:
    word: str
    """``reproduced``, ``not reproduced`` or ``contradicted``."""
    why: str

    def __str__(self) -> str:
        return f"**{self.word}**: {self.why}"


def restart_verdict(freed: Sequence[float]) -> Verdict:
    """"A restart frees up to 40 %", judged at equal load and equal warm-up (``freed``: fractions per run)."""
    s = Spread.of([f * 100 for f in freed])
    shown = f"a restart frees {s.fmt(0, '%')} over {s.n} runs"
    if s.n and s.low >= FREED_MIN * 100:
        return Verdict("reproduced", f"{shown}, every run at least {FREED_MIN:.0%}")
    if s.n and s.high <= -FREED_MIN * 100:
        return Verdict("contradicted", f"{shown}: the restarted apiservers hold more memory at the same load")
    return Verdict("not reproduced", f"{shown}, not every run {FREED_MIN:.0%} or more: at equal load and warm-up "
                   "the restarted apiservers settle where the old ones were (the seed's ran for days, ours for "
                   "minutes, so a slow leak would not show here)")


def lower_memory_verdict(rss100: Sequence[float], rss50: Sequence[float]) -> Verdict:
    """"GOGC 50 lowers memory": lower beyond noise (median lower, ranges apart), on RSS per run."""
    a, b = Spread.of([v / MIB for v in rss100]), Spread.of([v / MIB for v in rss50])
    shown = f"RSS {b.fmt(0)} MiB with GOGC=50 against {a.fmt(0)} MiB with GOGC=100"
    if b.below(a):
        return Verdict("reproduced", f"{shown}: lower, ranges apart")
    if a.below(b):
        return Verdict("contradicted", f"{shown}: higher, ranges apart")
    return Verdict("not reproduced", f"{shown}: the ranges overlap, the difference is within run-to-run spread")


def growth_verdict(growth100: Sequence[float], growth50: Sequence[float]) -> Verdict:
    """"GOGC 50 stops growth over time" (``growth``: RSS slope per run in % of its mean RSS per minute)."""
    a, b = Spread.of(growth100), Spread.of(growth50)
    shown = f"RSS slope {a.fmt(1, ' %/min')} with GOGC=100, {b.fmt(1, ' %/min')} with GOGC=50"
    if not a.n or not b.n:
        return Verdict("not reproduced", f"{shown}: no slope in some arm (fewer than 3 samples in its window)")
    shown += f", over {a.n} and {b.n} runs"
    grows100 = a.n > 0 and a.low > GROWTH_MIN
    grows50 = b.n > 0 and b.low > GROWTH_MIN
    flat50 = b.n > 0 and b.high <= GROWTH_MIN
    if grows50:
        return Verdict("contradicted", f"{shown}: GOGC=50 grows by more than {GROWTH_MIN:g} %/min in every run")
    if not grows100:
        return Verdict("not reproduced", f"{shown}: GOGC=100 does not grow by more than {GROWTH_MIN:g} %/min in "
                       "every run at a constant object count, so there is no growth for GOGC 50 to stop")
    if flat50:
        return Verdict("reproduced", f"{shown}: GOGC=100 grows in every run, GOGC=50 in none")
    return Verdict("not reproduced", f"{shown}: GOGC=50 grows too in some runs")
