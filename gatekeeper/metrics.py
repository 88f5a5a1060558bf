"""Prometheus exposition shared by the components (a thin layer over prometheus-client).

Components define their collectors on the default registry. With several
worker processes (``--workers N``), each process only counts its own reviews;
prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set
*before* prometheus_client is imported, see :func:`enable_multiprocess`) makes
every process write its samples to files that :func:`render` aggregates, so a
scrape that lands on any worker reports the whole server. No HTTP here: the
aiohttp routes are in ``gatekeeper.ops``.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily at run time: PROMETHEUS_MULTIPROC_DIR must be set first
    from prometheus_client import CollectorRegistry

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def enable_multiprocess(prefix: str = "gatekeeper-metrics-") -> str:
    """Point prometheus-client at a clean directory; call before importing prometheus_client.

    An inherited ``PROMETHEUS_MULTIPROC_DIR`` (e.g. an emptyDir that survives container restarts)
    is emptied of sample files first: samples of dead processes would otherwise be summed forever.
    Call it once, in the parent, before any worker starts.
    """
    path = os.environ.get(MULTIPROC_ENV) or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(path, exist_ok=True)
    for stale in Path(path).glob("*.db"):
        stale.unlink(missing_ok=True)
    os.environ[MULTIPROC_ENV] = path
    return path


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
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    if os.environ.get(MULTIPROC_ENV):
        return generate_latest(multiprocess_registry()), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


MMAP_HEADER_BYTES = 8
"""A prometheus-client ``.db`` file shorter than its header is one a process is creating right now."""


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
        from prometheus_client import multiprocess

        files = []
        for name in glob.glob(os.path.join(self.path, "*.db")):
            with contextlib.suppress(OSError):  # a live gauge's file removed since the glob
                if os.path.getsize(name) >= MMAP_HEADER_BYTES:
                    files.append(name)
        return multiprocess.MultiProcessCollector.merge(files, accumulate=True)


def multiprocess_registry() -> CollectorRegistry:
    """A registry holding every process's samples (``PROMETHEUS_MULTIPROC_DIR``)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(WrittenFilesCollector(os.environ[MULTIPROC_ENV]))
    return registry
