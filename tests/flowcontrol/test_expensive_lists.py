"""A cap on expensive LISTs per apiserver: what lands on one apiserver, across levels, workers and a fleet."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from fc_helpers import Req, User, flow_schema, group, queued_level, rr
from test_queueing import controller

import gatekeeper.proxy.settings  # noqa: F401 - registers the proxy: section
from gatekeeper.base.config import ConfigError, load_config
from gatekeeper.proxy.flowcontrol.core.controller import FlowController, LevelLimits
from gatekeeper.proxy.flowcontrol.core.fleet import FleetShare, backend_bound
from gatekeeper.proxy.flowcontrol.core.policy import build_policy
from gatekeeper.proxy.flowcontrol.core.queueset import Ticket
from gatekeeper.proxy.flowcontrol.edge.ledger import LedgerLevel, SeatLedger

BIG = Req("list", "secrets", namespace="big")
SMALL = Req("list", "configmaps", namespace="small")
APISERVERS = ("a", "b", "c")


def capped(per_backend: int = 1, total: int = 20, backends: tuple[str, ...] = APISERVERS,
           eligible: list[str] | None = None) -> FlowController:
    fc = controller(total=total, limits=LevelLimits(server_concurrency_limit=total, bytes_per_seat=1 << 40,
                                                    expensive_lists_per_backend=per_backend,
                                                    expensive_list_bytes=1 << 20))
    fc.estimator.observe("secrets", "big", 40 << 20)
    fc.estimator.observe("configmaps", "small", 100 << 10)
    caps = fc.budget.backends
    caps.candidates = lambda: eligible if eligible is not None else backends
    caps.configure(caps.nominal, caps.min_bytes, None, backends)
    return fc


def admit(fc: FlowController, n: int, req: Req = BIG, user: str = "u") -> list[Ticket]:
    return [fc.admit(User(f"{user}{i}"), req, 0.0)[0] for i in range(n)]


def on_each(tickets: list[Ticket]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tickets:
        if t.state == "executing" and t.holds_seats:
            out[t.backend] = out.get(t.backend, 0) + 1
    return out


def test_expensive_lists_beyond_the_cap_wait_and_each_apiserver_runs_at_most_the_cap():
    fc = capped(per_backend=1)
    tickets = admit(fc, 5)
    assert on_each(tickets) == {"a": 1, "b": 1, "c": 1}
    assert [t.state for t in tickets[3:]] == ["queued", "queued"]
    assert fc.budget.backends.held_total == 2


def test_every_queued_expensive_list_is_counted_held_not_only_the_one_dispatch_looks_at():
    fc = capped(per_backend=1)
    admit(fc, 3)
    admit(fc, 7, user="late")
    assert fc.budget.backends.held_total == 7


def test_a_finished_expensive_list_hands_its_apiserver_to_the_next_one():
    fc = capped(per_backend=1)
    tickets = admit(fc, 4)
    first_b = next(t for t in tickets if t.backend == "b")
    woken = fc.finish(first_b)
    assert [t.backend for t in woken] == ["b"] and woken[0] is tickets[3]
    assert on_each(tickets) == {"a": 1, "b": 1, "c": 1}


def test_lists_below_min_bytes_are_not_capped():
    fc = capped(per_backend=1)
    small = admit(fc, 8, SMALL)
    assert all(t.state == "executing" and t.backend == "" for t in small)
    assert fc.budget.backends.held_total == 0


def test_no_cap_when_max_in_flight_per_backend_is_zero():
    fc = capped(per_backend=0)
    tickets = admit(fc, 8)
    assert all(t.state == "executing" and t.backend == "" for t in tickets)


def test_the_least_loaded_eligible_apiserver_is_reserved_and_an_ineligible_one_never():
    fc = capped(per_backend=2, eligible=["c", "a"])
    tickets = admit(fc, 5)
    assert on_each(tickets) == {"a": 2, "c": 2}
    assert tickets[4].state == "queued"
    assert [t.backend for t in tickets[:4]] == ["c", "a", "c", "a"]


def test_an_apiserver_freed_by_one_level_wakes_an_expensive_list_of_another():
    fc = capped(per_backend=1, backends=("a",))
    fc.estimator.observe("secrets", "", 40 << 20)
    first = fc.admit(User("u1"), BIG, 0.0)[0]
    assert first.state == "executing"
    other = fc.admit(User("u2"), Req("list", "secrets"), 0.0)[0]  # another request shape, same level here
    assert other.state == "queued"
    woken = fc.finish(first)
    assert other in woken and other.backend == "a"


@pytest.mark.parametrize(("cap", "size"), [(1, 3), (2, 3), (1, 2), (4, 3), (2, 1), (1, 5), (1, 8)])
def test_a_fleet_deals_out_each_apiservers_slots_so_they_add_up_to_the_cap(cap: int, size: int):
    per_proxy = []
    for rank in range(size):
        fc = capped(per_backend=cap)
        fc.share_of = FleetShare(size, rank)
        fc.update(fc.policy)
        per_proxy.append(fc.budget.backends.limits)
    on_each_apiserver = [sum(p[name] for p in per_proxy) for name in APISERVERS]
    if size <= cap * len(APISERVERS):
        assert on_each_apiserver == [cap] * 3, per_proxy
    else:  # more proxies than slots: each spare proxy gets one, spread evenly (the stated rounding)
        assert max(on_each_apiserver) == backend_bound(cap, 3, size) < cap + size, per_proxy
    assert all(sum(p.values()) >= 1 for p in per_proxy), "every proxy can run an expensive LIST somewhere"


def test_an_apiservers_slots_are_dealt_again_over_the_others_when_it_is_down_never_added_to_them():
    fleet = [capped(per_backend=1) for _ in range(3)]
    for rank, fc in enumerate(fleet):
        fc.share_of = FleetShare(3, rank)
        fc.update(fc.policy)
    owners = {name: [r for r, fc in enumerate(fleet) if fc.budget.backends.limits[name]] for name in APISERVERS}
    assert sorted(len(o) for o in owners.values()) == [1, 1, 1]
    down = "b"
    for fc in fleet:
        fc.budget.backends.candidates = lambda: ["a", "c"]
    tickets = [t for fc in fleet for t in admit(fc, 2)]
    running = on_each(tickets)
    assert down not in running and max(running.values()) == backend_bound(1, 2, 3) == 2
    assert all(any(t.state == "executing" for t in tickets[2 * r:2 * r + 2]) for r in range(3)), \
        "every proxy can still run an expensive LIST"


def _workers(tmp_path: Path, n: int) -> tuple[SeatLedger, list[FlowController]]:
    parent = SeatLedger.create(tmp_path / "ledger", n)
    out = []
    for i in range(n):
        fc = capped(per_backend=1, backends=("a", "b"))
        ledger = SeatLedger(tmp_path / "ledger", i)
        ledger.backend_rows = {"a": 0, "b": 1}
        fc.budget.backends.count = ledger.backend_count
        fc.level_factory = functools.partial(LedgerLevel, ledger=ledger)
        fc.levels, fc.draining = {}, []
        fc.update(fc.policy)
        out.append(fc)
    return parent, out


def test_the_cap_holds_across_worker_processes(tmp_path):
    _parent, fcs = _workers(tmp_path, 3)
    tickets = [fcs[i % 3].admit(User(f"u{i}"), BIG, 0.0)[0] for i in range(6)]
    assert on_each(tickets) == {"a": 1, "b": 1}
    running = [t for t in tickets if t.state == "executing"]
    a = next(t for t in running if t.backend == "a")
    fcs[tickets.index(a) % 3].finish(a)
    woken = [d for fc in fcs for lv in fc.levels.values() for d in lv.dispatch()]
    assert [t.backend for t in woken] == ["a"]
    assert on_each(tickets) == {"a": 1, "b": 1}


def test_a_dead_workers_expensive_lists_free_their_apiservers(tmp_path):
    parent, fcs = _workers(tmp_path, 2)
    held = [fcs[0].admit(User(f"u{i}"), BIG, 0.0)[0] for i in range(2)]
    assert {t.backend for t in held} == {"a", "b"}
    waiting = fcs[1].admit(User("w"), BIG, 0.0)[0]
    assert waiting.state == "queued"
    parent.clear_worker(0)
    assert [t.backend for t in fcs[1].levels["work"].dispatch()] in (["a"], ["b"])


def test_settings_read_expensive_lists_and_refuse_a_negative_cap(tmp_path):
    def load(section: str):
        path = tmp_path / "proxy.yaml"
        path.write_text("proxy:\n  backends: [{url: 'https://127.0.0.1:6443'}]\n  flowControl:\n"
                        f"    expensiveLists: {section}\n")
        return load_config(path)

    settings = load("{maxInFlightPerBackend: 2, minBytes: 1048576}")
    assert settings.proxy.flow_control.expensive_lists.max_in_flight_per_backend == 2
    with pytest.raises(ConfigError, match="maxInFlightPerBackend"):
        load("{maxInFlightPerBackend: -1}")


def test_a_stale_count_cannot_overrun_the_cap_the_ledger_checks_again_under_its_lock(tmp_path):
    _parent, fcs = _workers(tmp_path, 2)
    held = [fcs[0].admit(User(f"u{i}"), BIG, 0.0)[0] for i in range(2)]
    assert {t.backend for t in held} == {"a", "b"}
    fcs[1].budget.backends.count = lambda name: 0  # read before worker 0 took its slots
    late = fcs[1].admit(User("late"), BIG, 0.0)[0]
    assert late.state == "queued" and not late.holds_seats


def test_an_unsized_list_of_a_storage_only_resource_is_capped_until_its_size_is_known():
    """Before any response the estimate is 0: the first storm of a cold proxy would otherwise land anywhere."""
    fc = capped(per_backend=1)
    fc.estimator.storage_only = frozenset({"secrets"})
    cold = Req("list", "secrets", namespace="cold")
    tickets = admit(fc, 4, cold)
    assert on_each(tickets) == {"a": 1, "b": 1, "c": 1} and tickets[3].state == "queued"
    woken = fc.finish(tickets[0])
    assert woken == [tickets[3]], "an unsized LIST's slot going back wakes the next one (no bytes were freed)"
    other = admit(fc, 3, Req("list", "configmaps", namespace="cold"), user="cm")
    assert all(t.state == "executing" and not t.backend for t in other), "not storage-only: not capped"


def test_an_apiserver_slot_freed_in_one_level_wakes_an_unsized_list_waiting_in_another():
    objs = [queued_level("red", 10), queued_level("blue", 10), queued_level("catch-all", 0),
            flow_schema("red", "red", [{"subjects": [group("red")], "resourceRules": [rr(["*"], ["*"])]}], 100),
            flow_schema("blue", "blue", [{"subjects": [group("blue")], "resourceRules": [rr(["*"], ["*"])]}], 100)]
    fc = FlowController(build_policy([(str(i), o) for i, o in enumerate(objs)], 20),
                        LevelLimits(server_concurrency_limit=20, expensive_lists_per_backend=1,
                                    storage_only_resources=frozenset({"secrets"})))
    caps = fc.budget.backends
    caps.candidates = lambda: ("a",)
    caps.configure(caps.nominal, caps.min_bytes, None, ("a",))
    first = fc.admit(User("u1", groups=["red"]), Req("list", "secrets", namespace="x"), 0.0)[0]
    waiting = fc.admit(User("u2", groups=["blue"]), Req("list", "secrets", namespace="y"), 0.0)[0]
    assert first.level is not waiting.level
    assert first.state == "executing" and waiting.state == "queued"
    assert waiting in fc.finish(first), "no bytes were freed, but an apiserver's slot was"
