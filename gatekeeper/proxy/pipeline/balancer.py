"""Which apiserver gets the next request (pure: no sockets, injectable clock and RNG); docs/proxy/index.md.

The seeds' incident was a TCP balancer of *connections*: one apiserver ended with 37 long-lived HTTP/2
connections, another with thousands. So every request is placed on its own, by power of two choices (pure
least-in-flight herds when many proxies see the same minimum), with open watches counted as in flight. A
connect-failure ejection is lifted by a successful probe; a 5xx one waits out its time. Skew ratios are
``(max + 1) / (min + 1)`` so idle backends give 1.0, not a division by zero.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from gatekeeper.proxy.pipeline.settings import BackendSettings

Clock = Callable[[], float]


@dataclass(frozen=True)
class EjectionPolicy:
    """Passive ejection and active health thresholds."""

    base_ejection_seconds: float = 1.0
    """First ejection length; doubles for each further ejection."""
    max_ejection_seconds: float = 30.0
    """Cap on one ejection."""
    storm_window_seconds: float = 10.0
    """Window in which 5xx responses are counted."""
    storm_min_responses: int = 10
    """Fewest responses in the window before a storm can be declared."""
    storm_ratio: float = 0.5
    """Share of 5xx responses in the window that ejects the backend."""
    unhealthy_threshold: int = 2
    """Consecutive failed /readyz probes that take a backend out."""
    rate_window_seconds: float = 60.0
    """Window of the per-backend request-rate skew gauge."""


STORM_STATUSES = frozenset({500, 502, 503})
"""The statuses a storm is made of. Not 504: any client can get one at once (``?timeout=1ns``, even anonymous,
or a future ``resourceVersion``), so one tenant's GETs would eject apiservers."""


class RateWindow:
    """Events per one-second bucket over a sliding window; memory is O(window), not O(events)."""

    def __init__(self, seconds: float, clock: Clock) -> None:
        self.seconds = max(1, int(seconds))
        self.clock = clock
        self.buckets: deque[list[int]] = deque()  # [second, count]

    def _trim(self, now_s: int) -> None:
        while self.buckets and self.buckets[0][0] <= now_s - self.seconds:
            self.buckets.popleft()

    def add(self) -> None:
        now_s = int(self.clock())
        self._trim(now_s)
        if self.buckets and self.buckets[-1][0] == now_s:
            self.buckets[-1][1] += 1
        else:
            self.buckets.append([now_s, 1])

    def count(self) -> int:
        self._trim(int(self.clock()))
        return sum(c for _, c in self.buckets)


@dataclass
class Backend:
    """One apiserver and everything the balancer knows about it."""

    name: str
    url: str
    weight: int
    rate: RateWindow
    """Requests in the last ``rate_window_seconds`` (the request-rate skew gauge)."""
    in_flight: int = 0
    watches: int = 0
    connect_failures_total: int = 0
    ejections_total: int = 0
    ready: bool = True
    """Last verdict of the active /readyz probe (after thresholds)."""
    probe_failures: int = 0
    ejected_until: float = 0.0
    ejection_reason: Literal["", "connect", "5xx"] = ""
    ejection_streak: int = 0
    healthy_since: float = 0.0
    responses: deque[tuple[float, bool]] = field(default_factory=deque)
    """(time, was_5xx) inside the storm window."""
    bad_responses: int = 0
    """How many of ``responses`` were 5xx (kept as a running count: no scan per response)."""

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def eligible(self, now: float) -> bool:
        return self.ready and not self.ejected(now)

    @property
    def load(self) -> float:
        return (self.in_flight + 1) / self.weight


@dataclass
class Lease:
    """One request's hold on a backend; ``release`` is idempotent (and a ``ProxyResponse.on_complete`` callback)."""

    balancer: Balancer
    backend: Backend
    long_running: bool
    released: bool = False
    caller: str = ""
    """Who holds it, for a long-running lease (:meth:`Balancer.long_running_of`)."""

    def release(self, _error: BaseException | None = None) -> None:
        if not self.released:
            self.released = True
            self.balancer._release(self)


@dataclass(frozen=True)
class Skew:
    """Imbalance across eligible backends; 1.0 is even."""

    in_flight_ratio: float
    rate_ratio: float


class Balancer:
    """Backends, their health and load, and the per-request choice."""

    def __init__(
        self,
        backends: Sequence[BackendSettings],
        *,
        policy: EjectionPolicy | None = None,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if not backends:
            raise ValueError("at least one backend is required")
        self.policy = policy or EjectionPolicy()
        self.clock = clock
        self.rng = rng or random.Random()
        self.backends: list[Backend] = []
        seen: set[str] = set()
        for s in backends:
            if s.weight < 1:
                raise ValueError(f"backend {s.url}: weight must be >= 1, got {s.weight}")
            name = s.name or urlsplit(s.url).netloc or s.url
            if name in seen:
                raise ValueError(f"backend {s.url}: duplicate name {name!r}")
            seen.add(name)
            self.backends.append(
                Backend(name=name, url=s.url.rstrip("/"), weight=s.weight,
                        rate=RateWindow(self.policy.rate_window_seconds, clock), healthy_since=clock())
            )
        self.by_name = {b.name: b for b in self.backends}
        self._equal_weights = len({b.weight for b in self.backends}) == 1
        self._long_running_callers: dict[str, int] = {}
        """Open long-running leases per caller (entries at 0 are removed: bounded by what is open)."""

    # --- choice -----------------------------------------------------------------------------

    def candidates(self, exclude: frozenset[str] | set[str] = frozenset()) -> list[Backend]:
        now = self.clock()
        pool = [b for b in self.backends if b.name not in exclude] if exclude else self.backends
        eligible = [b for b in pool if b.ready and now >= b.ejected_until]  # Backend.eligible, inlined
        if eligible:
            return eligible
        ready = [b for b in pool if b.ready]  # panic: ignore passive ejection
        return ready or pool

    def by_load(self) -> list[str]:
        """Eligible backends, least loaded first: where flow control reserves an expensive LIST's apiserver."""
        return [b.name for b in sorted(self.candidates(), key=lambda b: b.load)]

    def _weighted_pick(self, pool: list[Backend]) -> Backend:
        total = sum(b.weight for b in pool)
        x = self.rng.random() * total
        for b in pool:
            x -= b.weight
            if x < 0:
                return b
        return pool[-1]

    def choose(self, exclude: frozenset[str] | set[str] = frozenset()) -> Backend | None:
        """Power of two choices on in-flight/weight among eligible backends; None if all are excluded."""
        pool = self.candidates(exclude)
        if not pool:
            return None
        n = len(pool)
        if n == 1:
            return pool[0]
        if self._equal_weights:
            # The weighted picks below, for equal weights: one uniform pick, then one among the rest.
            i = min(int(self.rng.random() * n), n - 1)
            j = min(int(self.rng.random() * (n - 1)), n - 2)
            a, b = pool[i], pool[j + 1 if j >= i else j]
        else:
            a = self._weighted_pick(pool)
            b = self._weighted_pick([x for x in pool if x is not a])
        return a if a.load <= b.load else b

    def acquire(self, backend: Backend, *, long_running: bool = False, caller: str = "") -> Lease:
        """Count a request against ``backend`` (a long-running one against ``caller`` too) until released."""
        backend.in_flight += 1
        if long_running:
            backend.watches += 1
            self._long_running_callers[caller] = self._long_running_callers.get(caller, 0) + 1
        backend.rate.add()
        return Lease(self, backend, long_running, caller=caller)

    def long_running_of(self, caller: str) -> int:
        """Long-running leases ``caller`` holds open, on every backend together."""
        return self._long_running_callers.get(caller, 0)

    def _release(self, lease: Lease) -> None:
        lease.backend.in_flight -= 1
        if lease.long_running:
            lease.backend.watches -= 1
            left = self._long_running_callers.get(lease.caller, 0) - 1
            if left > 0:
                self._long_running_callers[lease.caller] = left
            else:
                self._long_running_callers.pop(lease.caller, None)

    # --- passive health -----------------------------------------------------------------------

    def _eject(self, backend: Backend, reason: Literal["connect", "5xx"]) -> None:
        now = self.clock()
        p = self.policy
        if backend.ejected(now):
            return
        if backend.healthy_since and now - backend.healthy_since >= 2 * p.max_ejection_seconds:
            backend.ejection_streak = 0
        backend.ejection_streak += 1
        duration = min(p.max_ejection_seconds, p.base_ejection_seconds * 2 ** (backend.ejection_streak - 1))
        backend.ejected_until = now + duration
        backend.ejection_reason = reason
        backend.ejections_total += 1
        backend.responses.clear()
        backend.bad_responses = 0
        backend.healthy_since = backend.ejected_until

    def report_connect_failure(self, backend: Backend) -> None:
        """The backend refused or timed out a connection: nothing reached it, eject now."""
        backend.connect_failures_total += 1
        self._eject(backend, "connect")

    def report_response(self, backend: Backend, status: int) -> None:
        """Feed a response status into the 5xx storm detector."""
        now = self.clock()
        p = self.policy
        window = backend.responses
        is_bad = status in STORM_STATUSES
        window.append((now, is_bad))
        backend.bad_responses += is_bad
        while window and window[0][0] < now - p.storm_window_seconds:
            backend.bad_responses -= window.popleft()[1]
        if len(window) < p.storm_min_responses or backend.bad_responses / len(window) < p.storm_ratio:
            return
        others = [b for b in self.backends if b is not backend and b.eligible(now)]
        if others:
            self._eject(backend, "5xx")

    # --- active health ------------------------------------------------------------------------

    def report_probe(self, backend: Backend, ok: bool) -> None:
        """Result of one /readyz probe."""
        now = self.clock()
        if ok:
            backend.probe_failures = 0
            if not backend.ready:
                backend.ready = True
                backend.healthy_since = now
            if backend.ejection_reason == "connect" and backend.ejected(now):
                backend.ejected_until = now
                backend.healthy_since = now
            return
        backend.probe_failures += 1
        if backend.probe_failures >= self.policy.unhealthy_threshold:
            backend.ready = False

    # --- observation --------------------------------------------------------------------------

    def health(self, backend: Backend) -> Literal["healthy", "ejected", "unready"]:
        if not backend.ready:
            return "unready"
        return "ejected" if backend.ejected(self.clock()) else "healthy"

    def skew(self) -> Skew:
        now = self.clock()
        pool = [b for b in self.backends if b.eligible(now)] or self.backends
        flights = [b.in_flight / b.weight for b in pool]
        rates = [b.rate.count() / b.weight for b in pool]
        return Skew(
            in_flight_ratio=(max(flights) + 1) / (min(flights) + 1),
            rate_ratio=(max(rates) + 1) / (min(rates) + 1),
        )
