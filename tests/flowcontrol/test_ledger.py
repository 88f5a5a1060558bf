"""Proxy-wide seats: several controllers (one per worker) sharing one seat ledger file.

The workers are plain FlowControllers in this process, each with its own column of
the real mmap'ed ledger, so every interleaving is driven step by step.
"""

from __future__ import annotations

import functools
import multiprocessing
from pathlib import Path

import pytest
from fc_helpers import Req, User
from test_coalescing_core import key_for
from test_queueing import controller

from gatekeeper.proxy.flowcontrol.core.controller import FlowController
from gatekeeper.proxy.flowcontrol.core.queueset import Ticket
from gatekeeper.proxy.flowcontrol.edge.ledger import LedgerLevel, SeatLedger

LIST = Req("list", "secrets", namespace="ns")


def workers(tmp_path: Path, n: int, total: int = 2, **kw) -> tuple[SeatLedger, list[FlowController]]:
    parent = SeatLedger.create(tmp_path / "ledger", n)
    out = []
    for i in range(n):
        fc = controller(total=total, **kw)
        ledger = SeatLedger(tmp_path / "ledger", i)
        fc.level_factory = functools.partial(LedgerLevel, ledger=ledger)
        fc.levels, fc.draining = {}, []
        fc.update(fc.policy)
        out.append(fc)
    return parent, out


def executing(fcs: list[FlowController]) -> int:
    return sum(fc.levels["work"].executing_seats for fc in fcs)


def test_a_level_limit_holds_across_workers(tmp_path):
    parent, fcs = workers(tmp_path, 4, total=2)
    tickets = [fcs[i % 4].admit(User(f"u{i}"), LIST, 0.0)[0] for i in range(20)]
    assert sum(t.state == "executing" for t in tickets) == 2
    assert parent.view()["work"]["seats"] == 2 and parent.view()["work"]["waiting"] == 18
    done = 0
    running = [t for t in tickets if t.state == "executing"]
    while running:
        t = running.pop(0)
        owner = fcs[tickets.index(t) % 4]
        running += owner.finish(t)
        done += 1
        # other workers learn of the freed seat by a wake-up: each retries its dispatch
        for fc in fcs:
            running += [d for lv in fc.levels.values() for d in lv.dispatch()]
        assert executing(fcs) <= 2 and parent.view()["work"]["seats"] <= 2
    assert done == 20 and parent.view()["work"] == {"seats": 0, "holders": 0, "waiting": 0, "peak": 2}


def test_without_the_ledger_each_worker_would_run_its_own_limit(tmp_path):
    """The failure the ledger prevents: four independent controllers admit 4x the level's seats."""
    fcs = [controller(total=2) for _ in range(4)]
    tickets = [fcs[i % 4].admit(User(f"u{i}"), LIST, 0.0)[0] for i in range(20)]
    assert sum(t.state == "executing" for t in tickets) == 8


def test_a_freed_seat_goes_to_the_waiting_worker_in_turn(tmp_path):
    """Worker 0 floods; worker 1 has one request waiting: the next free seat is worker 1's,
    even though worker 0 frees it and has its own queue to serve."""
    _, (w0, w1) = workers(tmp_path, 2, total=1)
    flood = [w0.admit(User("flood"), LIST, 0.0)[0] for _ in range(10)]
    assert flood[0].state == "executing"
    other = w1.admit(User("tenant"), LIST, 0.0)[0]
    assert other.state == "queued"
    dispatched0 = w0.finish(flood[0])
    assert dispatched0 == [], "worker 0 must not take the seat while worker 1 waits its turn"
    assert [d for lv in w1.levels.values() for d in lv.dispatch()] == [other]
    w1.finish(other)
    (nxt,) = [d for lv in w0.levels.values() for d in lv.dispatch()]
    assert nxt in flood[1:] and nxt.state == "executing"


def test_workers_share_a_contended_level_by_their_busy_queues(tmp_path):
    """Worker 0 has three flows queued, worker 1 one flow: with one process each flow would get a
    quarter of the dispatches, so worker 0 must get about three quarters, not half (round robin)."""
    _, (w0, w1) = workers(tmp_path, 2, total=1)
    first = w0.admit(User("starter"), LIST, 0.0)[0]
    mine = {w0: [], w1: []}
    for _ in range(30):
        for u in ("a", "b", "c"):
            mine[w0].append(w0.admit(User(u), LIST, 0.0)[0])
        mine[w1].append(w1.admit(User("d"), LIST, 0.0)[0])
    wins = {w0: 0, w1: 0}
    running = first
    owner = w0
    for _ in range(40):
        started = [(owner, d) for d in owner.finish(running)]
        started += [(fc, d) for fc in (w0, w1) for lv in fc.levels.values() for d in lv.dispatch()]
        assert len(started) == 1, "exactly one worker takes the freed seat"
        owner, running = started[0]
        wins[owner] += 1
    share = wins[w0] / 40
    assert 0.65 <= share <= 0.85, f"worker 0 got {share:.0%} of the seats for 3 of the 4 flows"


def test_seats_of_a_dead_worker_are_released(tmp_path):
    parent, (w0, w1) = workers(tmp_path, 2, total=2)
    held = [w0.admit(User(f"a{i}"), LIST, 0.0)[0] for i in range(2)]
    assert all(t.state == "executing" for t in held)
    waiting = w1.admit(User("b"), LIST, 0.0)[0]
    assert waiting.state == "queued" and parent.view()["work"]["seats"] == 2
    parent.clear_worker(0)  # the supervisor saw worker 0 die
    assert parent.view()["work"]["seats"] == 0
    assert [d for lv in w1.levels.values() for d in lv.dispatch()] == [waiting]


def test_identical_lists_coalesce_within_a_worker_not_across(tmp_path):
    """Queued identical LISTs in one worker share one upstream call; the same LIST queued in
    another worker is its own upstream call and takes its own seat, so the limit still holds."""
    parent, (w0, w1) = workers(tmp_path, 2, total=1)
    blocker = w0.admit(User("x"), LIST, 0.0, key=("other",))[0]
    key = key_for("alice")
    in0 = [w0.admit(User("alice"), LIST, 0.0, key=key)[0] for _ in range(3)]
    in1 = [w1.admit(User("alice"), LIST, 0.0, key=key)[0] for _ in range(3)]
    assert blocker.state == "executing" and all(t.state == "queued" for t in in0 + in1)
    calls: list[Ticket] = []
    running = [blocker]
    while running:
        t = running.pop(0)
        (w0 if t in [blocker, *in0] else w1).finish(t)
        for fc in (w0, w1):
            for d in [d for lv in fc.levels.values() for d in lv.dispatch()]:
                if d.state == "executing":
                    calls.append(d)
                    running.append(d)
                    assert parent.view()["work"]["seats"] <= 1
    assert len(calls) == 2, "one upstream call per worker"
    assert {len(c.followers) for c in calls} == {2}


def test_exempt_requests_never_touch_the_ledger(tmp_path, monkeypatch):
    _, (w0,) = workers(tmp_path, 1)
    calls = []
    monkeypatch.setattr(SeatLedger, "try_take", lambda *a: calls.append(a) or True)
    t, _fs, _ = w0.admit(User("root", ["system:masters"]), Req("get", "pods", namespace="ns"), 0.0)
    assert t.state == "executing" and t.level is not None and t.level.spec.exempt and calls == []


def _hammer(path: str, worker: int, rounds: int, peak) -> None:
    ledger = SeatLedger(Path(path), worker)
    slot = ledger.slot("work")
    took = 0
    for _ in range(rounds):
        if ledger.try_take(slot, 3, 1, 0, 1 << 30):
            took += 1
            seats = ledger.view()["work"]["seats"]
            with peak.get_lock():
                peak.value = max(peak.value, seats)
            ledger.give(slot, 1, 0)
    ledger.close()


@pytest.mark.timeout(60)
def test_concurrent_processes_never_exceed_the_limit(tmp_path):
    parent = SeatLedger.create(tmp_path / "ledger", 4)
    ctx = multiprocessing.get_context("fork")
    peak = ctx.Value("i", 0)
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path / "ledger"), w, 1000, peak)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(50)
    assert all(p.exitcode == 0 for p in procs)
    view = parent.view()["work"]
    assert view["seats"] == 0 and view["holders"] == 0
    assert 1 <= peak.value <= 3 and view["peak"] <= 3


def _leased(tmp_path: Path, n: int, held: dict[int, int]) -> list[FlowController]:
    """``n`` workers of one proxy; worker ``i`` holds ``held[i]`` seat Leases of "work" (absent: not leased)."""
    from test_expensive_lists import capped

    SeatLedger.create(tmp_path / "ledger", n)
    out = []
    for i in range(n):
        fc = capped(per_backend=1, backends=("a", "b"))
        ledger = SeatLedger(tmp_path / "ledger", i)
        ledger.backend_rows = {"a": 0, "b": 1}
        fc.budget.backends.count = ledger.backend_count
        fc.level_factory = functools.partial(LedgerLevel, ledger=ledger)
        if i in held:
            fc.seat_leases = lambda name, limit, k=held[i]: k if name == "work" else None
        fc.levels, fc.draining = {}, []
        fc.update(fc.policy)
        out.append(fc)
    return out


def test_a_leased_levels_expensive_lists_still_count_against_each_apiservers_cap(tmp_path):
    """Two workers each holding a seat Lease: their seats are their own, the apiservers' slots still shared."""
    from test_expensive_lists import BIG, on_each

    fcs = _leased(tmp_path, 2, {0: 1, 1: 1})
    assert all(fc.levels["work"].leased for fc in fcs)
    tickets = [fcs[i].admit(User(f"u{i}"), BIG, 0.0)[0] for i in range(2)]
    assert [t.state for t in tickets] == ["executing", "executing"]
    assert on_each(tickets) == {"a": 1, "b": 1}
    for fc, t in zip(fcs, tickets, strict=True):
        fc.finish(t)
    assert [fc.budget.backends.count(b) for fc in fcs[:1] for b in ("a", "b")] == [0, 0]


def test_a_worker_on_the_static_share_is_not_starved_by_another_workers_queue_on_seat_leases(tmp_path):
    """Workers decide "leased" each on its own; a leased worker's queue must not hold the ledger's turn for good."""
    fcs = _leased(tmp_path, 2, {1: 0})  # worker 1: leased, no Lease yet; worker 0: the static share
    assert fcs[1].levels["work"].leased and not fcs[0].levels["work"].leased
    lst = Req("list", "configmaps", namespace="ns")
    assert fcs[1].admit(User("w1"), lst, 0.0)[0].state == "queued"
    first = fcs[0].admit(User("w0"), lst, 0.0)[0]
    assert first.state == "executing"
    fcs[0].finish(first)
    assert fcs[0].admit(User("w0"), lst, 0.0)[0].state == "executing"
