"""list-storm-oom without a sandbox: own-load against failover kills, the verdicts, the limits' sweep and its plan.

The timings are the reviewed report's (issue 43): through HAProxy apiserver-2 died at 49.3 s and the other two at
49.8 s, each under its own LISTs; later apiserver-2, idle until its peers died, took 6 moved LISTs and died 2 s on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gatekeeper.sandbox.memlimit import MemoryCgroup
from loadtest.harness.rounds import apart_verdict, floor_verdict
from loadtest.scenarios.oom_kills import Kill, classify_kills, failover_possible, verdicts

A1, A2, A3 = "kube-apiserver-1", "kube-apiserver-2", "kube-apiserver-3"
SIMULTANEOUS = [(49.3, A2), (49.8, A1), (49.8, A3)]


def test_kills_within_a_second_of_each_other_are_each_their_own_load() -> None:
    kinds = [k.kind for k in classify_kills(SIMULTANEOUS, failover=True)]
    assert kinds == ["own-load"] * 3, "the old 'cascade' counted these"


def test_a_kill_after_a_peers_with_load_moved_onto_it_is_a_failover_kill() -> None:
    later = [*SIMULTANEOUS, (60.0, A1), (63.5, A2)]
    inflight = {A2: [(50.0, 0.0), (58.0, 0.0), (61.0, 6.0), (63.0, 6.0)], A1: [(45.0, 4.0), (55.0, 4.0)]}
    got = classify_kills(later, failover=True, inflight=inflight)
    assert got[-1] == Kill(63.5, A2, "failover", A1, "in flight rose")
    assert [k.kind for k in got[:3]] == ["own-load"] * 3
    # apiserver-1 at 60 s: 10 s after apiserver-3's kill, but its own requests in flight never rose
    assert got[3] == Kill(60.0, A1, "own-load")


def test_without_samples_the_timing_alone_tells_and_the_window_bounds_it() -> None:
    kills = [(10.0, A1), (14.0, A2), (60.0, A3)]
    got = classify_kills(kills, failover=True)
    assert got == [Kill(10.0, A1, "own-load"), Kill(14.0, A2, "failover", A1, "timing only"),
                   Kill(60.0, A3, "own-load")], "46 s after the last peer's kill is past the failover window"
    unsampled_window = {A2: [(1.0, 2.0), (20.0, 5.0)]}  # no sample between the peer's kill and its own
    assert classify_kills(kills, failover=True, inflight=unsampled_window)[1].evidence == "timing only"


def test_clients_pinned_to_one_apiserver_cannot_fail_over() -> None:
    kills = [(10.0, A1), (14.0, A2)]
    assert [k.kind for k in classify_kills(kills, failover=False)] == ["own-load", "own-load"]
    assert not failover_possible("direct") and failover_possible("haproxy") and failover_possible("gatekeeper")


def test_an_apiserver_killed_twice_is_not_its_own_failover() -> None:
    assert [k.kind for k in classify_kills([(10.0, A1), (14.0, A1)], failover=True)] == ["own-load"] * 2


def run(arm: str, limit_mib: int, kills: int, failover: int) -> dict[str, object]:
    return {"arm": arm, "limit": limit_mib << 20, "kills": [(float(i), A1) for i in range(kills)],
            "failover": failover}


def test_the_verdicts_come_from_fixed_thresholds_per_limit() -> None:
    results = [run("haproxy", 2560, 9, 2), run("gatekeeper", 2560, 0, 0), run("haproxy-kube-apf", 2560, 3, 1),
               run("direct", 2560, 15, 0),  # the reference without a balancer: no verdict of its own
               run("haproxy", 2560, 12, 1), run("gatekeeper", 2560, 1, 0), run("haproxy-kube-apf", 2560, 10, 0),
               run("haproxy", 1536, 14, 0), run("gatekeeper", 1536, 5, 1),
               run("informers-haproxy-list", 4096, 0, 0), run("informers-gatekeeper-list", 4096, 0, 0)]
    assert verdicts(results) == [
        "- at 1536 MiB, haproxy shows the seeds' cascade (>= 1 failover kill per run): **fails**: failover kills 0",
        "- at 1536 MiB, gatekeeper has no failover kill (<= 0 per run): **fails**: 1",
        "- at 1536 MiB, gatekeeper has fewer OOM kills than haproxy in every run: **holds**: 5 against 14",
        "- at 2560 MiB, haproxy shows the seeds' cascade (>= 1 failover kill per run): **holds**: failover kills "
        "1.5 [1-2]",
        "- at 2560 MiB, gatekeeper has no failover kill (<= 0 per run): **holds**: 0 [0-0]",
        "- at 2560 MiB, gatekeeper has fewer OOM kills than haproxy in every run: **holds**: 0.5 [0-1] "
        "against 10.5 [9-12]",
        "- at 2560 MiB, haproxy-kube-apf has fewer OOM kills than haproxy in every run: **not distinguished "
        "(the runs' ranges overlap)**: 6.5 [3-10] against 10.5 [9-12]",
        "- at 4096 MiB, informers-haproxy-list shows the seeds' cascade (>= 1 failover kill per run): **fails**: "
        "failover kills 0",
        "- at 4096 MiB, informers-gatekeeper-list has no failover kill (<= 0 per run): **holds**: 0",
        "- at 4096 MiB, informers-gatekeeper-list against informers-haproxy-list: no kill through HAProxy TCP at "
        "this limit, nothing to decrease",
    ]


def test_floor_and_apart_verdicts() -> None:
    assert floor_verdict([1, 3, 2], 1) == "holds" and floor_verdict([0, 0], 1) == "fails"
    assert floor_verdict([0, 2, 1], 1) == "not distinguished (2 of 3 runs keep it)"
    assert apart_verdict([0, 1], [2, 5]) == "holds" and apart_verdict([5, 6], [2, 5]) == "fails"
    assert apart_verdict([0, 3], [2, 5]) == "not distinguished (the runs' ranges overlap)"
    with pytest.raises(ValueError):
        apart_verdict([], [1])


def test_every_arm_runs_at_every_limit_once_per_round() -> None:
    from loadtest.scenarios.oom_storm import MEMORY_LIMITS, plan

    got = plan(["haproxy", "gatekeeper"], (1536 << 20, 4096 << 20), 3)
    assert len(got) == 12 and [g[0] for g in got] == [1] * 4 + [2] * 4 + [3] * 4
    assert got[:4] == [(1, 1536 << 20, "haproxy", "haproxy-1536Mi-r1"), (1, 1536 << 20, "gatekeeper",
                                                                          "gatekeeper-1536Mi-r1"),
                       (1, 4096 << 20, "haproxy", "haproxy-4096Mi-r1"), (1, 4096 << 20, "gatekeeper",
                                                                         "gatekeeper-4096Mi-r1")]
    assert plan(["haproxy"], (4 << 30,), 1) == [(1, 4 << 30, "haproxy", "haproxy")], "one limit: the old names"
    one_fits, two_fit, four_fit = (x / (1 << 30) for x in MEMORY_LIMITS)
    assert one_fits < 0.7 + 2 * 0.7 <= two_fit < 0.7 + 4 * 0.7 <= four_fit, "idle 0.7 GiB + 0.7 GiB per LIST"


def test_an_unknown_arm_is_named_before_any_sandbox_starts() -> None:
    from loadtest.harness.cluster import ScenarioError
    from loadtest.harness.run import RunContext
    from loadtest.scenarios import oom_storm

    with pytest.raises(ScenarioError, match="unknown arms informers-nowhere-list"):
        oom_storm.run(RunContext(out=Path("/nonexistent"), arms=("haproxy-kube-apf", "informers-nowhere-list")))
    assert "informers-haproxy-kube-apf-watch-list" in oom_storm.ALL_ARMS


def test_memory_limits_are_parsed_and_refused_by_other_scenarios(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from loadtest import cli

    assert cli.memory_limits("1536Mi, 2560Mi,4Gi") == (1536 << 20, 2560 << 20, 4 << 30)
    assert cli.memory_limits("") == ()
    assert cli.main(["skew", "--out", str(tmp_path), "--memory-limits", "2Gi"]) == 2
    assert "--memory-limits is taken by list-storm-oom only" in capsys.readouterr().err
    assert cli.main(["list-storm-oom", "--out", str(tmp_path), "--memory-limits", "2Gi,lots"]) == 2
    assert "expected a size" in capsys.readouterr().err


@pytest.mark.parametrize("version", [1, 2])
def test_a_cgroups_limit_is_changed_between_runs(tmp_path: Path, version: int) -> None:
    if version == 2:
        (tmp_path / "memory.max").write_text("max")
    else:
        (tmp_path / "memory.limit_in_bytes").write_text(str(2560 << 20))
        (tmp_path / "memory.memsw.limit_in_bytes").write_text(str(2560 << 20))
    group = MemoryCgroup(tmp_path, version)
    for limit in (4 << 30, 1536 << 20):
        group.set_limit(limit)
        files = ["memory.max"] if version == 2 else ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
        assert [(tmp_path / f).read_text() for f in files] == [str(limit)] * len(files)
