"""Seat borrowing (lendablePercent / borrowingLimitPercent) as upstream APF computes it.

The allocation checks mirror upstream's ``conc_alloc_test.go``: random
problems must satisfy the properties ``computeConcurrencyAllocation``
promises (sum, bounds, and each allocation is fairFrac * target unless a
bound binds). The controller scenario follows KEP-1040's example: an idle
level lends down to its lower limit, a busy one borrows, and the lender gets
its seats back once it has demand again.
"""

from __future__ import annotations

import random

import pytest
from fc_helpers import Req, User, flow_schema, group, queued_level, rr

from gatekeeper.proxy.flowcontrol.core.borrowing import (
    Bounds,
    DemandIntegrator,
    DemandStats,
    Item,
    allocate,
    bounds_of,
    go_round,
)
from gatekeeper.proxy.flowcontrol.core.controller import FlowController, LevelLimits
from gatekeeper.proxy.flowcontrol.core.objects import PriorityLevel
from gatekeeper.proxy.flowcontrol.core.policy import build_policy

GET = Req(verb="get", resource="configmaps", namespace="default")


def test_allocation_examples() -> None:
    allocs, frac = allocate(12, [Item(1, 0, 100), Item(2, 0, 100), Item(3, 0, 100)])  # no bound binds
    assert allocs == pytest.approx([2, 4, 6]) and frac == pytest.approx(2)
    allocs, _ = allocate(6, [Item(5, 5, 10), Item(1, 0, 10)])  # a lower bound binds
    assert allocs == pytest.approx([5, 1])
    allocs, _ = allocate(8, [Item(1, 0, 2), Item(1, 0, 10)])  # an upper bound binds
    assert allocs == pytest.approx([2, 6])
    allocs, _ = allocate(10, [Item(7, 7, 9), Item(3, 3, 5)])  # lower bounds already sum to the total
    assert allocs == pytest.approx([7, 3])
    with pytest.raises(ValueError):
        allocate(1, [Item(1, 2, 1)])


@pytest.mark.parametrize("seed", range(40))
def test_random_allocations_keep_upstreams_promises(seed: int) -> None:
    rng = random.Random(seed)
    items = []
    for _ in range(rng.randint(1, 8)):
        lower = rng.choice([0.0, rng.uniform(0, 50)])
        target = lower + rng.choice([0.0, rng.uniform(0, 100)])
        items.append(Item(target, lower, lower + rng.uniform(0, 200)))
    low, high = sum(i.lower for i in items), sum(i.upper for i in items)
    required = rng.uniform(low, high)
    allocs, frac = allocate(required, items)
    assert sum(allocs) == pytest.approx(required, rel=1e-6, abs=1e-6)
    for it, a in zip(items, allocs, strict=True):
        assert it.lower - 1e-9 <= a <= it.upper + 1e-9
        fair = frac * max(it.target, 0.001)
        assert (
            a == pytest.approx(fair, rel=1e-6, abs=1e-6)
            or (a == pytest.approx(it.lower) and it.lower >= fair - 1e-6)
            or (a == pytest.approx(it.upper) and it.upper <= fair + 1e-6)
        )


def _pl(lendable: int = 0, borrowing: int | None = None) -> PriorityLevel:
    return PriorityLevel("x", "uid", False, 10, lendable_percent=lendable, borrowing_limit_percent=borrowing)


def test_bounds_round_like_go_and_default_to_unlimited_borrowing() -> None:
    assert bounds_of(_pl(33, 50), 10, 600) == Bounds(10, 7, 15)
    assert bounds_of(_pl(), 10, 600) == Bounds(10, 10, 610)
    assert bounds_of(_pl(50, 0), 5, 600) == Bounds(5, 2, 5)  # 2.5 rounds away from zero, as Go does
    assert go_round(2.5) == 3 and round(2.5) == 2


def test_seat_demand_is_integrated_over_time_and_smoothed() -> None:
    d = DemandIntegrator(0.0, 2.0)
    d.set(4.0, 5.0)
    avg, sd, high, dur = d.results(10.0)
    assert (avg, sd, high, dur) == pytest.approx((3.0, 1.0, 4.0, 10.0))
    st = DemandStats()
    st.update(10, 0, 10, 10)
    st.update(0, 0, 0, 10)
    assert st.smoothed == pytest.approx(0.977 * 10)  # decays slowly
    st.update(20, 2, 22, 10)
    assert st.smoothed == 22  # but follows a rise at once


def _controller() -> FlowController:
    busy, idle = queued_level("busy", 45, qlen=200), queued_level("idle", 50, qlen=200)
    idle["spec"]["limited"]["lendablePercent"] = 50
    objs = [busy, idle, queued_level("catch-all", 5)]
    for name, who in (("busy", "b"), ("idle", "i")):
        objs.append(flow_schema(name, name, [{"subjects": [group(who)], "resourceRules": [rr(["*"], ["*"])]}], 100))
    return FlowController(build_policy([("test", o) for o in objs], 100), LevelLimits(server_concurrency_limit=100))


def test_an_idle_level_lends_and_gets_its_seats_back_when_busy_again() -> None:
    fc = _controller()
    busy, idle, catch = (fc.levels[n] for n in ("busy", "idle", "catch-all"))
    assert (fc.bounds["idle"].lower, fc.bounds["idle"].upper) == (25, 150)
    # at configuration time upstream already divides the nominal total by the lower bounds (no demand yet)
    assert (busy.limit, idle.limit, catch.limit) == (60, 33, 7)
    tickets = [fc.admit(User(f"b{i}", ["b"]), GET, 0.0)[0] for i in range(100)]
    assert sum(t.state == "executing" for t in tickets) == 60
    dispatched = fc.adjust(10.0)
    # busy: demand 100 all period (target 100, lower 45); idle: none (held at its lower bound 25);
    # fairFrac 0.7 makes 70 + 25 + 5 = 100 seats
    assert (busy.limit, idle.limit, catch.limit) == (70, 25, 5)
    assert fc.fair_frac == pytest.approx(0.7)
    assert len(dispatched) == 10 and busy.executing_seats == 70
    assert busy.demand_stats.high_watermark == 100 and busy.demand_stats.avg == pytest.approx(100)
    # the lender gets demand: its high watermark lifts its lower bound back to its nominal 50
    for i in range(50):
        fc.admit(User(f"i{i}", ["i"]), GET, 10.0)
    fc.adjust(20.0)
    assert (busy.limit, idle.limit, catch.limit) == (45, 50, 5)
    assert busy.executing_seats == 70  # running requests finish; no new one starts above the new limit
    for t in tickets[:30]:
        fc.finish(t, 21.0)
    assert busy.executing_seats == 45


def test_without_lendable_seats_every_level_keeps_its_nominal_limit() -> None:
    objs = [queued_level("busy", 45), queued_level("idle", 50), queued_level("catch-all", 5)]
    fc = FlowController(build_policy([("t", o) for o in objs], 100), LevelLimits(server_concurrency_limit=100))
    for i in range(100):
        fc.admit(User(f"b{i}", ["b"]), GET, 0.0)
    fc.adjust(10.0)
    assert {n: lv.limit for n, lv in fc.levels.items() if not lv.spec.exempt} == {"busy": 45, "idle": 50,
                                                                                   "catch-all": 5}
