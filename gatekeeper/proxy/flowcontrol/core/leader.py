"""One writer at a time through a Lease, with client-go's leader-election rules (pure, the clock passed in).

Whoever holds the Lease renews it; the others take it over only once it has not changed for its whole duration,
judged by their own clock from when they saw it change (clocks of different nodes are never compared). A holder
stops writing when it could not renew for ``renew_deadline`` (two thirds of the duration, as client-go's 10 s of
15 s), so it has stopped before anyone else may take over. Writes carry the resourceVersion read, so of two
proxies racing for a free Lease exactly one wins; the API server is the arbiter, as for kube-controller-manager.
"""

from __future__ import annotations

from typing import Literal

from gatekeeper.proxy.flowcontrol.core.fleet import LeaseView

Action = Literal["create", "renew", "acquire", "follow"]


class LeaderElection:
    """Decides, from the Lease as read, whether to create, renew, take over or leave it alone."""

    def __init__(self, me: str, duration: float) -> None:
        self.me = me
        self.duration = duration
        self.renew_deadline = duration * 2 / 3
        self._seen: tuple[str, str] | None = None
        """(holder, renewTime) as last read."""
        self._seen_changed = float("-inf")
        self._renewed_at = float("-inf")
        """Local time of our last successful write as holder."""

    def observe(self, record: LeaseView | None, now: float) -> Action:
        """What to do with the Lease as just read (None: it does not exist)."""
        if record is None:
            self._seen = None
            return "create"
        seen = (record.holder, record.renew_time)
        if seen != self._seen:
            self._seen, self._seen_changed = seen, now
        if record.holder == self.me:
            return "renew"
        duration = record.duration_seconds if record.duration_seconds > 0 else self.duration
        if not record.holder or now - self._seen_changed >= duration:
            return "acquire"
        return "follow"

    def wrote(self, now: float) -> None:
        """Our create, renewal or takeover went through."""
        self._renewed_at = now

    def lost(self) -> None:
        """Someone else holds it (a conflict, or we released it)."""
        self._renewed_at = float("-inf")

    def leading(self, now: float) -> bool:
        return now - self._renewed_at < self.renew_deadline

    def holder(self) -> str:
        return self._seen[0] if self._seen else ""
