"""dra-scale's pure parts: the plan from --scale, the interleaved order, median [min-max], the quiet-window
minimum and the verdict on the webhook's ``gpu.kep5004`` default."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from loadtest.scenarios import dra_report, dra_scale
from loadtest.scenarios.dra_report import ARMS


def test_every_arm_runs_in_turn_not_one_after_the_other() -> None:
    names = [f"{a.name}#{k}" for a, k in dra_scale.order(ARMS, 3)]
    assert names == [f"{a}#{k}" for k in (1, 2, 3) for a in ("device-plugin", "dra-webhook", "dra-kep5004")]
    assert names[:3] == ["device-plugin#1", "dra-webhook#1", "dra-kep5004#1"]


def test_plan_keeps_three_runs_and_one_ramp_rate_for_every_arm() -> None:
    full = dra_scale.plan(1.0)
    assert full["runs"] == 3 and full["total"] == 1000 and full["rate"] == 20.0 and full["quiet"] == 30.0
    assert full["total"] / full["rate"] == 50  # the ramp lasts 50 s
    assert dra_scale.plan(2.0)["rate"] == 40.0 and dra_scale.plan(2.0)["quiet"] == 30.0
    tiny = dra_scale.plan(0.02)
    assert tiny["rate"] == dra_scale.MIN_RATE and tiny["runs"] == 2 and tiny["quiet"] == 6.0
    assert all(dra_scale.plan(s)["users"] >= dra_scale.plan(s)["rate"] * 3 for s in (0.02, 0.5, 1.0))


def test_qps_bounds_are_lifted_for_both_clients() -> None:
    assert dra_scale.QPS_ARGS == ("--kube-api-qps=500", "--kube-api-burst=1000")


def test_spread_is_the_median_with_min_and_max() -> None:
    assert dra_report.spread([3.0, 1.0, 2.0]) == "2 [1-3]"
    assert dra_report.spread([2 << 20, 4 << 20], scale=1 << 20) == "3 [2-4]"
    assert dra_report.spread([5.0]) == "5"
    assert dra_report.spread([math.nan, 1.0, 3.0]) == "2 [1-3]"
    assert dra_report.spread([math.nan]) == "n/a"


def test_window_min_takes_only_samples_inside_the_quiet_window() -> None:
    points = [(0.0, 50.0), (1.0, 900.0), (2.0, 700.0), (3.0, 600.0), (4.0, 650.0), (5.0, 10.0)]
    sampler: Any = SimpleNamespace(summed=lambda component, column: points)
    assert dra_report.window_min(sampler, "kube-scheduler", "heap_bytes", 1.5, 4.0) == 600.0
    assert math.isnan(dra_report.window_min(sampler, "kube-scheduler", "heap_bytes", 10.0, 20.0))


def test_kep5004_verdict_needs_more_than_the_run_to_run_noise() -> None:
    assert dra_report.kep5004_verdict(300.0, 100.0).startswith("supports `rewrite`")
    assert dra_report.kep5004_verdict(50.0, 100.0).startswith("contradicts `rewrite`")
    assert dra_report.kep5004_verdict(105.0, 100.0).startswith("shows no difference")
    assert dra_report.kep5004_verdict(math.nan, 100.0).startswith("cannot say")


def test_dra_arms_are_judged_over_every_run_not_by_a_ratio_of_medians() -> None:
    from loadtest.harness.rounds import compare
    from loadtest.scenarios.dra_report import range_verdicts

    mib, ms = 1 << 20, 1e-3

    def run(sched: float, api: float, p50: float) -> dict[str, float]:
        return {"sched_quiet": sched * mib, "api_quiet": api * mib, "p50": p50 * ms}

    by_arm = {"dra-webhook": [run(124, 537, 220), run(120, 530, 300), run(126, 540, 200)],
              "dra-kep5004": [run(131, 523, 277), run(135, 500, 190), run(130, 520, 350)],
              "device-plugin": [run(96, 444, 9), run(95, 450, 10), run(97, 440, 8)]}
    lines = range_verdicts(by_arm, [("dra-webhook", "device-plugin"), ("dra-kep5004", "dra-webhook")])
    assert lines[0] == ("- scheduler RSS (quiet), dra-webhook against device-plugin: **higher** "
                        "(124 [120-126] vs 96 [95-97] MiB)")
    assert lines[3] == "- scheduler RSS (quiet), dra-kep5004 against dra-webhook: **higher** (131 [130-135] vs " \
                       "124 [120-126] MiB)"
    assert lines[5] == ("- scheduling latency p50, dra-kep5004 against dra-webhook: **not distinguished (the runs' "
                        "ranges overlap)** (277 [190-350] vs 220 [200-300] ms)"), "p50 x1.26 of medians, runs overlap"
    assert compare([1.0], [2.0]) == "lower" and compare([], [1.0]).startswith("not distinguished")
