"""Waiting for a sandbox process to become healthy, shared by ``up`` and the add-ons.

A module of its own so that the add-ons (``with_webhook``, ``with_proxy``) and
``lifecycle`` (which starts them) both import it, instead of each other.
"""

from __future__ import annotations

from collections.abc import Callable

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import ProcessRecord


class ComponentFailed(Exception):
    """One component did not become healthy; carries its name and what was seen last."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"{name}: {detail}")
        self.name = name
        self.detail = detail


def wait_until(
    rec: ProcessRecord | None, name: str, check: Callable[[], tuple[bool, str]], timeout: float,
    *, interval: float = 0.5,
) -> None:
    """Poll ``check`` until it passes; fail fast if the process has already exited.

    ``name`` starts with the process's record name (``"webhook (/readyz)"``), so a failed ``up``
    prints that process's log tail (``lifecycle._report_failure``); add-ons wait with this too.
    """
    try:
        processes.poll_until(check, timeout, pid=rec.pid if rec is not None else None, interval=interval)
    except processes.WaitFailed as exc:
        if exc.exited and rec is not None:
            raise ComponentFailed(name, f"process {rec.pid} exited (last check: {exc.detail})") from None
        raise ComponentFailed(name, f"not healthy after {timeout:.0f}s: {exc.detail}") from None
