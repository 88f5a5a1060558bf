"""prometheus-client's multiprocess sample directory: made private, emptied, locked.

Nothing here imports prometheus_client: importing the library picks the value class (in-process or mmap files)
once, so a command calls :func:`enable_multiprocess` first and only then imports the modules that define
metrics (``gatekeeper.runtime.metrics`` and every component's collectors)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from gatekeeper.base.errors import UsageError
from gatekeeper.runtime import tempdirs

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LOCK_FILE = ".gatekeeper-merge.lock"
"""Beside the sample files: scrapes read under a shared lock, ``gatekeeper.runtime.metrics.absorb_dead_process`` writes
under an exclusive one, so no scrape ever sees a dead process's counts both in its own file and in the archive."""
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


@contextlib.contextmanager
def multiprocess_mode(prefix: str = "gatekeeper-metrics-") -> Iterator[str]:
    """:func:`enable_multiprocess` for a command's life; the directory goes afterwards unless it was inherited (an
    inherited one belongs to whoever set ``PROMETHEUS_MULTIPROC_DIR``)."""
    inherited = bool(os.environ.get(MULTIPROC_ENV))
    path = enable_multiprocess(prefix)
    try:
        yield path
    finally:
        if not inherited:
            shutil.rmtree(path, ignore_errors=True)


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
def merge_lock(path: str, kind: int) -> Iterator[None]:
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


MMAP_HEADER_BYTES = 8
"""A prometheus-client ``.db`` file shorter than its header is one a process is creating right now."""
