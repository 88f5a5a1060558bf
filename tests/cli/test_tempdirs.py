"""``gatekeeper.runtime.tempdirs``: a supervisor's stamped directories outlive a SIGKILL only until the next start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gatekeeper.runtime import tempdirs


def _stamp(path: Path, pid: int, started: str | None) -> Path:
    path.mkdir()
    (path / tempdirs.OWNER_FILE).write_text(f"{pid} {started}\n")
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_directories_of_a_dead_owner_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    dead = _stamp(tmp_path / "gk-x-dead", _dead_pid(), "12345")
    mine = _stamp(tmp_path / "gk-x-mine", os.getpid(), tempdirs.start_time(os.getpid()))
    reused = _stamp(tmp_path / "gk-x-reused", os.getpid(), "1")  # our pid, another process's start time
    unstamped = tmp_path / "gk-x-unstamped"
    unstamped.mkdir()
    other_prefix = _stamp(tmp_path / "other-dead", _dead_pid(), "1")
    (tmp_path / "gk-x-file").write_text("not a directory")
    target = _stamp(tmp_path / "elsewhere", _dead_pid(), "1")
    (tmp_path / "gk-x-link").symlink_to(target)

    removed = tempdirs.sweep("gk-x-", str(tmp_path))

    assert sorted(p.name for p in removed) == ["gk-x-dead", "gk-x-reused"]
    assert not dead.exists() and not reused.exists()
    assert mine.is_dir() and unstamped.is_dir() and other_prefix.is_dir() and target.is_dir()
    assert (tmp_path / "gk-x-link").is_symlink() and (tmp_path / "gk-x-file").is_file()


def test_make_stamps_a_private_directory_and_sweeps_first(tmp_path: Path) -> None:
    stale = _stamp(tmp_path / "gk-y-old", _dead_pid(), "1")
    made = tempdirs.make("gk-y-", str(tmp_path))
    assert not stale.exists()
    assert made.name.startswith("gk-y-") and (made.stat().st_mode & 0o777) == 0o700
    pid, started = (made / tempdirs.OWNER_FILE).read_text().split()
    assert int(pid) == os.getpid() and started == tempdirs.start_time(os.getpid())
    assert tempdirs.sweep("gk-y-", str(tmp_path)) == []  # its owner (this process) is alive
