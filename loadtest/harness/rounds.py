"""Arms run interleaved over rounds, and judged by their range, not by one run.

On a shared 2-core machine one run per arm is noise: the load average moves between arms, and an arm run
last meets a warmer page cache. Running the arms as A B C, A B C, ... spreads that drift over all of them,
and a verdict that needs every run to keep a bound cannot be won by one lucky run.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def interleave(arms: Sequence[T], runs: int) -> list[tuple[int, T]]:
    """``(round, arm)`` in the order to run them: every arm once per round, rounds one after another. An arm may be
    any value, e.g. ``(memory limit, arm)``: every combination then runs once per round."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    return [(r, arm) for r in range(1, runs + 1) for arm in arms]


def run_label(arm: str, round_: int, runs: int) -> str:
    """A run's name in files and tables: the arm's own when it runs once (the checked-in reports' names)."""
    return arm if runs == 1 else f"{arm}-r{round_}"


@dataclass(frozen=True)
class Spread:
    """Median and range of one figure over an arm's runs."""

    median: float
    low: float
    high: float
    runs: int

    def show(self, fmt: str = ".2f", prefix: str = "") -> str:
        if self.runs == 1:
            return f"{prefix}{self.median:{fmt}}"
        return f"{prefix}{self.median:{fmt}} [{self.low:{fmt}}-{self.high:{fmt}}]"


def spread(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("no runs to summarise")
    return Spread(statistics.median(values), min(values), max(values), len(values))


def bound_verdict(values: Sequence[float], bound: float) -> str:
    """``holds`` when every run is at most ``bound``, ``fails`` when none is, else how many of the runs are."""
    if not values:
        raise ValueError("no runs to judge")
    keep = sum(1 for v in values if v <= bound)
    if keep == len(values):
        return "holds"
    if keep == 0:
        return "fails"
    return f"not distinguished ({keep} of {len(values)} runs keep it)"


def floor_verdict(values: Sequence[float], floor: float) -> str:
    """``holds`` when every run reaches ``floor`` (something happens every time), ``fails`` when none does."""
    return bound_verdict([-v for v in values], -floor)


def apart_verdict(lower: Sequence[float], higher: Sequence[float]) -> str:
    """``holds`` when every run of ``lower`` is below every run of ``higher``, ``fails`` when every run of ``lower``
    is at or above every run of ``higher``; ranges that overlap are ``not distinguished``."""
    if not lower or not higher:
        raise ValueError("no runs to compare")
    if max(lower) < min(higher):
        return "holds"
    if min(lower) >= max(higher):
        return "fails"
    return "not distinguished (the runs' ranges overlap)"


def compare(values: Sequence[float], against: Sequence[float]) -> str:
    """``lower`` or ``higher`` when every run of ``values`` is below (above) every run of ``against``, else ``not
    distinguished`` (the ranges overlap, or there is no run to compare)."""
    if values and against and max(values) < min(against):
        return "lower"
    if values and against and min(values) > max(against):
        return "higher"
    return "not distinguished (the runs' ranges overlap)"
