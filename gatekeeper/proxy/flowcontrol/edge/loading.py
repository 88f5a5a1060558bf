"""Turn ``proxy.flowControl`` settings into a :class:`Policy`, and keep it current.

Reloads happen on SIGHUP and when a policy file's modification time or size
changes (polled). A reload that fails validation leaves the running policy in
place and logs the reason, so a typo in production never drops protection.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from gatekeeper.config import load_yaml_all
from gatekeeper.proxy.flowcontrol.core.controller import Limits
from gatekeeper.proxy.flowcontrol.core.objects import ObjectError
from gatekeeper.proxy.flowcontrol.core.policy import Policy, build_policy, split_objects
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings

log = logging.getLogger("gatekeeper.proxy.flowcontrol")


def limits_of(settings: FlowControlSettings) -> Limits:
    return Limits(
        server_concurrency_limit=settings.server_concurrency_limit,
        queue_wait_seconds=settings.queue_wait_seconds,
        bytes_per_seat=settings.bytes_per_seat,
        max_seats=settings.max_seats,
        list_bytes_cap=settings.list_bytes_cap,
        storage_only_resources=frozenset(settings.storage_only_resources),
    )


def read_objects(path: str) -> list[tuple[str, Any]]:
    """All objects of a multi-document YAML file, labelled ``path[doc]``; errors name the file.

    Read with the shared bounded reader (:func:`gatekeeper.config.load_yaml_all`): a reload runs on the
    serving event loop, so an oversized file or an alias bomb must fail (keeping the running policy),
    not freeze the worker or exhaust its memory."""
    return split_objects(load_yaml_all(path, what="flow-control policy file"), path)


def load_policy(settings: FlowControlSettings) -> Policy:
    """Validate inline objects and files together; raises ValueError naming file, object and field."""
    objects: list[tuple[str, Any]] = []
    objects += [(f"flowSchemas[{i}]", o) for i, o in enumerate(settings.flow_schemas)]
    objects += [(f"priorityLevelConfigurations[{i}]", o) for i, o in enumerate(settings.priority_level_configurations)]
    for path in settings.files:
        objects += read_objects(path)
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


class Reloader:
    """Re-reads the policy files when they change (``check``) or on demand (``reload``)."""

    def __init__(self, settings: FlowControlSettings, apply: Callable[[Policy], None]) -> None:
        self.settings = settings
        self.apply = apply
        self.stamp = _stamp(settings.files)
        self.last_error = ""

    def reload(self, why: str = "SIGHUP") -> bool:
        """Counted in ``gatekeeper_flowcontrol_policy_reloads_total{result}``; a failure also sets
        ``..._policy_reload_failing`` until a reload applies (metrics imported here: this module is
        imported before a supervisor sets ``PROMETHEUS_MULTIPROC_DIR``)."""
        from gatekeeper.proxy.flowcontrol.edge import metrics

        self.stamp = _stamp(self.settings.files)
        try:
            policy = load_policy(self.settings)
        except ValueError as exc:
            self.last_error = str(exc)
            metrics.POLICY_RELOADS.labels("failed").inc()
            metrics.POLICY_STALE.set(1)
            log.error("flow-control reload (%s) failed; keeping the running policy: %s", why, exc)
            return False
        self.last_error = ""
        self.apply(policy)
        metrics.POLICY_RELOADS.labels("applied").inc()
        metrics.POLICY_STALE.set(0)
        log.info(
            "flow-control policy reloaded (%s): %d FlowSchemas, %d priority levels",
            why,
            len(policy.schemas),
            len(policy.levels),
        )
        return True

    def check(self) -> bool:
        """Reload if any file's mtime or size changed; True if a reload happened and succeeded."""
        if _stamp(self.settings.files) == self.stamp:
            return False
        return self.reload("file changed")
