"""Prometheus exposition shared by the components (a thin layer over prometheus-client).

Components define their collectors on the default registry. With several
worker processes (``--workers N``), each process only counts its own reviews;
prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set
*before* prometheus_client is imported, see :func:`enable_multiprocess`) makes
every process write its samples to files that :func:`render` aggregates, so a
scrape that lands on any worker reports the whole server. No HTTP here: the
aiohttp routes are in ``gatekeeper.ops``.

This module is imported before the mode is known, so every ``prometheus_client`` import here is
inside the function that needs it: importing the library picks the value class (in-process or
mmap files) once, and an import at the top would pick it before ``enable_multiprocess`` ran.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gatekeeper import __version__, tempdirs
from gatekeeper.errors import UsageError

if TYPE_CHECKING:  # imported lazily at run time: PROMETHEUS_MULTIPROC_DIR must be set first
    from prometheus_client import CollectorRegistry

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LOCK_FILE = ".gatekeeper-merge.lock"
"""Beside the sample files: scrapes read under a shared lock, :func:`absorb_dead_process` writes under an
exclusive one, so no scrape ever sees a dead process's counts both in its own file and in the archive."""
ARCHIVE = "archive"
"""``counter_archive.db`` / ``histogram_archive.db``: the summed counts of every dead process."""


def enable_multiprocess(prefix: str = "gatekeeper-metrics-") -> str:
    """Point prometheus-client at a clean directory; call before importing prometheus_client.

    An inherited ``PROMETHEUS_MULTIPROC_DIR`` (e.g. an emptyDir that survives container restarts)
    is emptied of sample files first: samples of dead processes would otherwise be summed forever.
    It must be a real directory owned by this user (see :func:`_own_private_dir`): every process
    opens files there read-write by predictable names, so whoever else can write it can forge the
    page or point a ``counter_<pid>.db`` symlink at one of our files for prometheus-client to resize.
    Call it once, in the parent, before any worker starts.
    """
    inherited = os.environ.get(MULTIPROC_ENV)
    path = inherited or str(tempdirs.make(prefix))  # stamped: a later start removes it if we are SIGKILLed
    if inherited:
        with contextlib.suppress(FileExistsError):
            os.makedirs(path, mode=0o700)
        problem = _own_private_dir(path)
        if problem:
            raise UsageError(f"{MULTIPROC_ENV}={path}: {problem}; use a directory only this user can write")
    for stale in Path(path).glob("*.db"):
        stale.unlink(missing_ok=True)
    os.environ[MULTIPROC_ENV] = path
    return path


def _own_private_dir(path: str) -> str:
    """'' if ``path`` is a directory (not a symlink) owned by this user, made 0700 here; else what is wrong.

    A directory we own but others may write (an emptyDir is 0777) is closed first: permissions are checked
    on every create, so nothing can be added after the chmod, and the stale-file sweep that follows removes
    whatever was planted before it (``*.db`` symlinks included: unlink removes the link)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot inspect it: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return ""


@contextlib.contextmanager
def _merge_lock(path: str, kind: int) -> Iterator[None]:
    """The sample directory's lock (``LOCK_SH`` to read, ``LOCK_EX`` to fold files); no lock if it cannot be made."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, kind)
        yield
    finally:
        os.close(fd)  # drops the lock


def absorb_dead_process(pid: int, path: str | None = None) -> None:
    """Fold a dead process's counter and histogram files into the archive files and remove them.

    prometheus-client keeps one ``counter_<pid>.db`` and ``histogram_<pid>.db`` per process forever (only
    live gauges go with ``mark_process_dead``), so a worker in a restart loop grew the directory by two
    files per restart and every scrape merged all of them. Summing the dead process's values into
    ``<type>_archive.db`` keeps its counts on the page (counters never go backwards) in a bounded number
    of files. Only the supervisor calls this, for a process it has reaped (nobody writes those files)."""
    from prometheus_client import multiprocess
    from prometheus_client.mmap_dict import MmapedDict

    path = path or os.environ[MULTIPROC_ENV]
    with _merge_lock(path, fcntl.LOCK_EX):
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
    """``gatekeeper_build_info{version} 1`` on the process's registry, once (the webhook and the proxy call it
    when they define their metrics): which build answers, for a rollout to be checked from ``/metrics``. Its
    multiprocess mode is ``livemax``: every live worker's 1 merges into one sample, and a dead worker's file
    goes with it (``mark_process_dead``), so restarts do not grow the metrics directory."""
    from prometheus_client import Gauge

    info = Gauge("gatekeeper_build_info", "The running gatekeeper's version (value 1).", ["version"],
                 multiprocess_mode="livemax")
    info.labels(__version__).set(1)
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

        with _merge_lock(self.path, fcntl.LOCK_SH):
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
