"""One priority level's seats and queues: shuffle sharding plus fair queuing by seats, as upstream; no I/O, no clock.

Fair queuing gives a queue of a thousand requests of one flow the same share as a queue of one. The head of the
chosen queue is not skipped when it does not fit, so a wide LIST waits rather than starves. A dispatched request
with a coalescing key takes every waiter of the same key in the level along, seatless.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gatekeeper.proxy.flowcontrol.core.borrowing import DemandIntegrator, DemandStats
from gatekeeper.proxy.flowcontrol.core.fleet import FleetShare
from gatekeeper.proxy.flowcontrol.core.objects import PriorityLevel

State = Literal["new", "queued", "executing", "joined", "rejected", "cancelled", "done"]
RejectReason = Literal["queue-full", "time-out", "concurrency-limit", "cancelled", "watch-rate"]


MAX_SEATS_SHARE = 0.15
"""Upstream's priorityLevelMaxSeatsPercent: one request takes at most 15% of its level's seats."""


def level_max_seats(spec: PriorityLevel, limit: int) -> int:
    """Most seats one request may take: ``max(1, min(ceil(0.15 * limit), limit // handSize))`` as upstream, so a wide
    request leaves room; a Reject level (no hand) caps at its limit, so a too-wide LIST runs alone, not never."""
    if limit <= 0:
        return 1
    if spec.reject or spec.exempt:
        return limit
    return max(1, min(math.ceil(limit * MAX_SEATS_SHARE), limit // spec.hand_size))


@functools.lru_cache(maxsize=8192)
def deal(hash_value: int, deck: int, hand: int) -> tuple[int, ...]:
    """Shuffle-sharding hand of ``hand`` distinct queues in [0, deck), as upstream's ``shufflesharding.Deal`` deals."""
    digits: list[int] = []
    for i in range(hand):
        hash_value, d = divmod(hash_value, deck - i)
        digits.append(d)
    cards = []
    for i, d in enumerate(digits):
        for earlier in reversed(digits[:i]):
            if d >= earlier:
                d += 1
        cards.append(d)
    return tuple(cards)


@dataclass(eq=False)
class Ticket:
    """One request's journey through flow control."""

    flow: int
    seats: int
    list_bytes: int = 0
    key: Hashable | None = None
    """Coalescing key; None for requests that must never be merged."""
    deadline: float = float("inf")
    payload: Any = None
    """Owned by the caller (the async layer hangs its future here)."""
    state: State = "new"
    reason: RejectReason | None = None
    level: LevelState | None = None
    queue: int = -1
    leader: Ticket | None = None
    followers: list[Ticket] = field(default_factory=list)
    holds_seats: bool = False
    backend: str = ""
    """The apiserver reserved for an expensive LIST (:class:`BackendCap`); empty for any other request."""
    cap_held: bool = False
    unsized: bool = False
    """A LIST of a storage-only resource whose size is not known yet: it may read the whole collection, so the
    per-apiserver cap treats it as expensive until a response has taught the size."""
    start_tag: float = 0.0
    finish_tag: float = 0.0
    retry_in: float = 0.0
    """For a rejected watch start: seconds until its flow may start another."""
    ledgered: str = ""
    """What it took in the workers' shared ledger, and gives back there: "seats" (seats, LIST bytes, an
    apiserver's slot), "bytes" (a leased level: only the bytes and slot), or nothing."""


class BackendCap:
    """Per-apiserver slots for expensive LISTs; a ``nominal`` of 0 turns the cap off.

    Seats bound how many LISTs run, but the balancer may put two (or two proxies') on one apiserver and exhaust its
    memory. Slots are dealt over the apiservers eligible now: a down one's slots are not handed to the others, which
    would be the seeds' cascade (docs/flowcontrol/index.md#expensive-lists-per-apiserver).
    """

    def __init__(self) -> None:
        self.nominal = 0
        """The configured cap per apiserver (fleet-wide when the fleet is on); :meth:`configure` sets it."""
        self.min_bytes = 8 << 20
        self.fleet: FleetShare | None = None
        self.names: tuple[str, ...] = ()
        """Every apiserver, in the configured order (a worker's ledger row is the place in it)."""
        self.limits: dict[str, int] = {}
        """This proxy's slots on each apiserver, dealt over ``_dealt_over``."""
        self._dealt_over: frozenset[str] | None = None
        self.in_flight: dict[str, int] = {}
        self.held_total = 0
        """LISTs that found every eligible apiserver at its limit (each counted once)."""
        self.picked_limit = 0
        """The limit :meth:`pick` checked its choice against (the ledger checks the same one under its lock)."""
        self.candidates: Callable[[], Sequence[str]] = lambda: ()
        """Eligible apiservers, least loaded first (the balancer's view, wired by the proxy)."""
        self.count: Callable[[str], int] = lambda name: self.in_flight.get(name, 0)
        """Expensive LISTs in flight on an apiserver; worker processes read every worker's (``ledger.py``)."""

    def configure(self, nominal: int, min_bytes: int, fleet: FleetShare | None,
                  names: Sequence[str] | None = None) -> None:
        self.nominal, self.min_bytes, self.fleet = nominal, max(1, min_bytes), fleet
        if names is not None:
            self.names = tuple(names)
        self._deal(frozenset(self.names))

    def _deal(self, eligible: frozenset[str]) -> None:
        self._dealt_over = eligible
        if self.fleet is None or not self.nominal:
            self.limits = dict.fromkeys(self.names, self.nominal)
            return
        # In the configured order, the same in every proxy, so their deals fit together.
        dealt = self.fleet.backend_slots(self.nominal, [n for n in self.names if n in eligible])
        self.limits = {n: dealt.get(n, 0) for n in self.names}

    def expensive(self, list_bytes: int, unsized: bool) -> bool:
        return self.nominal > 0 and (list_bytes >= self.min_bytes or unsized)

    def pick(self) -> str | None:
        """The eligible apiserver with the fewest expensive LISTs, if one is below this proxy's limit there."""
        candidates = self.candidates()
        if self.fleet is not None and frozenset(candidates) != self._dealt_over:
            self._deal(frozenset(candidates))
        best: str | None = None
        least = 0
        for name in candidates:
            limit = self.limits.get(name, 0)
            n = self.count(name)
            if n < limit and (best is None or n < least):
                best, least, self.picked_limit = name, n, limit
        return best

    def take(self, name: str) -> None:
        self.in_flight[name] = self.in_flight.get(name, 0) + 1

    def give(self, name: str) -> None:
        left = self.in_flight.get(name, 0) - 1
        if left > 0:
            self.in_flight[name] = left
        else:
            self.in_flight.pop(name, None)


@dataclass
class ListBudget:
    """Global cap on estimated bytes of executing LISTs, shared by every limited level."""

    cap: int
    used: int = 0
    executing: int = 0
    backends: BackendCap = field(default_factory=BackendCap)

    def fits(self, nbytes: int) -> bool:
        return nbytes == 0 or self.executing == 0 or self.used + nbytes <= self.cap

    def place(self, t: Ticket) -> bool:
        """Reserve an apiserver for an expensive LIST (``t.backend``); False while every one is at the cap."""
        caps = self.backends
        if not caps.expensive(t.list_bytes, t.unsized):
            return True
        name = caps.pick()
        if name is None:
            self._held(t)
            return False
        t.backend = name
        return True

    def note_queued(self, t: Ticket) -> None:
        """Count a queued expensive LIST as held when every apiserver is at the cap, looked at or not."""
        caps = self.backends
        if not t.cap_held and caps.expensive(t.list_bytes, t.unsized) and caps.pick() is None:
            self._held(t)

    def _held(self, t: Ticket) -> None:
        if not t.cap_held:
            t.cap_held = True
            self.backends.held_total += 1


@dataclass
class _Queue:
    items: list[Ticket] = field(default_factory=list)
    last_finish: float = 0.0
    executing_seats: int = 0
    waiting_seats: int = 0
    """Sum of the seats of ``items``, kept as items come and go."""

    def take(self, t: Ticket) -> None:
        self.items.remove(t)
        self.waiting_seats -= t.seats


class LevelState:
    """Runtime state of one PriorityLevelConfiguration."""

    leased = False
    """Its seats are seat Leases this process holds (a fleet's small level), not a share of a static limit."""

    def __init__(self, spec: PriorityLevel, limit: int, budget: ListBudget) -> None:
        self.spec = spec
        self.limit = limit
        """Current concurrency limit in seats: the nominal one, moved by borrowing (``borrowing.py``)."""
        self.nominal = limit
        self.max_seats = level_max_seats(spec, limit)
        self.waiting_seats = 0
        """Seats of all waiting requests; with executing_seats, the level's seat demand."""
        self.demand = DemandIntegrator()
        self.demand_stats = DemandStats()
        self.target = float(limit)
        """The borrowing allocation's target for this level at the last adjustment."""
        self.budget = budget
        self.queues = [_Queue() for _ in range(0 if (spec.exempt or spec.reject) else spec.queues)]
        self.vtime = 0.0
        self._rr = 0
        self.executing_requests = 0
        self.executing_seats = 0
        self.waiting = 0

    def configure(self, spec: PriorityLevel, limit: int) -> None:
        """A reload changed the level's limits but not its queues."""
        self.spec, self.limit, self.nominal, self.max_seats = spec, limit, limit, level_max_seats(spec, limit)

    def note_demand(self, now: float) -> None:
        """Feed the seat-demand integrator (call after anything that changed seats or the queues)."""
        self.demand.set(self.executing_seats + self.waiting_seats, now)

    def same_geometry(self, spec: PriorityLevel) -> bool:
        old = self.spec
        return (spec.exempt, spec.reject, spec.queues, spec.hand_size) == (old.exempt, old.reject, old.queues,
                                                                           old.hand_size)

    @property
    def idle(self) -> bool:
        return self.executing_requests == 0 and self.waiting == 0

    # -- admission --------------------------------------------------------
    def submit(self, t: Ticket) -> list[Ticket]:
        """Admit ``t``: execute, queue, or reject it. Returns every ticket dispatched as a result."""
        t.level = self
        if self.spec.exempt:
            self._start(t, charge=False)
            return [t]
        t.seats = max(1, min(t.seats, self.max_seats))
        if self.spec.reject:
            if self._fits(t):
                self._start(t)
                return [t]
            t.state, t.reason = "rejected", "concurrency-limit"
            return []
        queues = self.queues
        qi, least = -1, 0
        for i in deal(t.flow, len(queues), self.spec.hand_size):  # the least loaded; first dealt wins ties
            dealt = queues[i]
            load = dealt.waiting_seats + dealt.executing_seats
            if qi < 0 or load < least:
                qi, least = i, load
        q = queues[qi]
        if len(q.items) >= self.spec.queue_length_limit:
            t.state, t.reason = "rejected", "queue-full"
            return []
        t.queue, t.state = qi, "queued"
        t.start_tag = max(self.vtime, q.last_finish)
        t.finish_tag = q.last_finish = t.start_tag + t.seats
        if self.waiting == 0 and self._fits(t):
            # Nothing else waits: dispatch would pick this request at once; skip scanning the queues.
            self._rr = (qi + 1) % len(queues)
            self.vtime = max(self.vtime, t.start_tag)
            self._start(t)
            return [t]
        self.budget.note_queued(t)
        q.items.append(t)
        q.waiting_seats += t.seats
        self.waiting_seats += t.seats
        self.waiting += 1
        return self.dispatch()

    def _fits(self, t: Ticket) -> bool:
        if self.limit <= 0:
            return False
        if self.executing_seats + t.seats > self.limit and self.executing_requests > 0:
            return False
        return self.budget.fits(t.list_bytes) and self.budget.place(t)

    def _start(self, t: Ticket, charge: bool = True) -> None:
        t.state = "executing"
        self.executing_requests += 1
        if charge:
            t.holds_seats = True
            self.executing_seats += t.seats
            if 0 <= t.queue < len(self.queues):
                self.queues[t.queue].executing_seats += t.seats
            if t.list_bytes:
                self.budget.used += t.list_bytes
                self.budget.executing += 1
            if t.backend:
                self.budget.backends.take(t.backend)

    # -- dispatch ---------------------------------------------------------
    def _next_queue(self) -> int | None:
        if self.waiting == 0:
            return None
        best: tuple[float, int] | None = None
        n = len(self.queues)
        for k in range(n):
            i = (self._rr + k) % n
            q = self.queues[i]
            if q.items and (best is None or q.items[0].finish_tag < best[0]):
                best = (q.items[0].finish_tag, i)
        return None if best is None else best[1]

    def dispatch(self) -> list[Ticket]:
        """Start as many waiting requests as seats (and the LIST budget) allow, fairly."""
        out: list[Ticket] = []
        while (qi := self._next_queue()) is not None:
            head = self.queues[qi].items[0]
            if not self._fits(head):
                break
            q = self.queues[qi]
            q.items.pop(0)
            q.waiting_seats -= head.seats
            self.waiting_seats -= head.seats
            self.waiting -= 1
            self._rr = (qi + 1) % len(self.queues)
            self.vtime = max(self.vtime, head.start_tag)
            self._start(head)
            out.append(head)
            if head.key is not None and self.waiting:
                for q in self.queues:
                    joined = [w for w in q.items if w.key == head.key]
                    for w in joined:
                        q.take(w)
                        self.waiting_seats -= w.seats
                        self.waiting -= 1
                        w.state, w.leader = "joined", head
                        head.followers.append(w)
                out.extend(head.followers)
        return out

    # -- completion -------------------------------------------------------
    def release(self, t: Ticket) -> list[Ticket]:
        """Give back ``t``'s seats (request finished, or a watch got its first bytes)."""
        if not t.holds_seats:
            return []
        t.holds_seats = False
        self.executing_seats -= t.seats
        if 0 <= t.queue < len(self.queues):
            self.queues[t.queue].executing_seats -= t.seats
        if t.list_bytes:
            self.budget.used -= t.list_bytes
            self.budget.executing -= 1
        if t.backend:
            self.budget.backends.give(t.backend)
        return self.dispatch()

    def finish(self, t: Ticket) -> list[Ticket]:
        """The request (and its followers) ended; returns newly dispatched tickets."""
        if t.state != "executing":
            return []
        t.state = "done"
        self.executing_requests -= 1
        if t.holds_seats:
            return self.release(t)
        return self.dispatch()

    def remove(self, t: Ticket, reason: RejectReason) -> bool:
        """Take a waiting ticket out of its queue (time-out or client gone). False if not waiting."""
        if t.state != "queued":
            return False
        self.queues[t.queue].take(t)
        self.waiting_seats -= t.seats
        self.waiting -= 1
        t.state, t.reason = "cancelled" if reason == "cancelled" else "rejected", reason
        return True
