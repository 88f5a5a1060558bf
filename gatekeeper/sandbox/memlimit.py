"""``sandbox up --apiserver-memory-limit SIZE``: each apiserver in a memory cgroup of its own, as a kubelet runs it.

The seeds' incident is an apiserver OOM-killed under a LIST storm, its clients failing over to the others, and
those killed in turn. Without a memory limit nothing is ever killed, and a scenario can only report peak RSS.

* The cgroup is made before the process starts and the process enters it before it execs (``preexec``), so
  every byte it ever allocates counts.
* cgroup v2 (``memory.max``, ``memory.swap.max`` 0, kills in ``memory.events``) or v1
  (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes`` when swap accounting is on, kills in
  ``memory.oom_control``). A kill is read from the cgroup's own counter, never guessed from an exit status.
* No writable memory controller: a clear error, never a silently unlimited apiserver.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from gatekeeper.base.config import parse_size
from gatekeeper.base.errors import UsageError

ROOT = Path("/sys/fs/cgroup")
GROUP = "gatekeeper-sandbox"
EMPTY_TRIES = 8
"""Times a v1 limit below the charges an exited process left is tried, emptying the cgroup in between (~14 s)."""
MIN_LIMIT = 64 << 20
"""An apiserver needs well over this just to start; a smaller limit is a typo."""


def parse_limit(text: str) -> int:
    """Bytes of a Kubernetes-style size (``1536Mi``, ``2Gi``, ``2G``, ``1073741824``)."""
    try:
        value = parse_size(text)
    except ValueError:
        raise UsageError(f"--apiserver-memory-limit {text!r}: expected a size such as 1536Mi, 2Gi or 2G") from None
    if value < MIN_LIMIT:
        raise UsageError(f"--apiserver-memory-limit {text!r}: at least 64Mi (a kube-apiserver needs more to start)")
    return value


@dataclass(frozen=True)
class MemoryCgroup:
    """One process's memory cgroup; ``version`` 1 or 2."""

    path: Path
    version: int

    def enter(self) -> None:
        """Move the calling process in (run in the child before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has killed in this cgroup."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError):
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def usage(self) -> int:
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        with contextlib.suppress(OSError, ValueError):
            return int((self.path / name).read_text())
        return 0

    def set_limit(self, limit: int) -> None:
        """A new limit for the next process in this cgroup (list-storm-oom runs several on one sandbox). Set it
        while the cgroup is empty: a limit below what a running process holds makes the kernel reclaim or kill.
        On v1 the memory+swap limit may never be below the memory limit, so the one that grows is written first."""
        if self.version == 2:
            (self.path / "memory.max").write_text(str(limit))
            return
        names = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
        with contextlib.suppress(OSError, ValueError):
            if limit > int((self.path / names[0]).read_text()):
                names.reverse()
        for name in names:
            if name == "memory.limit_in_bytes" or (self.path / name).exists():  # memsw: with swap accounting
                self._write_v1(name, limit)

    def _write_v1(self, name: str, limit: int) -> None:
        """v1 refuses a limit below the cgroup's usage (EBUSY) when reclaim falls short, and an exited apiserver
        leaves its page cache charged here (a 4 GiB run's before a 2 GiB one): an empty v1 cgroup drops its
        charges on request (``memory.force_empty``), then the limit is written again."""
        for attempt in range(EMPTY_TRIES):
            try:
                (self.path / name).write_text(str(limit))
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or attempt + 1 == EMPTY_TRIES:
                    raise
            os.sync()  # dirty pages are reclaimed only once written back
            with contextlib.suppress(OSError):  # EBUSY too while pages are under writeback: try again
                (self.path / "memory.force_empty").write_text("0")
            time.sleep(attempt * 0.5)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def controller(root: Path = ROOT) -> tuple[Path, int]:
    """Where memory cgroups can be made, and the cgroup version; UsageError when nowhere."""
    if (root / "cgroup.controllers").exists():
        if "memory" not in (root / "cgroup.controllers").read_text().split():
            raise UsageError(f"--apiserver-memory-limit: the memory controller is not enabled in {root}")
        return root, 2
    if (root / "memory" / "memory.limit_in_bytes").exists():
        return root / "memory", 1
    raise UsageError(f"--apiserver-memory-limit: no memory cgroup controller under {root} (neither cgroup v2 "
                     "memory.max nor a v1 memory hierarchy)")


def create(sandbox_id: str, name: str, limit: int, root: Path = ROOT) -> MemoryCgroup:
    """A memory cgroup ``gatekeeper-sandbox/<sandbox_id>/<name>`` limited to ``limit`` bytes, swap excluded."""
    base, version = controller(root)
    path = base / GROUP / sandbox_id / name
    try:
        path.mkdir(parents=True, exist_ok=True)
        if version == 2:
            with contextlib.suppress(OSError):  # subtree_control of the parents: the memory controller below
                for parent in (base / GROUP, base / GROUP / sandbox_id):
                    (parent / "cgroup.subtree_control").write_text("+memory")
            (path / "memory.max").write_text(str(limit))
            with contextlib.suppress(FileNotFoundError):
                (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            with contextlib.suppress(FileNotFoundError, PermissionError):
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
    except OSError as exc:
        raise UsageError(f"--apiserver-memory-limit: cannot make the memory cgroup {path}: {exc} (it needs "
                         "write access to the cgroup filesystem, e.g. root)") from None
    return MemoryCgroup(path, version)


def remove_all(sandbox_id: str, root: Path = ROOT) -> None:
    """``sandbox down``: the sandbox's cgroups, once their processes are gone."""
    with contextlib.suppress(UsageError):
        base, _ = controller(root)
        parent = base / GROUP / sandbox_id
        if parent.is_dir():
            for child in parent.iterdir():
                if child.is_dir():
                    _rmdir(child)
            _rmdir(parent)
        with contextlib.suppress(OSError):  # the last sandbox's: fails while another sandbox has its own there
            (base / GROUP).rmdir()


def _rmdir(path: Path, seconds: float = 3.0) -> None:
    """Remove a cgroup; a killed process still exiting keeps it busy (EBUSY) for a moment, so try again."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            path.rmdir()
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                return
            time.sleep(0.1)
