"""How fast each caller may start new watches: a token bucket per caller and FlowSchema (pure, the caller passes
the clock).

Neither ``--max-requests-inflight`` nor APF limits new watches upstream (kubernetes#98423): a watch holds its seat
only while it starts, so a flow that opens thousands at once (a rollout of pods that each watch, a controller
restarted in a loop) gets them all, and every one costs the apiserver a watcher and its buffers for its whole life.
A bucket per caller and FlowSchema lets it start ``burst`` watches at once and ``rate`` per second after that (per
caller, not per flow: a schema without a distinguisher would let one caller spend every caller's watches, and a
ByNamespace one would give a caller a fresh burst per namespace, made-up ones included). Buckets are bounded: past
``max_flows`` the least recently used goes, which only forgets a caller's debt (a new bucket starts full), so
memory cannot grow.
"""

from __future__ import annotations

import math


class WatchStarts:
    """Token buckets keyed by (schema, caller) hash; ``rate`` 0 turns the limit off."""

    __slots__ = ("_buckets", "burst", "max_flows", "rate")

    def __init__(self, rate: float, burst: int, max_flows: int) -> None:
        self.rate = rate
        self.burst = max(1, burst)
        self.max_flows = max(1, max_flows)
        self._buckets: dict[int, tuple[float, float]] = {}
        """key -> (tokens, time of the last update); insertion order is recency of use."""

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, flow: int, now: float) -> float:
        """Start one watch of ``flow`` (a schema and caller) at ``now``: 0.0 if it may, else the seconds until it
        could."""
        if self.rate <= 0:
            return 0.0
        tokens, then = self._buckets.pop(flow, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - then) * self.rate)
        if tokens >= 1.0:
            tokens -= 1.0
            wait = 0.0
        else:
            wait = (1.0 - tokens) / self.rate
        if tokens < self.burst:  # a full bucket is the same as none: keep only flows that owe something
            self._buckets[flow] = (tokens, now)
            if len(self._buckets) > self.max_flows:
                del self._buckets[next(iter(self._buckets))]
        return wait


def retry_after(wait: float) -> int:
    """Whole seconds for a 429's Retry-After (client-go retries only when it is present; at least 1)."""
    return max(1, math.ceil(wait))
