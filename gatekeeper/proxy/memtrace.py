"""Where a worker's memory goes, on demand: tracemalloc snapshots and the allocators' own statistics.

Off unless ``GATEKEEPER_TRACEMALLOC_DIR`` names a directory when the worker starts (tracemalloc slows every
allocation, so never in production). Then each SIGUSR2 writes, into that directory:

* ``worker-<index>-<pid>-<n>.tracemalloc``: a tracemalloc snapshot (``tracemalloc.Snapshot.load`` reads it;
  ``python -m loadtest bench soak --tracemalloc`` compares them by allocation site);
* ``worker-<index>-<pid>-<n>.malloc.txt``: glibc's ``malloc_stats()`` (per arena: bytes taken from the system and
  bytes in use, whose difference is what the allocator holds free) and CPython's ``sys._debugmallocstats()``
  (pymalloc's arenas and pools).

Together they separate Python objects that are kept (they show in the snapshots, by the line that allocated them)
from allocator behaviour (RSS the snapshots do not explain: free bytes held per arena, or pymalloc arenas kept alive
by a few objects). ``GATEKEEPER_TRACEMALLOC_FRAMES`` sets how many frames each trace keeps (default 8; 0: no
tracing, only the allocators' statistics, at full speed).

SIGUSR1 then runs a full garbage collection and appends to ``worker-<index>-<pid>-gc.txt`` what it found and the
traced memory before and after: memory that only waits for the collector is not a leak, but it is RSS until then.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import sys
import time
import tracemalloc
from pathlib import Path
from types import FrameType

DIR_ENV = "GATEKEEPER_TRACEMALLOC_DIR"
FRAMES_ENV = "GATEKEEPER_TRACEMALLOC_FRAMES"


def _allocator_stats(path: Path) -> None:
    """Both allocators print to file descriptor 2 only: point it at ``path`` for the call."""
    saved = os.dup(2)
    try:
        with path.open("w") as out:
            os.dup2(out.fileno(), 2)
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None).malloc_stats()
            sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def install(index: int) -> bool:
    """Start tracing and answer SIGUSR2 when the environment asks for it; True if it did."""
    directory = os.environ.get(DIR_ENV)
    if not directory:
        return False
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    frames = int(os.environ.get(FRAMES_ENV) or 8)
    if frames > 0:  # 0: the allocators' statistics only, at the deployed speed
        tracemalloc.start(frames)
    taken = [0]

    def dump(signum: int, frame: FrameType | None) -> None:
        taken[0] += 1
        stem = out / f"worker-{index}-{os.getpid()}-{taken[0]}"
        if tracemalloc.is_tracing():
            snapshot = tracemalloc.take_snapshot()
            snapshot.dump(str(stem.with_suffix(".tracemalloc.tmp")))
            os.replace(stem.with_suffix(".tracemalloc.tmp"), stem.with_suffix(".tracemalloc"))
        _allocator_stats(stem.with_suffix(".malloc.txt"))

    def collect(signum: int, frame: FrameType | None) -> None:
        before = tracemalloc.get_traced_memory()[0]
        counts = gc.get_count()
        found = gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        with (out / f"worker-{index}-{os.getpid()}-gc.txt").open("a") as fh:
            fh.write(f"{time.time():.0f} counts {counts} thresholds {gc.get_threshold()} frozen "
                     f"{gc.get_freeze_count()} collected {found} traced {before} -> {after}\n")

    signal.signal(signal.SIGUSR2, dump)
    signal.signal(signal.SIGUSR1, collect)
    return True
