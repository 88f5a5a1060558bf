"""The scenario maths and plumbing that need no sandbox: shares, balance time, flag swapping, /proc, CLI."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gatekeeper.sandbox.state import SandboxState
from loadtest.harness import sockets
from loadtest.harness.cluster import with_flags
from loadtest.harness.sampler import Sampler, proc_figures
from loadtest.scenarios.dra_report import histogram_quantile, quantile
from loadtest.scenarios.skew import shares, time_to_balance

REPO = Path(__file__).resolve().parents[2]


def sampler_with(counters: dict[str, list[float]]) -> Sampler:
    s = Sampler(SandboxState(dir="/nonexistent"), "arm")
    for name, values in counters.items():
        for t, v in enumerate(values):
            s.rows.append({"arm": "arm", "t": float(t), "component": name, "rss_bytes": 1, "cpu_seconds": 0,
                           "heap_bytes": 0, "requests": v})
    return s


def test_shares_follow_each_apiservers_own_counter_across_a_restart() -> None:
    # apiserver 2 restarts at t=5 (its counter starts again from 0) and then takes an equal part
    s = sampler_with({
        "kube-apiserver-1": [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100],
        "kube-apiserver-2": [0, 10, 20, 30, 40, 0, 10, 20, 30, 40, 50],
        "kube-apiserver-3": [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100],
    })
    sh = shares(s, window=2.0)
    for i in range(len(sh["kube-apiserver-1"])):
        assert abs(sum(sh[n][i][1] for n in sh) - 1.0) < 1e-9
    last = {n: pts[-1][1] for n, pts in sh.items()}
    assert all(abs(v - 1 / 3) < 1e-9 for v in last.values()), last


def test_balance_time_is_none_while_one_apiserver_gets_nothing_and_counts_from_the_restart() -> None:
    idle = sampler_with({"kube-apiserver-1": [0, 10, 20, 30, 40, 50], "kube-apiserver-2": [0, 0, 0, 0, 0, 0],
                         "kube-apiserver-3": [0, 10, 20, 30, 40, 50]})
    assert time_to_balance(shares(idle, 2.0), since=0.0) is None
    healing = sampler_with({"kube-apiserver-1": [0, 10, 20, 30, 40, 50, 60, 70, 80, 90],
                            "kube-apiserver-2": [0, 0, 0, 0, 10, 20, 30, 40, 50, 60],
                            "kube-apiserver-3": [0, 10, 20, 30, 40, 50, 60, 70, 80, 90]})
    took = time_to_balance(shares(healing, 2.0), since=1.0, hold=3)
    assert took is not None and 3.0 <= took <= 5.0, took


def test_restart_flags_replace_earlier_values_of_the_same_flag() -> None:
    cmd = ["kube-apiserver", "--goaway-chance=0.001", "--secure-port=1"]
    assert with_flags(cmd, ["--goaway-chance=0"]) == ["kube-apiserver", "--secure-port=1", "--goaway-chance=0"]


def test_proc_figures_read_rss_and_cpu_of_a_live_process_and_none_for_a_dead_one() -> None:
    rss, cpu = proc_figures(os.getpid()) or (0, -1.0)
    assert rss > 10 * 1024 * 1024 and cpu > 0
    assert proc_figures(2**22 + 12345) is None


def test_gatekeeper_loadtest_hands_every_argument_to_the_loadtest_parser() -> None:
    p = subprocess.run([sys.executable, "-m", "gatekeeper", "loadtest", "--help"], capture_output=True,
                       text=True, cwd="/", timeout=60)
    assert p.returncode == 0, p.stderr
    assert "list-storm" in p.stdout and "--scale" in p.stdout
    bad = subprocess.run([sys.executable, "-m", "loadtest", "list-storm", "--out", "/tmp/x", "--scale", "0"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert bad.returncode == 2 and "--scale" in bad.stderr


def test_latency_quantiles_are_nearest_rank_and_histogram_quantiles_are_bucket_upper_bounds() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (quantile(values, 0.5), quantile(values, 0.99), quantile(values, 1.0)) == (50.0, 99.0, 100.0)
    assert quantile([7.0], 0.99) == 7.0 and math.isnan(quantile([], 0.5))
    cumulative = {0.001: 1.0, 0.01: 50.0, 0.1: 99.0, math.inf: 100.0}
    assert histogram_quantile(cumulative, 0.5) == 0.01
    assert histogram_quantile(cumulative, 0.99) == 0.1
    assert histogram_quantile(cumulative, 1.0) == math.inf
    assert math.isnan(histogram_quantile({}, 0.5))


def test_all_gives_every_scenario_a_scale_share() -> None:
    from loadtest.cli import ALL_SCALES, SCENARIOS

    assert set(ALL_SCALES) == set(SCENARIOS)
    assert all(0 < v <= 1 for v in ALL_SCALES.values())


def test_apf_dump_gives_the_executing_requests_of_one_priority_level() -> None:
    from loadtest.harness.cluster import kit

    apf_executing = kit.apf_executing

    dump = ("PriorityLevelName, ActiveQueues, IsIdle, IsQuiescing, WaitingRequests, ExecutingRequests, "
            "DispatchedRequests\n"
            "catch-all,         0,            true,   false,       0,               0,                 0\n"
            "fc-storm-observe,  2,            false,  false,       1,               3,                 479\n")
    assert apf_executing(dump, "fc-storm-observe") == 3
    assert apf_executing(dump, "catch-all") == 0
    assert apf_executing(dump, "missing") is None
    assert apf_executing("forbidden", "catch-all") is None


def test_oom_kills_are_read_from_the_supervisors_events_and_their_downtime_counted() -> None:
    from loadtest.scenarios.oom_kills import downtime, kills_between, several_killed

    events = [
        {"time": 90.0, "component": "kube-apiserver-1", "event": "oom_kill"},  # an earlier arm's
        {"time": 95.0, "component": "kube-apiserver-1", "event": "restart"},
        {"time": 110.0, "component": "kube-apiserver-2", "event": "oom_kill"},
        {"time": 120.0, "component": "kube-apiserver-2", "event": "restart"},
        {"time": 125.0, "component": "kube-apiserver-1", "event": "oom_kill"},
        {"time": 130.0, "component": "kube-apiserver-3", "event": "oom_kill"},
        {"time": 135.0, "component": "kube-apiserver-2", "event": "oom_kill"},
        {"time": 140.0, "component": "kube-apiserver-1", "event": "restart"},
    ]
    kills = kills_between(events, 100.0, 150.0)
    assert kills == [(10.0, "kube-apiserver-2"), (25.0, "kube-apiserver-1"), (30.0, "kube-apiserver-3"),
                     (35.0, "kube-apiserver-2")]
    assert several_killed(kills) and not several_killed(kills[:1]) and not several_killed([(1.0, "a"), (9.0, "a")])
    names = ["kube-apiserver-1", "kube-apiserver-2", "kube-apiserver-3"]
    per, together = downtime(events, names, 100.0, 150.0)
    assert per == {"kube-apiserver-1": 15.0, "kube-apiserver-2": 25.0, "kube-apiserver-3": 20.0}
    assert together == 5.0  # 135-140: all three down
    later = [*events, {"time": 149.0, "component": "kube-apiserver-1", "event": "oom_kill"}]  # never restarted
    per, _ = downtime(later, names, 160.0, 200.0)
    assert per == dict.fromkeys(names, 0.0), "an earlier arm's kill is not this arm's downtime"


def test_a_report_is_refused_from_a_changed_tree_unless_allowed_and_then_says_so(tmp_path: Path) -> None:
    from loadtest.harness.report import provenance

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    clean = provenance(False, repo=tmp_path)
    assert re.fullmatch(r"[0-9a-f]{40}", clean["git commit"]) and clean["tree"] == "clean"
    (tmp_path / "a.py").write_text("x = 2\n")
    with pytest.raises(ValueError, match=r"changes \(a\.py\)"):
        provenance(False, repo=tmp_path)
    assert provenance(True, repo=tmp_path)["tree"].startswith("DIRTY: 1 changed")


def test_a_fronts_connections_are_counted_per_apiserver_port_from_proc() -> None:
    import socket

    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    ports = [srv.getsockname()[1] for srv in servers]
    me = os.getpgid(0)
    assert sockets.listener_group(ports[0]) == me
    assert sockets.connections_to(me, ports) == {ports[0]: 0, ports[1]: 0}
    clients = [socket.create_connection(("127.0.0.1", ports[0])) for _ in range(2)]
    clients.append(socket.create_connection(("127.0.0.1", ports[1])))
    try:
        # the accepted ends are ours too but their remote port is the client's: only the clients count
        assert sockets.connections_to(me, ports) == {ports[0]: 2, ports[1]: 1}
        assert sockets.connections_to(me + 10**6, ports) == {ports[0]: 0, ports[1]: 0}
    finally:
        for c in [*clients, *servers]:
            c.close()


def test_interleaved_runs_put_every_arm_once_in_each_round() -> None:
    from loadtest.harness.rounds import interleave, run_label

    assert interleave(["a", "b"], 2) == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert run_label("a", 1, 1) == "a" and run_label("a", 2, 3) == "a-r2"
    with pytest.raises(ValueError):
        interleave(["a"], 0)


def test_a_bound_holds_only_when_every_run_keeps_it() -> None:
    from loadtest.harness.rounds import bound_verdict, spread

    assert bound_verdict([0.27, 0.3, 0.28], 0.3) == "holds"
    assert bound_verdict([0.31, 0.4], 0.3) == "fails"
    assert bound_verdict([0.28, 0.31, 0.29], 0.3) == "not distinguished (2 of 3 runs keep it)"
    assert spread([0.31, 0.27, 0.28]).show(".2f", "x") == "x0.28 [0.27-0.31]"
    assert spread([5.0]).show(".0f") == "5"


def test_arms_and_runs_are_refused_by_scenarios_that_do_not_take_them(tmp_path: Path) -> None:
    for argv, named in ((["dra-scale", "--arms", "direct"], "--arms"), (["gogc", "--runs", "3"], "--runs"),
                        (["list-storm", "--runs", "0"], "--runs"), (["all", "--arms", "direct"], "--arms"),
                        (["skew", "--quick"], "--quick")):
        p = subprocess.run([sys.executable, "-m", "loadtest", *argv, "--out", str(tmp_path / "x")], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and named in p.stderr, (argv, p.stderr)


def test_every_armed_scenario_and_all_run_three_interleaved_runs_unless_told(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from loadtest import cli

    seen: list[tuple[str, int]] = []

    def fake(name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(run=lambda ctx: seen.append((name.rsplit(".", 1)[-1], ctx.runs)))

    monkeypatch.setattr(cli.importlib, "import_module", fake)
    assert cli.main(["all", "--out", str(tmp_path / "a"), "--scale", "0.05", "--allow-dirty"]) == 0
    assert seen and all(runs == cli.RUNS >= 3 for _, runs in seen), seen
    assert len(seen) == len(cli.SCENARIOS)
    seen.clear()
    assert cli.main(["skew", "--out", str(tmp_path / "s"), "--runs", "1", "--allow-dirty"]) == 0
    assert seen == [("skew", 1)]


def test_all_quick_keeps_three_interleaved_runs_at_a_quarter_of_each_reports_scale(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from loadtest import cli

    seen: dict[str, tuple[float, int]] = {}

    def fake(name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(run=lambda ctx: seen.__setitem__(name, (ctx.scale, ctx.runs)))

    monkeypatch.setattr(cli.importlib, "import_module", fake)
    assert cli.main(["all", "--quick", "--out", str(tmp_path / "q"), "--allow-dirty"]) == 0
    assert {cli.SCENARIOS[n]: (pytest.approx(s * cli.QUICK), cli.RUNS) for n, s in cli.ALL_SCALES.items()} == seen


def test_an_unknown_list_storm_arm_is_named_before_any_sandbox_starts() -> None:
    from loadtest.harness.run import RunContext
    from loadtest.scenarios import list_storm

    with pytest.raises(list_storm.cluster.ScenarioError, match="unknown arms informers-nowhere-list"):
        list_storm.run(RunContext(out=Path("/nonexistent"), arms=("direct", "informers-nowhere-list")))
    assert list_storm.base_arm("informers-fleet-watch-list") == "gatekeeper-fleet"
    assert list_storm.base_arm("informers-gatekeeper-list") == "gatekeeper"
    assert list_storm.reference("informers-fleet-list") == "informers-direct-list"


def test_nested_sweep_counts_a_handoff_between_apiservers_once_and_a_real_overlap_fully() -> None:
    from loadtest.harness.sampler import nested_sum

    # A LIST ends on apiserver 1 and the next starts on apiserver 3 between the two sweeps: either read sees 3.
    assert nested_sum([2, 0, 0], [1, 0, 1]) == (3, 1)
    # Three LISTs running through the whole sweep: both reads see all three.
    assert nested_sum([1, 1, 1], [1, 1, 1]) == (3, 3)
    assert nested_sum([2, 0, 1], [2, 0, 1]) == (3, 3)
    with pytest.raises(ValueError):
        nested_sum([1, 2], [1])


def test_an_apiserver_killed_while_starting_under_a_limit_is_named_with_the_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gatekeeper.sandbox import processes
    from gatekeeper.sandbox.state import ProcessRecord
    from loadtest.harness import cluster

    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.events").write_text("oom 0\noom_kill 3\n")
    state = SandboxState(dir=str(tmp_path), extra={"memory_cgroup_version": 2})
    state.processes = [ProcessRecord(name="kube-apiserver-1", pid=1, cmd=["true"], log=str(tmp_path / "log"),
                                     cgroup=str(cg))]
    monkeypatch.setattr(processes, "stop", lambda recs: None)
    monkeypatch.setattr(processes, "start", lambda name, cmd, log, **kw: ProcessRecord(
        name=name, pid=2, cmd=cmd, log=str(log), cgroup=kw.get("cgroup", "")))
    monkeypatch.setattr(cluster.memlimit.MemoryCgroup, "set_limit", lambda self, limit: None)

    def starts_then_killed(state: SandboxState, urls: list[str], timeout: float = 0) -> None:
        (cg / "memory.events").write_text("oom 1\noom_kill 4\n")
        raise processes.WaitFailed("connection refused", exited=True)

    monkeypatch.setattr(cluster, "wait_ready", starts_then_killed)
    with pytest.raises(cluster.ScenarioError, match=r"kube-apiserver-1 OOM-killed while starting under a 1536 MiB"):
        cluster.restart_apiservers(state, memory_limit=1536 << 20)
    # no kill while starting: the original failure stands
    monkeypatch.setattr(cluster, "wait_ready", lambda *a, **k: (_ for _ in ()).throw(
        processes.WaitFailed("timeout", exited=False)))
    with pytest.raises(processes.WaitFailed):
        cluster.restart_apiservers(state, memory_limit=1536 << 20)
