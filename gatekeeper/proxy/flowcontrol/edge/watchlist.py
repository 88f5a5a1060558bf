"""A watch's initial state at the asyncio edge: a watch that sends every existing object first holds the LIST's
seats until the apiserver has sent them (docs/flowcontrol/index.md#watch-lists).

kube-apiserver's own APF releases a watch-list's seats when the watch is "initialized"; one served from etcd (a
resource without a watch cache, the seeds' incident) is initialized at once and then reads the whole collection from
storage holding nothing. The proxy reads the response instead, through the read ahead, so the seats go back when the
apiserver is done, not when a slow client is:

* a watch-list (``sendInitialEvents=true``): at its initial-events-end bookmark (``kube/watchlist.py``);
* a watch that sends the current state without marking its end (no ``resourceVersion``, or ``0``), or a
  watch-list in a format the proxy cannot read: when the apiserver has sent nothing for ``quiet_seconds`` (since
  its last bytes, or its response head) while the proxy was ready to read: it sends the existing objects as fast as
  it can. A watch served from etcd whose first object takes longer than that to read goes early;
* either way at most ``watchListSyncSeconds`` after the response head.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import Counter

from gatekeeper.kube.watchlist import InitialEventsEnd

SYNCS = Counter(
    "gatekeeper_flowcontrol_watch_list_syncs_total",
    "Watches that send the current state first (watch-lists and watches without a resourceVersion), by what ended "
    "their hold of the LIST's seats: bookmark (the apiserver's initial-events-end bookmark), quiet (the apiserver "
    "went quiet: no bookmark to read), timeout (watchListSyncSeconds passed first), ended (the response ended or "
    "failed first).",
    ["priority_level", "outcome"],
)


class WatchListSync:
    """One watch's initial sync. ``on_synced(nbytes)``: the seats may go; ``nbytes`` is the initial events' size,
    decoded (as the apiserver holds them, whatever encoding the client took), when the bookmark ended it, else -1."""

    __slots__ = ("_quiet_timer", "blocked", "last", "level", "on_synced", "outcome", "quiet", "scanner", "timer")

    def __init__(self, content_type: str, content_encoding: str, seconds: float, level: str,
                 on_synced: Callable[[int], None], *, bookmark: bool = True, quiet_seconds: float = 2.0) -> None:
        self.scanner = InitialEventsEnd(content_type, content_encoding)
        if not bookmark:
            self.scanner.supported = False  # nothing marks the end: the quiet rule decides
        self.level = level
        self.on_synced = on_synced
        self.outcome = ""
        self.quiet = quiet_seconds
        self.last = 0.0
        """When the last bytes came (the response head before the first): where quiet is counted from."""
        self.blocked: Callable[[], bool] = lambda: False
        """True while the read ahead waits for its client, not for the apiserver: silence then is not quiet."""
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(seconds, self._done, "timeout")
        self._quiet_timer: asyncio.TimerHandle | None = None
        if not self.scanner.supported:  # an empty collection sends nothing at all: quiet from the head
            self.last = loop.time()
            self._arm(self.quiet)

    def feed(self, chunk: bytes) -> bool:
        """Whether the sync is over, with ``chunk`` (the read ahead stops reading ahead when it is)."""
        if self.outcome:
            return True
        if self.scanner.supported:
            if self.scanner.feed(chunk):
                self._done("bookmark")
                return True
            if self.scanner.supported:
                return False
        first = self._quiet_timer is None  # the scanner gave up just now (a corrupt gzip stream)
        self.last = asyncio.get_running_loop().time()
        if first:
            self._arm(self.quiet)
        return False

    def _arm(self, delay: float) -> None:
        self._quiet_timer = asyncio.get_running_loop().call_later(delay, self._check_quiet)

    def _check_quiet(self) -> None:
        """One timer per watch, re-armed to the last bytes' time: not one per chunk."""
        if self.outcome:
            return
        silent = asyncio.get_running_loop().time() - self.last
        if silent >= self.quiet and not self.blocked():
            self._done("quiet")
        else:
            self._arm(max(0.01, self.quiet - silent) if silent < self.quiet else self.quiet)

    def ended(self) -> None:
        """The response is over before the state was sent: the request's own end gives the seats back."""
        if not self.outcome:
            self.outcome = "ended"
            self._cancel()
            SYNCS.labels(self.level, "ended").inc()

    def _cancel(self) -> None:
        self.timer.cancel()
        if self._quiet_timer is not None:
            self._quiet_timer.cancel()

    def _done(self, outcome: str) -> None:
        if self.outcome:
            return
        self.outcome = outcome
        self._cancel()
        SYNCS.labels(self.level, outcome).inc()
        self.on_synced(self.scanner.decoded if outcome == "bookmark" else -1)
