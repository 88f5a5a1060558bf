"""Prometheus exposition shared by the components (a thin layer over prometheus-client).

Components define their collectors on the default registry. With several worker processes (``--workers N``),
prometheus-client's multiprocess mode makes every process write its samples to files that :func:`render`
aggregates, so a scrape that lands on any worker reports the whole server. Importing this module imports
prometheus_client, which fixes the mode: a command that runs workers calls
:func:`gatekeeper.runtime.multiproc.enable_multiprocess` before it imports anything that defines metrics. No HTTP here:
the aiohttp routes are in ``gatekeeper.runtime.ops``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import os
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Gauge, generate_latest, multiprocess
from prometheus_client.mmap_dict import MmapedDict

from gatekeeper import __version__
from gatekeeper.runtime import compiled
from gatekeeper.runtime.multiproc import ARCHIVE, MMAP_HEADER_BYTES, MULTIPROC_ENV, merge_lock


def absorb_dead_process(pid: int, path: str | None = None) -> None:
    """Fold a dead process's counter and histogram files into the archive files and remove them.

    prometheus-client keeps one ``counter_<pid>.db`` and ``histogram_<pid>.db`` per process forever (only
    live gauges go with ``mark_process_dead``), so a worker in a restart loop grew the directory by two
    files per restart and every scrape merged all of them. Summing the dead process's values into
    ``<type>_archive.db`` keeps its counts on the page (counters never go backwards) in a bounded number
    of files. Only the supervisor calls this, for a process it has reaped (nobody writes those files)."""
    path = path or os.environ[MULTIPROC_ENV]
    with merge_lock(path, fcntl.LOCK_EX):
        for typ in ("counter", "histogram"):
            dead = os.path.join(path, f"{typ}_{pid}.db")
            try:
                if os.path.getsize(dead) < MMAP_HEADER_BYTES:
                    os.unlink(dead)  # died while creating it: nothing was counted
                    continue
                values = MmapedDict.read_all_values_from_file(dead)
            except FileNotFoundError:
                continue
            archive = MmapedDict(os.path.join(path, f"{typ}_{ARCHIVE}.db"))
            try:
                for key, value, timestamp, _ in values:  # zeros too: a histogram's page lists every bucket
                    old, _ = archive.read_value(key)
                    archive.write_value(key, old + value, timestamp)
            finally:
                archive.close()
            os.unlink(dead)
        multiprocess.mark_process_dead(pid, path)


@functools.cache
def build_info() -> Any:
    """``gatekeeper_build_info{version,compiled} 1`` on the process's registry, once (the webhook and the proxy call
    it when they define their metrics): which build answers, for a rollout to be checked from ``/metrics``;
    ``compiled`` is ``"15/15"`` when the hot modules load compiled by mypyc, ``"0/15"`` for pure Python. Its
    multiprocess mode is ``livemax``: every live worker's 1 merges into one sample, and a dead worker's file
    goes with it (``mark_process_dead``), so restarts do not grow the metrics directory."""
    info = Gauge("gatekeeper_build_info", "The running gatekeeper's version and how many of its hot modules "
                 "load compiled (value 1).", ["version", "compiled"], multiprocess_mode="livemax")
    info.labels(__version__, compiled.summary()).set(1)
    return info


@functools.lru_cache(maxsize=4096)
def child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, looked up once per label set for the hot paths.

    ``labels()`` validates and takes a lock on every call; a child evicted from this
    bounded cache is the same object when prometheus-client hands it out again.
    """
    return metric.labels(*labels)


def render() -> tuple[bytes, str]:
    """The exposition page and its content type: every process's samples in multiprocess mode, else this
    process's default registry. The one renderer: the webhook's and the proxy's /metrics both use it."""
    if os.environ.get(MULTIPROC_ENV):
        return generate_latest(multiprocess_registry()), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


class WrittenFilesCollector:
    """prometheus-client's multiprocess merge over the files that are past creation.

    A process creates a metric file by opening it and then sizing it; a scrape that
    globs the directory in between reads an empty file, and prometheus-client's own
    ``MultiProcessCollector`` then fails the whole page (``struct.error``: a 500 for the
    scrape). Such a file holds no sample yet, so leaving it out of this scrape loses nothing.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Any:
        with merge_lock(self.path, fcntl.LOCK_SH):
            files = []
            for name in glob.glob(os.path.join(self.path, "*.db")):
                with contextlib.suppress(OSError):  # a live gauge's file removed since the glob
                    if os.path.getsize(name) >= MMAP_HEADER_BYTES:
                        files.append(name)
            return multiprocess.MultiProcessCollector.merge(files, accumulate=True)


PAGE_COLLECTORS: list[Any] = []
"""Collectors whose data is not per-process samples (a component's own snapshot): on every page, multiprocess too."""


def register_page_collector(collector: Any) -> None:
    """Show ``collector`` on this process's /metrics page, whichever mode the page is rendered in."""
    PAGE_COLLECTORS.append(collector)
    if not os.environ.get(MULTIPROC_ENV):
        REGISTRY.register(collector)


def multiprocess_registry() -> CollectorRegistry:
    """A registry holding every process's samples (``PROMETHEUS_MULTIPROC_DIR``) and the page collectors."""
    registry = CollectorRegistry()
    registry.register(WrittenFilesCollector(os.environ[MULTIPROC_ENV]))
    for c in PAGE_COLLECTORS:
        registry.register(c)
    return registry
