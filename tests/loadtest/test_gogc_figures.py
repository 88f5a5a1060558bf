"""gogc's window arithmetic and verdicts on made-up samples: the report's words must follow its numbers."""

from __future__ import annotations

import math

from loadtest.scenarios.gogc_figures import (
    MIB,
    Spread,
    gauge_sum,
    growth_verdict,
    lower_memory_verdict,
    rate_sum,
    restart_verdict,
    slope_per_min,
)


def test_gauges_average_per_apiserver_inside_the_window_then_sum() -> None:
    series = {"kube-apiserver-1": [(0.0, 1000.0), (10.0, 100.0), (11.0, 300.0), (30.0, 1000.0)],
              "kube-apiserver-2": [(10.5, 50.0), (12.0, 50.0)]}
    assert gauge_sum(series, 10, 20) == 200 + 50
    assert math.isnan(gauge_sum(series, 20, 25))  # apiserver 2 has no sample there: no partial sum


def test_counters_become_rates_per_apiserver_never_across_the_window_edges() -> None:
    series = {"a": [(0.0, 0.0), (10.0, 100.0), (20.0, 130.0), (40.0, 1000.0)],
              "b": [(11.0, 5.0), (16.0, 10.0)]}
    assert rate_sum(series, 10, 20) == 3.0 + 1.0
    assert math.isnan(rate_sum(series, 30, 50))  # one sample of each at most


def test_slope_is_per_minute_and_flat_data_has_none() -> None:
    assert slope_per_min([(0.0, 0.0), (30.0, 15.0), (60.0, 30.0)]) == 30.0
    assert slope_per_min([(0.0, 7.0), (1.0, 7.0), (2.0, 7.0)]) == 0.0
    assert math.isnan(slope_per_min([(0.0, 1.0), (1.0, 2.0)]))


def test_lower_needs_the_median_lower_and_the_ranges_apart() -> None:
    assert Spread.of([1, 2, 3]).below(Spread.of([4, 5, 6]))
    assert not Spread.of([1, 2, 5]).below(Spread.of([4, 5, 6]))
    assert Spread.of([3, float("nan"), 1]) == Spread(2, 1, 3, 2)
    assert Spread.of([2.4, -3.1, 1.6]).fmt(0, "%") == "2% (-3 to 2)"


def test_restart_verdict_follows_every_run() -> None:
    assert restart_verdict([0.2, 0.3, 0.4]).word == "reproduced"
    assert restart_verdict([0.2, 0.05, 0.4]).word == "not reproduced"
    assert restart_verdict([-0.2, -0.15, -0.3]).word == "contradicted"


def test_memory_verdict_can_say_contradicted() -> None:
    a = [1000 * MIB, 1010 * MIB, 990 * MIB]
    assert lower_memory_verdict(a, [900 * MIB, 910 * MIB, 920 * MIB]).word == "reproduced"
    assert lower_memory_verdict(a, [1100 * MIB, 1120 * MIB, 1090 * MIB]).word == "contradicted"
    assert lower_memory_verdict(a, [985 * MIB, 1000 * MIB, 1050 * MIB]).word == "not reproduced"


def test_growth_verdict_needs_gogc_100_to_grow_first() -> None:
    assert growth_verdict([0.5, 5.0, 6.0], [0.0, 0.1, 0.2]).word == "not reproduced"
    assert growth_verdict([5.0, 6.0, 7.0], [0.0, 1.0, -2.0]).word == "reproduced"
    assert growth_verdict([5.0, 6.0, 7.0], [9.0, 10.0, 12.0]).word == "contradicted"
    assert growth_verdict([0.5, 1.0, 3.0], [9.0, 10.0, 12.0]).word == "contradicted"  # 50 grows: no stop
    assert growth_verdict([5.0, 6.0, 7.0], [1.0, 4.0, 6.5]).word == "not reproduced"
    nan = float("nan")
    assert "no slope" in growth_verdict([5.0, 6.0, 7.0], [nan, nan, nan]).why
