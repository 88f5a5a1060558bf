"""Reading the workers' memory snapshots (``gatekeeper/proxy/memtrace.py`` writes them on SIGUSR2).

Two questions, kept apart: which allocation sites keep more Python memory at the end than at the first snapshot
(tracemalloc, grouped by traceback), and how much the C allocator holds beyond what is in use (glibc's per-arena
``system bytes`` minus ``in use bytes``: free memory it has not given back, fragmentation, one arena per thread).
"""

from __future__ import annotations

import re
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
NAME = re.compile(r"worker-(\d+)-(\d+)-(\d+)\.tracemalloc$")
ARENA = re.compile(r"Arena (\d+):\s+system bytes\s+=\s+(\d+)\s+in use bytes\s+=\s+(\d+)")
TOTAL = re.compile(r"Total \(incl\. mmap\):\s+system bytes\s+=\s+(\d+)\s+in use bytes\s+=\s+(\d+)")
PYMALLOC = re.compile(r"# arenas allocated current\s+=\s+(\d+)")


@dataclass(frozen=True)
class Allocator:
    """One malloc_stats()/_debugmallocstats() dump."""

    arenas: int
    system: int
    """Bytes glibc took from the kernel, mmapped blocks included."""
    in_use: int
    pymalloc_arenas: int
    """CPython's own 1 MiB arenas (3.11: 256 KiB) currently allocated."""


def parse_allocator(text: str) -> Allocator:
    total = TOTAL.search(text)
    py = PYMALLOC.search(text)
    return Allocator(arenas=len(ARENA.findall(text)), system=int(total.group(1)) if total else 0,
                     in_use=int(total.group(2)) if total else 0, pymalloc_arenas=int(py.group(1)) if py else 0)


def by_worker(directory: Path, suffix: str = ".tracemalloc") -> dict[str, list[Path]]:
    """``worker-N`` -> its dumps ending in ``suffix``, oldest first (a restarted worker's pid changes: the last pid
    wins)."""
    found: dict[str, dict[int, list[tuple[int, Path]]]] = {}
    for path in directory.glob(f"worker-*{suffix}"):
        m = NAME.search(path.name.replace(suffix, ".tracemalloc"))
        if m:
            found.setdefault(f"worker-{m.group(1)}", {}).setdefault(int(m.group(2)), []).append((int(m.group(3)), path))
    out = {}
    for worker, pids in found.items():
        newest = max(pids, key=lambda pid: max(path.stat().st_mtime for _, path in pids[pid]))
        out[worker] = [path for _, path in sorted(pids[newest])]
    return dict(sorted(out.items()))


def _frames(tb: tracemalloc.Traceback, depth: int) -> str:
    """The innermost ``depth`` frames, innermost first, shortened to the package-relative path (a Traceback lists
    the oldest frame first)."""
    parts = []
    for frame in list(tb)[::-1][:depth]:
        name = frame.filename
        for marker in ("/gatekeeper/", "/site-packages/", "/lib/python3"):
            if marker in name:
                name = name[name.index(marker) + 1:]
                break
        parts.append(f"{name}:{frame.lineno}")
    return " < ".join(parts)


def growth_rows(first: Path, last: Path, top: int = 15, depth: int = 3) -> list[list[object]]:
    """The ``top`` allocation sites by growth from ``first`` to ``last``: site, KiB then, KiB now, blocks now."""
    filters = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib*>")]
    old = tracemalloc.Snapshot.load(str(first)).filter_traces(filters)
    new = tracemalloc.Snapshot.load(str(last)).filter_traces(filters)
    rows: list[list[object]] = []
    for stat in new.compare_to(old, "traceback")[:top]:
        rows.append([_frames(stat.traceback, depth), f"{(stat.size - stat.size_diff) / 1024:.0f}",
                     f"{stat.size / 1024:.0f}", f"{stat.size_diff / 1024:+.0f}", stat.count])
    return rows


def traced_mib(path: Path) -> float:
    snapshot = tracemalloc.Snapshot.load(str(path))
    return sum(stat.size for stat in snapshot.statistics("filename")) / MIB


def allocator_rows(stats: list[Path]) -> list[list[object]]:
    """Per ``.malloc.txt`` dump: Python memory traced (when a snapshot was taken with it), glibc's system and in-use
    bytes, arenas, pymalloc arenas (CPython reports them only when tracemalloc is off)."""
    rows: list[list[object]] = []
    for path in stats:
        snap = path.with_name(path.name.replace(".malloc.txt", ".tracemalloc"))
        a = parse_allocator(path.read_text())
        rows.append([path.name.replace(".malloc.txt", ""), f"{traced_mib(snap):.1f}" if snap.exists() else "-",
                     f"{a.system / MIB:.1f}", f"{a.in_use / MIB:.1f}", f"{(a.system - a.in_use) / MIB:.1f}",
                     a.arenas, a.pymalloc_arenas])
    return rows
