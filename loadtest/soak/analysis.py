"""What a soak's RSS samples say: where each process started, where it levelled off, and whether it still grows.

Pure functions over the samples (no I/O but the plot), so the short soak in the test suite and the long one in
``loadtest/reports/`` judge growth the same way: the least-squares slope of RSS against time over the last part of
the run, in MiB per minute. A plateau is the mean over the last third; the warm-up before it (connections, memos
and the allocator's pools filling) is what the first minutes show and is not growth.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Sample:
    """One process's memory at one moment of the soak."""

    minute: float
    """Minutes since the load started."""
    process: str
    """``parent``, ``worker-0``, ``worker-1``...: a restarted worker keeps its name."""
    pid: int
    rss: int
    """VmRSS, bytes."""
    anon: int
    """RssAnon, bytes: the heap, what a leak or the allocator grows (RssFile is the shared code)."""
    threads: int


def slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of ``(x, y)`` points (0.0 with fewer than two distinct x)."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def tail(points: Sequence[tuple[float, float]], fraction: float) -> list[tuple[float, float]]:
    """The points in the last ``fraction`` of the run's time span (by x, not by count)."""
    if not points:
        return []
    start, end = points[0][0], points[-1][0]
    cut = end - (end - start) * fraction
    return [p for p in points if p[0] >= cut]


def series(samples: Iterable[Sample], field: str = "rss") -> dict[str, list[tuple[float, float]]]:
    """Per process, then ``total`` (the sum at each minute every process was sampled), in MiB."""
    out: dict[str, list[tuple[float, float]]] = {}
    totals: dict[float, float] = {}
    for s in samples:
        value = getattr(s, field) / MIB
        out.setdefault(s.process, []).append((s.minute, value))
        totals[s.minute] = totals.get(s.minute, 0.0) + value
    for points in out.values():
        points.sort()
    out["total"] = sorted(totals.items())
    return out


@dataclass(frozen=True)
class Growth:
    """One process's (or the whole tree's) memory over a soak, in MiB and MiB per minute."""

    process: str
    start: float
    after_1: float
    plateau: float
    """Mean over the last third."""
    end: float
    slope_last_third: float
    slope_last_half: float


def _at(points: Sequence[tuple[float, float]], minute: float) -> float:
    return min(points, key=lambda p: abs(p[0] - minute))[1]


def growth(points: Sequence[tuple[float, float]], process: str) -> Growth:
    last = tail(points, 1 / 3)
    return Growth(process=process, start=points[0][1], after_1=_at(points, points[0][0] + 1),
                  plateau=sum(y for _, y in last) / len(last), end=points[-1][1],
                  slope_last_third=slope(last), slope_last_half=slope(tail(points, 1 / 2)))


def summarize(samples: Iterable[Sample], field: str = "rss") -> list[Growth]:
    """A :class:`Growth` per process and for ``total``, processes in name order, ``total`` last."""
    by = series(samples, field)
    return [growth(by[name], name) for name in sorted(by, key=lambda n: (n == "total", n)) if by[name]]


def worst_worker_slope(samples: Iterable[Sample], fraction: float = 0.5, field: str = "rss") -> tuple[str, float]:
    """The worker whose RSS grew fastest over the last ``fraction`` of the run, and that slope (MiB/min)."""
    by = series(samples, field)
    slopes = {name: slope(tail(points, fraction)) for name, points in by.items() if name.startswith("worker-")}
    if not slopes:
        raise ValueError("no worker was sampled")
    name = max(slopes, key=lambda n: slopes[n])
    return name, slopes[name]


def growth_table(rows: Sequence[Growth]) -> tuple[list[str], list[list[object]]]:
    """Header and rows for a report table."""
    header = ["process", "start MiB", "after 1 min", "plateau (mean, last third)", "end",
              "slope last third MiB/min", "slope last half MiB/min"]
    return header, [[g.process, f"{g.start:.1f}", f"{g.after_1:.1f}", f"{g.plateau:.1f}", f"{g.end:.1f}",
                     f"{g.slope_last_third:+.3f}", f"{g.slope_last_half:+.3f}"] for g in rows]
