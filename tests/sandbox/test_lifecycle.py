"""`sandbox up/status/down` on a small sandbox of its own (1 apiserver, no nodes)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import gatekeeper_cli, processes_mentioning, sandbox_up

pytestmark = pytest.mark.sandbox


def test_status_then_down_leaves_no_process_and_down_is_repeatable(own_sandbox_dir: Path) -> None:
    state = sandbox_up(own_sandbox_dir, "--apiservers", "1", "--gpu-nodes", "0", "--gogc", "50", "--timeout", "120")
    assert [p.name for p in state.processes] == ["etcd", "kube-apiserver-1"]
    assert state.extra["startup_seconds"] > 0
    for p in state.processes:
        assert b"GOGC=50" in Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0"), p.name
    st = gatekeeper_cli("sandbox", "status", "--state-dir", str(own_sandbox_dir))
    assert st.returncode == 0, st.stdout + st.stderr
    assert "kube-apiserver-1" in st.stdout and "FAIL" not in st.stdout
    assert sorted(processes_mentioning(own_sandbox_dir)) == sorted(p.pid for p in state.processes)

    down = gatekeeper_cli("sandbox", "down", "--state-dir", str(own_sandbox_dir))
    assert down.returncode == 0, down.stdout + down.stderr
    assert processes_mentioning(own_sandbox_dir) == []
    assert all(not processes.is_alive(p.pid) for p in state.processes)

    again = gatekeeper_cli("sandbox", "down", "--state-dir", str(own_sandbox_dir))
    assert again.returncode == 0
    assert again.stdout.count("not running") == 2
    st = gatekeeper_cli("sandbox", "status", "--state-dir", str(own_sandbox_dir))
    assert st.returncode != 0, "status must report a stopped sandbox as unhealthy"


def test_up_refuses_a_directory_whose_sandbox_is_still_running(own_sandbox_dir: Path) -> None:
    sandbox_up(own_sandbox_dir, "--apiservers", "1", "--timeout", "120")
    second = gatekeeper_cli("sandbox", "up", "--state-dir", str(own_sandbox_dir), "--apiservers", "1")
    assert second.returncode != 0
    assert "already running" in second.stderr
    assert SandboxState.load(own_sandbox_dir).processes[0].name == "etcd"


def test_failed_up_names_the_component_shows_its_log_and_stops_everything(own_sandbox_dir: Path) -> None:
    # A zero timeout: etcd cannot answer /health within microseconds of being spawned, unless a busy machine
    # delays the first probe past etcd's start; then the apiserver, which takes seconds, is the one named.
    p = gatekeeper_cli("sandbox", "up", "--state-dir", str(own_sandbox_dir), "--apiservers", "1", "--timeout", "0")
    assert p.returncode != 0
    failed = re.search(r"(etcd|kube-apiserver-1): not healthy", p.stderr)
    assert failed, p.stderr
    assert "--- last lines of" in p.stderr and f"{failed.group(1)}.log" in p.stderr, p.stderr
    assert "etcd stopped" in p.stderr or "etcd killed" in p.stderr, p.stderr
    assert processes_mentioning(own_sandbox_dir) == []


def test_sigterm_during_up_stops_what_was_already_started(own_sandbox_dir: Path) -> None:
    argv = [sys.executable, "-m", "gatekeeper", "sandbox", "up", "--state-dir", str(own_sandbox_dir),
            "--apiservers", "1", "--timeout", "120"]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state_file = own_sandbox_dir / "sandbox.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (state_file.exists() and '"etcd"' in state_file.read_text()):
        time.sleep(0.02)
    up.send_signal(signal.SIGTERM)
    _out, err = up.communicate(timeout=60)
    assert up.returncode != 0, "up finished before SIGTERM arrived; the test did not exercise the interrupt"
    assert "stopped:" in err, err
    started = SandboxState.load(own_sandbox_dir).processes
    assert started, "at least etcd had started"
    assert all(not processes.is_alive(p.pid) for p in started)
    assert processes_mentioning(own_sandbox_dir) == []


@pytest.mark.parametrize("content", ["{not json", '{"dir": "/x", "processes": [{"pid": 1}]}', "[]"])
def test_unreadable_state_file_is_a_one_line_error_for_status_down_and_up(tmp_path: Path, content: str) -> None:
    (tmp_path / "sandbox.json").write_text(content)
    for action in (["status"], ["down"], ["up", "--apiservers", "1"]):
        p = gatekeeper_cli("sandbox", *action, "--state-dir", str(tmp_path))
        assert p.returncode == 2 and "Traceback" not in p.stderr, (action, p.stderr)
        assert "is not a readable sandbox state" in p.stderr, (action, p.stderr)
