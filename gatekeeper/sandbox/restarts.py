"""Restart an OOM-killed apiserver the way a kubelet restarts a container: after a back-off that doubles.

kubelet's crash back-off starts at 10 s, doubles per restart up to 5 min, and starts over once the container
has run 10 min. The decision is pure (:class:`BackOff`); :mod:`supervisor` does the watching and starting.
Only a kill the cgroup counted (``oom_kill`` grew) is restarted: a deliberate stop (``sandbox down``, a
benchmark's own restart with new flags) is not a crash and is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INITIAL_SECONDS = 10.0
MAX_SECONDS = 300.0
RESET_AFTER_SECONDS = 600.0


@dataclass
class BackOff:
    """One process's restart state."""

    initial: float = INITIAL_SECONDS
    maximum: float = MAX_SECONDS
    reset_after: float = RESET_AFTER_SECONDS
    restarts: int = 0
    started_at: float = 0.0
    delay: float = field(init=False, default=0.0)
    due: float | None = None
    """When the pending restart may run (None: none pending)."""

    def __post_init__(self) -> None:
        self.delay = self.initial

    def killed(self, now: float) -> float:
        """An OOM kill seen at ``now``: when to restart. The delay doubles per kill, and starts over after a
        run of ``reset_after`` seconds."""
        if self.started_at and now - self.started_at >= self.reset_after:
            self.delay = self.initial
        self.due = now + self.delay
        wait = self.delay
        self.delay = min(self.maximum, self.delay * 2)
        return wait

    def ready(self, now: float) -> bool:
        return self.due is not None and now >= self.due

    def restarted(self, now: float) -> None:
        self.restarts += 1
        self.started_at = now
        self.due = None
