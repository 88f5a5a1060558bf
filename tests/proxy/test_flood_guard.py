"""The HTTP/2 abuse counters hold a limit per sliding window, not per fixed window (issue 28, item 3)."""

from __future__ import annotations

import pytest

from gatekeeper.proxy.listen.h2_limits import FloodError, FloodGuard


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def guard(limit: int = 10) -> tuple[FloodGuard, Clock]:
    clock = Clock()
    return FloodGuard({"ping": limit, "rst_stream": limit}, 10.0, clock=clock), clock


def test_a_burst_straddling_a_window_boundary_is_held_to_the_limit() -> None:
    """Fixed windows (the first at 0 s) let 9 PINGs at 9.9 s and 10 more at 10.1 s through: 19 in 0.2 s against a
    limit of 10."""
    g, clock = guard()
    g.count("ping")  # the first window starts here
    clock.now = 9.9
    for _ in range(9):
        g.count("ping")
    clock.now = 10.1
    with pytest.raises(FloodError, match="more than 10 ping frames in 10s"):
        g.count("ping")


def test_a_steady_rate_well_under_the_limit_never_trips_and_kinds_count_apart() -> None:
    """The estimate assumes the previous window's frames were spread evenly, so near the limit it may refuse a
    little early; the configured limits sit far above what clients send."""
    g, clock = guard()
    for i in range(200):  # 7 per 10 s, for 300 s
        clock.now = i * 1.5
        g.count("ping")
        g.count("rst_stream")


def test_the_previous_window_weighs_less_as_the_sliding_window_leaves_it() -> None:
    g, clock = guard()
    clock.now = 0.0
    for _ in range(10):
        g.count("ping")
    clock.now = 15.0  # half of the previous window is still inside the sliding one: 5 carried
    for _ in range(5):
        g.count("ping")
    with pytest.raises(FloodError):
        g.count("ping")


def test_after_a_quiet_window_nothing_carries_over() -> None:
    g, clock = guard()
    for _ in range(10):
        g.count("ping")
    clock.now = 25.0  # the window after the next: the burst is more than one interval ago
    for _ in range(10):
        g.count("ping")
    with pytest.raises(FloodError):
        g.count("ping")
