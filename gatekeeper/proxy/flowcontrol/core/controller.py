"""The flow-control decision core: classify, estimate, queue, dispatch (no sockets, asyncio or clock, so tests
are deterministic); every call returns the tickets it dispatched, for the caller to wake.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from gatekeeper.kube.requestinfo import RequestInfo
from gatekeeper.proxy.flowcontrol.core.borrowing import Bounds, allocate, bounds_of, go_round, item_for
from gatekeeper.proxy.flowcontrol.core.fleet import FleetShare
from gatekeeper.proxy.flowcontrol.core.listcost import ListShape
from gatekeeper.proxy.flowcontrol.core.objects import FlowSchema, PriorityLevel
from gatekeeper.proxy.flowcontrol.core.policy import Policy, UserFacts
from gatekeeper.proxy.flowcontrol.core.queueset import LevelState, ListBudget, Ticket
from gatekeeper.proxy.flowcontrol.core.seats import SizeEstimator
from gatekeeper.proxy.flowcontrol.core.watchstarts import WatchStarts


@functools.lru_cache(maxsize=8192)
def flow_hash(schema: str, distinguisher: str) -> int:
    """flow = hash(schema name, distinguisher): 64 bits that deal the flow's hand of queues (memoized)."""
    digest = hashlib.sha256(schema.encode() + b"\x00" + distinguisher.encode()).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass(frozen=True)
class LevelLimits:
    """The knobs that are not part of the Kubernetes objects."""

    server_concurrency_limit: int = 600
    queue_wait_seconds: float = 15.0
    bytes_per_seat: int = 8 << 20
    max_seats: int = 10
    list_bytes_cap: int = 1 << 30
    storage_only_resources: frozenset[str] = frozenset()
    expensive_lists_per_backend: int = 0
    expensive_list_bytes: int = 8 << 20
    watch_starts_per_second: float = 0.0
    watch_start_burst: int = 1
    watch_start_flows: int = 10_000


class FlowController:
    """Holds the policy, one LevelState per priority level, the size estimator and the LIST byte budget."""

    level_factory: Callable[[PriorityLevel, int, ListBudget], LevelState] = LevelState
    """Builds each level's state; worker processes swap in ``ledger.LedgerLevel`` (proxy-wide seats)."""

    def __init__(self, policy: Policy, limits: LevelLimits | None = None) -> None:
        self.limits = limits or LevelLimits()
        self.estimator = SizeEstimator()
        self.budget = ListBudget(self.limits.list_bytes_cap)  # update() sets both from the limits
        self.watch_starts = WatchStarts(0.0, 1, 1)
        self.policy = policy
        self.levels: dict[str, LevelState] = {}
        self.draining: list[LevelState] = []
        self.bounds: dict[str, Bounds] = {}
        """Borrowing bounds (nominal, minCL, maxCL) per Limited level."""
        self.fair_frac = 0.0
        self.now = 0.0
        """Latest time seen; used when a caller does not pass one."""
        self.share_of: FleetShare | None = None
        """This proxy's part of a fleet's budget (``fleet.py``): level seats and expensive-LIST slots per apiserver."""
        self.seat_leases: Callable[[str, int], int | None] | None = None
        """For a fleet's small levels (``seatleases.py``): the seats this process holds as Leases, or None where a
        level's seats are not leased."""
        self.ceilings: dict[str, int] = {}
        """Leased levels: seats held; borrowing never lifts such a level above them."""
        self.update(policy, self.limits)

    def update(self, policy: Policy, limits: LevelLimits | None = None) -> list[Ticket]:
        """Swap in a new policy. Levels of unchanged shape keep their queues; otherwise the old queues drain while
        new requests use the new ones. Returns requests dispatched because limits grew."""
        if limits is not None:
            self.limits = limits
            self.estimator.bytes_per_seat, self.estimator.max_seats = limits.bytes_per_seat, limits.max_seats
            self.estimator.storage_only = limits.storage_only_resources
            self.budget.cap = limits.list_bytes_cap
            ws = self.watch_starts
            ws.rate, ws.burst, ws.max_flows = (limits.watch_starts_per_second, max(1, limits.watch_start_burst),
                                               max(1, limits.watch_start_flows))
        self.budget.backends.configure(self.limits.expensive_lists_per_backend, self.limits.expensive_list_bytes,
                                       self.share_of)
        self.policy = policy
        levels: dict[str, LevelState] = {}
        ceilings: dict[str, int] = {}
        for name, spec in policy.levels.items():
            limit = policy.limits.get(name, 0)
            if not spec.exempt and self.seat_leases is not None and (held := self.seat_leases(name, limit)) is not None:
                limit = ceilings[name] = held
            elif self.share_of is not None and not spec.exempt:
                limit = self.share_of(name, limit)
            old = self.levels.pop(name, None)
            if old is not None and old.same_geometry(spec):
                old.configure(spec, limit)
                levels[name] = old
            else:
                if old is not None:
                    self.draining.append(old)
                levels[name] = self.level_factory(spec, limit, self.budget)
            # A leased level's seats are this process's own Leases, not the workers' shared ledger; it keeps its
            # queues when the fleet turns leasing on or off.
            levels[name].leased = name in ceilings
        self.ceilings = ceilings
        self.draining.extend(self.levels.values())
        self.levels = levels
        self.draining = [lv for lv in self.draining if not lv.idle]
        total = self.limits.server_concurrency_limit
        self.bounds = {
            name: bounds_of(lv.spec, lv.nominal, total) for name, lv in levels.items() if not lv.spec.exempt
        }
        self._reallocate()
        # a raised limit may let waiting requests run now
        return [t for lv in [*self.levels.values(), *self.draining] for t in lv.dispatch()]

    # -- borrowing ------------------------------------------------------------------------------
    def adjust(self, now: float) -> list[Ticket]:
        """Upstream's periodic borrowing step (``borrowing.py``). Returns requests dispatched because a limit grew."""
        self.now = max(self.now, now)
        for name in self.bounds:
            lv = self.levels[name]
            lv.demand_stats.update(*lv.demand.results(now))
            lv.demand.reset(now)
        self._reallocate()
        out = [t for lv in self.levels.values() for t in lv.dispatch()]
        for lv in self.levels.values():
            lv.note_demand(self.now)
        return out

    def _reallocate(self) -> None:
        names = list(self.bounds)
        items = [item_for(self.bounds[n], self.levels[n].demand_stats) for n in names]
        allocs, self.fair_frac = allocate(sum(b.nominal for b in self.bounds.values()), items)
        for name, item, alloc in zip(names, items, allocs, strict=True):
            lv = self.levels[name]
            lv.target = item.target
            lv.limit = go_round(alloc)
            if name in self.ceilings:
                lv.limit = min(lv.limit, self.ceilings[name])

    def _note(self, lv: LevelState | None, now: float | None) -> None:
        if now is not None and now > self.now:
            self.now = now
        if lv is not None:
            lv.note_demand(self.now)

    def classify(self, user: UserFacts, ri: RequestInfo) -> tuple[FlowSchema, PriorityLevel]:
        return self.policy.classify(user, ri)

    def admit(
        self,
        user: UserFacts,
        ri: RequestInfo,
        now: float,
        *,
        user_key: str | None = None,
        key: Hashable | None = None,
        exempt_ok: bool = True,
        shape: ListShape | None = None,
        single: bool = False,
    ) -> tuple[Ticket, FlowSchema, list[Ticket]]:
        """Classify and submit one request; returns its ticket, its schema and every ticket dispatched.
        ``exempt_ok=False`` (an unverifiable token) never reaches an Exempt level: upstream it gets its 401 first."""
        fs, pl = self.policy.classify(user, ri)
        if pl.exempt and not exempt_ok:
            fs, pl = self.policy.catch_all()
        # A watch that sends the current state first (a watch-list, or one without a resourceVersion) streams the
        # collection before it watches: the LIST's cost (upstream's width estimator does so for watch-lists).
        listing = ri.verb == "list" or (ri.verb == "watch" and shape is not None)
        est = self.estimator.estimate("list" if listing else ri.verb, ri.resource, ri.namespace, shape, single)
        if pl.exempt:  # runs at once, uncounted: no queue, so no flow either
            t = Ticket(flow=0, seats=est.seats, list_bytes=est.list_bytes, key=None, deadline=now)
            return t, fs, self.levels[pl.name].submit(t)
        if now > self.now:
            self.now = now
        if fs.distinguisher == "ByUser":
            dist = user.name if user_key is None else user_key
        else:
            dist = ri.namespace if fs.distinguisher == "ByNamespace" else ""
        t = Ticket(
            flow=flow_hash(fs.name, dist),
            seats=est.seats,
            list_bytes=est.list_bytes,
            key=key,
            deadline=now + self.limits.queue_wait_seconds,
            unsized=(listing and not est.list_bytes and not single and ri.resource in self.estimator.storage_only),
        )
        level = self.levels[pl.name]
        # Per caller within the schema, whatever its distinguisher: a schema without one must not let one caller
        # spend everyone's watches, and ByNamespace must not give a caller a fresh burst per (made-up) namespace.
        if ri.verb == "watch" and (wait := self.watch_starts.take(
                flow_hash(fs.name, "\x00watch\x00" + (user.name if user_key is None else user_key)), now)) > 0:
            t.level, t.state, t.reason, t.retry_in = level, "rejected", "watch-rate", wait
            return t, fs, []
        dispatched = level.submit(t)
        level.note_demand(self.now)
        return t, fs, dispatched

    def _after(
        self, level: LevelState, dispatched: list[Ticket], freed_list_bytes: bool, now: float | None = None
    ) -> list[Ticket]:
        self._note(level, now)
        if freed_list_bytes:
            for other in [*self.levels.values(), *self.draining]:
                if other is not level and (more := other.dispatch()):
                    dispatched.extend(more)
                    other.note_demand(self.now)  # coalesced followers left the queues
        if self.draining:  # only after a reload: no new list per request otherwise
            self.draining = [lv for lv in self.draining if not lv.idle]
        return dispatched

    def release_seats(self, t: Ticket, now: float | None = None) -> list[Ticket]:
        """A watch got its first bytes: it keeps running but no longer holds seats."""
        if t.level is None or not t.holds_seats:
            return []
        return self._after(t.level, t.level.release(t), bool(t.list_bytes or t.backend), now)

    def finish(self, t: Ticket, now: float | None = None) -> list[Ticket]:
        """The request ended (response complete, failed, or client gone). Followers end with it."""
        if t.level is None:
            return []
        freed = bool(t.list_bytes or t.backend) and t.holds_seats  # bytes or an apiserver's slot: any level
        for f in t.followers:
            f.state = "done"
        return self._after(t.level, t.level.finish(t), freed, now)

    def cancel(self, t: Ticket, now: float | None = None) -> list[Ticket]:
        """The client went away: drop a waiting ticket, or finish an executing one."""
        if t.state == "queued" and t.level is not None:
            t.level.remove(t, "cancelled")
            self._note(t.level, now)
            return []
        if t.state == "executing":
            return self.finish(t, now)
        return []

    def timeout(self, t: Ticket, now: float | None = None) -> bool:
        """Reject ``t`` with reason time-out if it is still waiting."""
        removed = t.level is not None and t.level.remove(t, "time-out")
        if removed:
            self._note(t.level, now)
        return removed
