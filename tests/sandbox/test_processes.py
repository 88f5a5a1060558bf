"""Process bookkeeping used by `sandbox down`, exercised on real (tiny) local processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import ProcessRecord

SLEEP = "import time; time.sleep(300)"
FORKER = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {SLEEP!r}]); time.sleep(300)"
TERM_IGNORER = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
    "time.sleep(300)"
)


def group_members(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid and processes.is_alive(int(entry.name)):
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def wait_for(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_stop_takes_down_the_whole_process_group_including_forked_children(tmp_path: Path) -> None:
    rec = processes.start("forker", [sys.executable, "-c", FORKER], tmp_path / "forker.log")
    assert wait_for(lambda: len(group_members(rec.pid)) == 2), "child was forked into the same group"
    [result] = processes.stop([rec], grace=5)
    assert result.outcome == "stopped"
    assert group_members(rec.pid) == []
    assert not processes.is_alive(rec.pid)


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path: Path) -> None:
    log = tmp_path / "stubborn.log"
    rec = processes.start("stubborn", [sys.executable, "-c", TERM_IGNORER], log)
    assert wait_for(lambda: "ready" in log.read_text())
    [result] = processes.stop([rec], grace=0.5)
    assert result.outcome == "killed"
    assert not processes.is_alive(rec.pid)


def test_a_recorded_pid_now_running_something_else_is_left_alone(tmp_path: Path) -> None:
    rec = processes.start("sleeper", [sys.executable, "-c", SLEEP], tmp_path / "s.log")
    impostor = ProcessRecord(name="etcd", pid=rec.pid, cmd=["/somewhere/etcd"], log="")
    try:
        assert not processes.is_ours(impostor)
        [result] = processes.stop([impostor], grace=0.5)
        assert result.outcome == "not running"
        assert processes.is_alive(rec.pid)
    finally:
        processes.stop([rec], grace=2)
    assert not processes.is_alive(rec.pid)


def test_stopping_twice_reports_not_running(tmp_path: Path) -> None:
    rec = processes.start("sleeper", [sys.executable, "-c", SLEEP], tmp_path / "s.log")
    assert processes.stop([rec], grace=5)[0].outcome == "stopped"
    assert processes.stop([rec], grace=5)[0].outcome == "not running"


def test_free_ports_come_from_below_the_ephemeral_range_and_never_twice() -> None:
    """An outgoing connection's local port can never take a port we handed out (the CI EADDRINUSE)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [processes.free_port() for _ in range(200)]
    assert all(p < low for p in ports), [p for p in ports if p >= low]
    assert len(set(ports)) == len(ports)


def test_probe_reports_refused_connections_as_unhealthy() -> None:
    port = processes.free_port()
    ok, detail = processes.probe(f"http://127.0.0.1:{port}/healthz", timeout=1)
    assert not ok and "refused" in detail.lower()


ORPHANER = (
    "import subprocess, sys, time; "
    f"c = subprocess.Popen([sys.executable, '-c', {SLEEP!r}]); print(c.pid, flush=True); time.sleep(300)"
)


def test_children_left_behind_by_a_dead_leader_are_stopped_too(tmp_path: Path) -> None:
    log = tmp_path / "orphaner.log"
    rec = processes.start("webhook", [sys.executable, "-c", ORPHANER], log)
    assert wait_for(lambda: log.read_text().strip().isdigit())
    child = int(log.read_text())
    os.kill(rec.pid, 9)  # the leader crashes; its child keeps running in the leader's process group
    assert wait_for(lambda: not processes.is_alive(rec.pid))
    assert processes.is_alive(child) and os.getpgid(child) == rec.pid
    [result] = processes.stop([rec], grace=5)
    assert result.outcome == "stopped"
    assert wait_for(lambda: not processes.is_alive(child), timeout=5), "orphaned child survived stop"
    assert group_members(rec.pid) == []


def test_a_process_is_ours_right_after_start_even_while_it_is_still_exec_ing(tmp_path: Path) -> None:
    # Popen returns while the child may still be inside execve (empty or parent's cmdline): stop()
    # right after start() must still recognise it, or `down` racing `up` would leave it running.
    for _ in range(100):
        rec = processes.start("sleeper", [sys.executable, "-c", SLEEP], tmp_path / "s.log")
        try:
            assert processes.is_ours(rec)
        finally:
            os.kill(rec.pid, 9)
            os.waitpid(rec.pid, 0)


def test_poll_until_fails_fast_when_the_process_exits_and_reports_the_last_check(tmp_path: Path) -> None:
    rec = processes.start("quitter", [sys.executable, "-c", "pass"], tmp_path / "q.log")
    with pytest.raises(processes.WaitFailed) as info:
        processes.poll_until(lambda: (False, "still starting"), timeout=120, pid=rec.pid, interval=0.05)
    assert info.value.exited and info.value.detail == "still starting"
    with pytest.raises(processes.WaitFailed) as info:
        processes.poll_until(lambda: (False, "nope"), timeout=0, interval=0.01)
    assert not info.value.exited and info.value.detail == "nope"
    calls: list[int] = []

    def third_time_lucky() -> tuple[bool, str]:
        calls.append(1)
        return len(calls) >= 3, "not yet"

    processes.poll_until(third_time_lucky, timeout=60, interval=0.01)
    assert len(calls) == 3
