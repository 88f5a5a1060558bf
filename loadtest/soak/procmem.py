"""The proxy's processes and their memory, read from /proc: the supervisor and each worker by its index.

A worker restarted mid-soak has a new pid but the same ``--worker-index``, so its line goes on in the plot (and a
restart shows as a drop, not as a new process).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from loadtest.soak.analysis import Sample

PROC = Path("/proc")


def children(root: int, proc: Path = PROC) -> list[int]:
    """``root``'s direct children."""
    out = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == root:
                    out.append(int(entry.name))
    return sorted(out)


def process_name(pid: int, root: int, proc: Path = PROC) -> str:
    """``parent`` for the supervisor, ``worker-N`` for a worker (its ``--worker-index``), else ``pid-P``."""
    if pid == root:
        return "parent"
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid-{pid}"
    if b"--worker-index" in argv:
        at = argv.index(b"--worker-index")
        if at + 1 < len(argv):
            return f"worker-{argv[at + 1].decode()}"
    return f"pid-{pid}"


def status_fields(pid: int, proc: Path = PROC) -> dict[str, int] | None:
    """VmRSS, RssAnon (bytes) and Threads of ``pid``; None once it is gone."""
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            out[key] = int(rest.split()[0]) * 1024
        elif key == "Threads":
            out[key] = int(rest.split()[0])
    return out if "VmRSS" in out else None


def sample_tree(root: int, minute: float, proc: Path = PROC) -> list[Sample]:
    """One :class:`Sample` for the proxy's supervisor ``root`` and each of its workers."""
    out = []
    for pid in [root, *children(root, proc)]:
        fields = status_fields(pid, proc)
        if fields is not None:
            out.append(Sample(minute=minute, process=process_name(pid, root, proc), pid=pid, rss=fields["VmRSS"],
                              anon=fields.get("RssAnon", 0), threads=fields.get("Threads", 0)))
    return out
