"""Per-connection HTTP/2 abuse accounting (pure): which frames count, and when a client is over its limit.

PING, SETTINGS, RST_STREAM (rapid reset, CVE-2023-44487), frames on closed streams and empty frames each make the server
work at almost no cost to the client. Past a kind's limit the codec raises :class:`FloodError` (GOAWAY
ENHANCE_YOUR_CALM). CONTINUATION floods (CVE-2024-27316) are bounded in the codec."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gatekeeper.proxy.h2wire.errors import ErrorCodes, ProtocolError
from gatekeeper.proxy.listen.settings import ProtocolSettings

RST_STREAM = "rst_stream"
PING = "ping"
SETTINGS = "settings"
EMPTY_FRAME = "empty_frame"
CLOSED_STREAM = "closed_stream"
KINDS = (RST_STREAM, PING, SETTINGS, EMPTY_FRAME, CLOSED_STREAM)


class FloodError(ProtocolError):
    """A client went over one of its per-interval frame limits; h2 answers GOAWAY ENHANCE_YOUR_CALM."""

    error_code = ErrorCodes.ENHANCE_YOUR_CALM

    def __init__(self, kind: str, count: int, interval: float) -> None:
        super().__init__(f"more than {count - 1} {kind} frames in {interval:g}s")
        self.kind = kind


def limits_of(settings: ProtocolSettings) -> dict[str, int]:
    return {
        RST_STREAM: settings.h2_max_resets_per_interval,
        PING: settings.h2_max_pings_per_interval,
        SETTINGS: settings.h2_max_settings_per_interval,
        EMPTY_FRAME: settings.h2_max_empty_frames_per_interval,
        CLOSED_STREAM: settings.h2_max_closed_stream_frames_per_interval,
    }


@dataclass
class FloodGuard:
    """Sliding-window counters per frame kind; :meth:`count` raises :class:`FloodError` past a limit.

    Sliding, not fixed, so a burst straddling a window boundary cannot pass twice the limit: the previous window weighs
    in proportion to its overlap. It may refuse a little early, never late."""

    limits: dict[str, int]
    interval: float
    clock: Callable[[], float] = time.monotonic
    _start: float = field(default=float("-inf"))
    _counts: dict[str, int] = field(default_factory=dict)
    _previous: dict[str, int] = field(default_factory=dict)

    def count(self, kind: str) -> None:
        now = self.clock()
        elapsed = now - self._start
        if elapsed >= self.interval:
            if elapsed < 2 * self.interval:  # the next window: the one that ended still weighs on it
                self._previous, self._start = self._counts, self._start + self.interval
            else:  # a quiet window or more (or the first frame): nothing carries over
                self._previous, self._start = {}, now
            self._counts = {}
            elapsed = now - self._start
        n = self._counts.get(kind, 0) + 1
        self._counts[kind] = n
        carried = self._previous.get(kind, 0)
        limit = self.limits[kind]
        if n > limit or (carried and n + carried * (1 - elapsed / self.interval) > limit):
            raise FloodError(kind, limit + 1, self.interval)
