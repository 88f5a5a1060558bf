"""Private temporary directories that a SIGKILLed supervisor does not leave behind for good.

Why: the proxy's and the webhook's supervisors make ``mkdtemp`` directories (the
runtime directory with the seat ledger and the config copy, the prometheus
multiprocess directory) and remove them at exit. One killed with SIGKILL (the
OOM killer, the kubelet after the grace period) cannot, so a crash-looping
static pod whose ``/tmp`` is a hostPath gained two directories per restart.

Each directory made here holds an owner stamp: the pid and that process's start
time from ``/proc`` (so a reused pid is not taken for the owner). Every start
first removes the directories of its prefix whose owner is gone. Only real
directories owned by this user and carrying a stamp are ever removed: a
directory without one may be another supervisor's between its ``mkdtemp`` and
its stamp, or not ours at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

log = logging.getLogger("gatekeeper.runtime.tempdirs")

OWNER_FILE = ".gatekeeper-owner"


def start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (clock ticks after boot), or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _owner_gone(path: Path) -> bool:
    try:
        fd = os.open(path / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False  # no stamp: not ours to judge
    with os.fdopen(fd) as f:
        parts = f.read(64).split()
    if len(parts) != 2 or not parts[0].isdigit():
        return False
    return start_time(int(parts[0])) != parts[1]


def sweep(prefix: str, parent: str | None = None) -> list[Path]:
    """Remove this user's stamped directories named ``prefix*`` whose owner process is gone; returns them."""
    removed = []
    for entry in Path(parent or tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            st = os.lstat(entry)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or not _owner_gone(entry):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry)
    if removed:
        log.info("removed %d temporary directories left by supervisors that were killed: %s",
                 len(removed), ", ".join(str(p) for p in removed))
    return removed


def make(prefix: str, parent: str | None = None) -> Path:
    """``mkdtemp`` (0700, unpredictable name) with this process's owner stamp, after sweeping stale ones."""
    with contextlib.suppress(OSError):
        sweep(prefix, parent)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    fd = os.open(path / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()} {start_time(os.getpid())}\n")
    return path
