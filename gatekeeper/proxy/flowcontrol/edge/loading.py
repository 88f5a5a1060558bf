"""Turn ``proxy.flowControl`` settings into a :class:`Policy`, and keep it current (SIGHUP, file polling).

A failed reload keeps the running policy, so a typo in production never drops protection; parsing runs on a
thread so the serving loop keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from gatekeeper.base.errors import NotRegularFile
from gatekeeper.base.yamlfiles import load_yaml_all
from gatekeeper.proxy.flowcontrol.core.controller import LevelLimits
from gatekeeper.proxy.flowcontrol.core.objects import ObjectError
from gatekeeper.proxy.flowcontrol.core.policy import Policy, build_policy, split_objects
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings

log = logging.getLogger("gatekeeper.proxy.flowcontrol")
T = TypeVar("T")


def limits_of(settings: FlowControlSettings) -> LevelLimits:
    return LevelLimits(
        server_concurrency_limit=settings.server_concurrency_limit,
        queue_wait_seconds=settings.queue_wait_seconds,
        bytes_per_seat=settings.bytes_per_seat,
        max_seats=settings.max_seats,
        list_bytes_cap=settings.list_bytes_cap,
        storage_only_resources=frozenset(settings.storage_only_resources),
        expensive_lists_per_backend=settings.expensive_lists.max_in_flight_per_backend,
        expensive_list_bytes=settings.expensive_lists.min_bytes,
        watch_starts_per_second=settings.watch_starts.per_flow_per_second,
        watch_start_burst=settings.watch_starts.burst,
        watch_start_flows=settings.watch_starts.max_flows,
    )


def load_policy(settings: FlowControlSettings) -> Policy:
    """Validate inline objects and files together; raises ValueError naming file, object and field."""
    objects: list[tuple[str, Any]] = []
    objects += [(f"flowSchemas[{i}]", o) for i, o in enumerate(settings.flow_schemas)]
    objects += [(f"priorityLevelConfigurations[{i}]", o) for i, o in enumerate(settings.priority_level_configurations)]
    for path in settings.files:
        # Bounded reader and regular files only: an oversized file, an alias bomb or a FIFO must fail the reload,
        # not stall or exhaust the serving worker. Objects are labelled ``path[doc]``.
        objects += split_objects(load_yaml_all(path, what="flow-control policy file", regular_only=True), path)
    try:
        return build_policy(objects, settings.server_concurrency_limit)
    except ObjectError as exc:
        where = _origin(objects, exc)
        raise ValueError(f"{where}{exc}") from None


def _origin(objects: list[tuple[str, Any]], exc: ObjectError) -> str:
    """Prefix an object error with where the object came from (file and document index)."""
    kind, _, name = exc.obj.partition("/")
    for label, obj in objects:
        if isinstance(obj, dict) and obj.get("kind") == kind and (obj.get("metadata") or {}).get("name") == name:
            return f"{label}: "
    return ""


def _stamp(paths: list[str]) -> tuple[tuple[str, float, int], ...]:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((p, st.st_mtime, st.st_size))
        except OSError:
            out.append((p, -1.0, -1))
    return tuple(out)


def _on_a_thread(fn: Callable[[], T], on_exit: Callable[[], None] = lambda: None) -> asyncio.Future[T]:
    """``fn()`` on a daemon thread of its own, its outcome delivered on the loop (``on_exit`` when it ends). Not a
    pool: pool threads are joined at exit, so a parse stuck on a hung mount would keep the worker from exiting."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def deliver(result: T | None, error: BaseException | None) -> None:
        on_exit()
        if fut.cancelled():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # delivered to the awaiting task, which logs it
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(deliver, result, error)

    threading.Thread(target=run, name="gatekeeper-policy-reload", daemon=True).start()
    return fut


class ReloadGivenUp(ValueError):
    """A reload not run to the end: ``reason`` is ``timeout`` or ``stuck``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Reloader:
    """Re-reads the policy files when they change (``check``) or on demand (``reload``, ``request``). Reloads are
    serialized and coalesce, so an older parse never finishes last and wins; at most ``maxStuckReloads`` given-up
    parses may run, so SIGHUPs on a hung mount do not pile up threads."""

    def __init__(self, settings: FlowControlSettings, apply: Callable[[Policy], None]) -> None:
        self.settings = settings
        self.apply = apply
        self.stamp = _stamp(settings.files)
        self._pending: str | None = None
        """Why the next reload was asked for (None: none asked since the running one began)."""
        self._task: asyncio.Task[None] | None = None
        self._stuck = 0
        """Given-up parses whose threads still run."""
        self._deferred: str | None = None
        """Why a reload was asked for while ``maxStuckReloads`` parses were stuck: it starts when one ends."""

    def reload(self, why: str = "SIGHUP") -> bool:
        """Parse, validate and apply here and now (tests and tools; serving code calls :meth:`request`)."""
        self.stamp = _stamp(self.settings.files)
        return self._finish(why, _parse(self.settings))

    def request(self, why: str = "SIGHUP") -> None:
        """Reload off the event loop (the SIGHUP handler and the file poll call this on the loop)."""
        self._pending = why
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gatekeeper-flowcontrol-reload")

    async def wait(self) -> None:
        """Until no reload is running or asked for (tests)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    def cancel(self) -> None:
        """Stop reloading (the worker is closing); a parse already on the thread finishes there, unused."""
        self._pending = self._deferred = None
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while self._pending is not None:
            why, self._pending = self._pending, None
            limit = self.settings.max_stuck_reloads
            if self._stuck >= limit:
                if self._deferred is None:  # once per wait: the file poll asks again every reloadIntervalSeconds
                    self._report(why, ReloadGivenUp("stuck", f"{self._stuck} earlier reload(s) of {self._files()} "
                                                    f"are still running past reloadTimeoutSeconds (maxStuckReloads "
                                                    f"{limit}); this one starts when one of them ends"))
                self._deferred = why
                return
            self.stamp = _stamp(self.settings.files)  # before reading: a change during the parse is seen again
            given_up = [False]  # this parse's own cell: read by its thread's end, after later parses began
            timeout = self.settings.reload_timeout_seconds
            parse = _on_a_thread(functools.partial(_parse, self.settings),
                                 on_exit=functools.partial(self._parse_ended, given_up))
            try:
                result = await asyncio.wait_for(asyncio.shield(parse), timeout)
            except TimeoutError:
                given_up[0] = True
                self._stuck += 1
                parse.cancel()  # its late result is dropped: a newer reload may have applied meanwhile
                result = ReloadGivenUp("timeout", f"reading and validating {self._files()} did not finish within "
                                       f"{timeout:g}s (reloadTimeoutSeconds): a file on a hung mount? Given up; "
                                       "the next reload runs on a fresh thread")
            except Exception:  # not a policy error (those are results): the thread itself failed
                log.exception("flow-control reload (%s) failed; keeping the running policy", why)
                result = ValueError("the reload failed unexpectedly (see the log)")
            try:
                self._finish(why, result)
            except Exception:  # a bug in the swap: logged, and the next request still runs
                log.exception("flow-control reload (%s): applying the policy failed", why)

    def _parse_ended(self, given_up: list[bool]) -> None:
        """A parse's thread ended: a given-up slot is free again, and a reload refused as ``stuck`` starts now."""
        if not given_up[0]:
            return
        self._stuck -= 1
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            self.request(deferred)

    def _files(self) -> str:
        return ", ".join(self.settings.files) or "the inline objects"

    def _report(self, why: str, error: ValueError) -> None:
        """Count and log a failed reload (the running policy stays)."""
        from gatekeeper.proxy.flowcontrol.edge import metrics  # imported after PROMETHEUS_MULTIPROC_DIR is set

        reason = (error.reason if isinstance(error, ReloadGivenUp)
                  else "not_regular_file" if isinstance(error, NotRegularFile) else "invalid")
        metrics.POLICY_RELOADS.labels("failed").inc()
        metrics.POLICY_RELOAD_FAILURES.labels(reason).inc()
        metrics.POLICY_STALE.set(1)
        log.error("flow-control reload (%s) failed; keeping the running policy: %s", why, error)

    def _finish(self, why: str, result: Policy | ValueError) -> bool:
        """Apply a parsed policy, or count and log why not; on the event loop (``apply`` wakes requests)."""
        from gatekeeper.proxy.flowcontrol.edge import metrics  # imported after PROMETHEUS_MULTIPROC_DIR is set

        if isinstance(result, ValueError):
            self._report(why, result)
            return False
        self.apply(result)
        metrics.POLICY_RELOADS.labels("applied").inc()
        metrics.POLICY_STALE.set(0)
        log.info(
            "flow-control policy reloaded (%s): %d FlowSchemas, %d priority levels",
            why,
            len(result.schemas),
            len(result.levels),
        )
        return True

    def changed(self) -> bool:
        """Whether any file's mtime or size differs from when the last reload began reading."""
        return _stamp(self.settings.files) != self.stamp

    def check(self) -> bool:
        """Reload here if any file's mtime or size changed; True if a reload happened and succeeded."""
        return self.changed() and self.reload("file changed")


def _parse(settings: FlowControlSettings) -> Policy | ValueError:
    """The policy the files and inline objects make now, or why not (runs on the reload thread)."""
    try:
        return load_policy(settings)
    except ValueError as exc:
        return exc
