"""``sandbox up --apiserver-memory-limit``: apiservers in memory cgroups of their own, kills counted from the
cgroup, restarts with kubelet's back-off; and the per-component flags."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gatekeeper.base.errors import UsageError
from gatekeeper.sandbox import components as comp
from gatekeeper.sandbox import memlimit, processes
from gatekeeper.sandbox.restarts import BackOff


@pytest.mark.parametrize(("text", "size"), [("1536Mi", 1536 << 20), ("2Gi", 2 << 30), ("2G", 2 * 10**9),
                                            ("1073741824", 1 << 30), ("0.5Gi", 1 << 29)])
def test_limits_read_as_kubernetes_quantities(text: str, size: int) -> None:
    assert memlimit.parse_limit(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1Gi", "10Mi", "1.5 Gb"])
def test_a_limit_that_cannot_be_meant_is_refused(text: str) -> None:
    with pytest.raises(UsageError, match="--apiserver-memory-limit"):
        memlimit.parse_limit(text)


def test_back_off_doubles_to_five_minutes_and_starts_over_after_ten_minutes_running() -> None:
    b = BackOff(started_at=0.0)
    waits = []
    now = 1.0
    for _ in range(7):
        waits.append(b.killed(now))
        assert not b.ready(now + waits[-1] - 0.1) and b.ready(now + waits[-1])
        now += waits[-1]
        b.restarted(now)
        now += 1
    assert waits == [10, 20, 40, 80, 160, 300, 300]
    assert b.restarts == 7
    assert b.killed(now + 600) == 10  # ran ten minutes: the crash back-off starts over


def fake_v1(root: Path) -> Path:
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    return root


def test_a_v1_cgroup_gets_the_limit_and_its_kills_are_read_from_oom_control(tmp_path: Path) -> None:
    root = fake_v1(tmp_path)
    group = memlimit.create("sb1", "kube-apiserver-1", 512 << 20, root=root)
    assert group.version == 1 and group.path == root / "memory" / memlimit.GROUP / "sb1" / "kube-apiserver-1"
    assert (group.path / "memory.limit_in_bytes").read_text() == str(512 << 20)
    (group.path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert group.oom_kills() == 2


def test_a_v2_cgroup_gets_memory_max_no_swap_and_its_kills_from_memory_events(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    group = memlimit.create("sb2", "kube-apiserver-2", 768 << 20, root=tmp_path)
    assert group.version == 2
    assert (group.path / "memory.max").read_text() == str(768 << 20)
    (group.path / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\n")
    assert group.oom_kills() == 1


def test_down_removes_the_sandboxs_cgroups_and_the_shared_parent_once_no_other_sandbox_uses_it(
        tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    for sandbox in ("sb-a", "sb-b"):  # empty directories, as cgroups are once their processes are gone
        (tmp_path / memlimit.GROUP / sandbox / "kube-apiserver-1").mkdir(parents=True)
    memlimit.remove_all("sb-a", root=tmp_path)
    assert not (tmp_path / memlimit.GROUP / "sb-a").exists()
    assert (tmp_path / memlimit.GROUP / "sb-b" / "kube-apiserver-1").is_dir(), "another sandbox's are kept"
    memlimit.remove_all("sb-b", root=tmp_path)
    assert not (tmp_path / memlimit.GROUP).exists()


def test_without_a_memory_controller_the_limit_is_an_error_never_unlimited(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no memory cgroup controller"):
        memlimit.create("sb", "kube-apiserver-1", 512 << 20, root=tmp_path)
    (tmp_path / "cgroup.controllers").write_text("cpu pids\n")
    with pytest.raises(UsageError, match="memory controller is not enabled"):
        memlimit.create("sb", "kube-apiserver-1", 512 << 20, root=tmp_path)


def test_a_process_enters_its_cgroup_before_it_execs(tmp_path: Path) -> None:
    """The child writes its own pid into cgroup.procs before exec, so nothing it allocates escapes the limit."""
    group = tmp_path / "g"
    group.mkdir()
    (group / "cgroup.procs").write_text("")
    rec = processes.start("probe", [sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "p.log",
                          cgroup=str(group))
    try:
        assert (group / "cgroup.procs").read_text() == str(rec.pid)
        assert rec.cgroup == str(group)
    finally:
        os.kill(rec.pid, 9)
        processes._reap(rec.pid)


def test_component_flags_are_appended_last() -> None:
    layout = comp.Layout(Path("/tmp/x"))
    assert comp.etcd_argv(Path("etcd"), layout, 1, 2, extra=("--quota-backend-bytes=1",))[-1] == \
        "--quota-backend-bytes=1"
    assert comp.scheduler_argv(Path("s"), layout, 3, ("--kube-api-qps=200",))[-1] == "--kube-api-qps=200"
    assert comp.controller_manager_argv(Path("c"), layout, 4, ("--kube-api-burst=400",))[-1] == \
        "--kube-api-burst=400"


def test_the_cli_refuses_a_bad_limit_before_starting_anything(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "gatekeeper", "sandbox", "up", "--state-dir", str(tmp_path / "s"),
                          "--apiserver-memory-limit", "lots"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--apiserver-memory-limit 'lots'" in out.stderr
    assert not (tmp_path / "s" / "sandbox.json").exists()


def test_a_v1_limit_below_the_charges_an_exited_process_left_is_set_after_they_are_dropped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel answers EBUSY while the cgroup's usage (an exited apiserver's page cache) is over the new limit."""
    (tmp_path / "memory.limit_in_bytes").write_text(str(4 << 30))
    (tmp_path / "memory.usage_in_bytes").write_text(str(3 << 30))
    write_text = Path.write_text

    empties: list[str] = []

    def kernel(path: Path, text: str) -> int:
        usage = tmp_path / "memory.usage_in_bytes"
        if path.name == "memory.force_empty":
            empties.append(text)
            if len(empties) < 2:  # pages still under writeback: the first try is refused too
                raise OSError(errno.EBUSY, "Device or resource busy")
            usage.write_text("0")
        elif path.name == "memory.limit_in_bytes" and int(text) < int(usage.read_text()):
            raise OSError(errno.EBUSY, "Device or resource busy")
        return write_text(path, text)

    monkeypatch.setattr(Path, "write_text", kernel)
    monkeypatch.setattr(memlimit.time, "sleep", lambda _: None)
    monkeypatch.setattr(memlimit.os, "sync", lambda: None)
    memlimit.MemoryCgroup(tmp_path, 1).set_limit(2 << 30)
    assert (tmp_path / "memory.limit_in_bytes").read_text() == str(2 << 30)
    assert (tmp_path / "memory.force_empty").exists()
