"""Shuffle sharding, fair dispatch, bounded waits and reject reasons of one priority level (pure core)."""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest
from fc_helpers import Req, User, flow_schema, group, queued_level, rr

from gatekeeper.proxy.flowcontrol.core.controller import FlowController, LevelLimits, flow_hash
from gatekeeper.proxy.flowcontrol.core.objects import PriorityLevel
from gatekeeper.proxy.flowcontrol.core.policy import build_policy
from gatekeeper.proxy.flowcontrol.core.queueset import deal, level_max_seats

LIST = Req("list", "configmaps", namespace="ns")


def controller(queues=16, hand=4, qlen=50, total=2, reject=False, limits=None) -> FlowController:
    level = queued_level("work", 1, queues=queues, hand=hand, qlen=qlen)
    if reject:
        level["spec"]["limited"]["limitResponse"] = {"type": "Reject"}
    zero_catch_all = queued_level("catch-all", 0)
    objs = [
        level,
        zero_catch_all,
        flow_schema(
            "work",
            "work",
            [{"subjects": [group("*")], "resourceRules": [rr(["*"], ["*"])]}],
            100,
            by="ByUser",
        ),
    ]
    policy = build_policy([(str(i), o) for i, o in enumerate(objs)], total)
    return FlowController(policy, limits or LevelLimits(server_concurrency_limit=total))


def test_hand_is_a_deterministic_function_of_the_flow():
    h = flow_hash("work", "alice")
    assert h == flow_hash("work", "alice") and h != flow_hash("work", "bob")
    assert deal(h, 64, 8) == deal(h, 64, 8)
    assert h != flow_hash("other", "alice")
    # known values: the hand is stable across releases (changing it would reshuffle every flow)
    assert deal(0, 10, 3) == (0, 1, 2)
    # 123456789 = digits 21, 68, 34, 60 in radices 128, 127, 126, 125; each steps over earlier digits
    assert deal(123456789, 128, 4) == (21, 69, 35, 62)


def test_hands_are_distinct_cards_within_the_deck():
    rnd = random.Random(7)
    for _ in range(5000):
        deck = rnd.randint(1, 256)
        hand = rnd.randint(1, min(deck, 7))
        cards = deal(rnd.getrandbits(64), deck, hand)
        assert len(set(cards)) == hand and all(0 <= c < deck for c in cards)


def test_hands_spread_flows_over_queues():
    first = Counter(deal(flow_hash("s", f"user-{i}"), 64, 8)[0] for i in range(6400))
    assert len(first) == 64 and max(first.values()) < 3 * 100


def drain(fc: FlowController, running: deque, steps: int) -> list[str]:
    """Finish the oldest executing request ``steps`` times; return the users dispatched, in order."""
    order = []
    for _ in range(steps):
        t = running.popleft()
        for d in fc.finish(t):
            order.append(d.payload)
            running.append(d)
    return order


def submit(fc, who: str, n: int, running: deque, req=LIST, now=0.0):
    out = []
    for _ in range(n):
        t, _fs, dispatched = fc.admit(User(who), req, now)
        t.payload = who
        for d in dispatched:
            running.append(d)
        out.append(t)
    return out


def test_light_flow_gets_equal_share_against_a_flood():
    fc = controller(queues=16, hand=1)
    assert deal(flow_hash("work", "flood"), 16, 1) != deal(flow_hash("work", "light"), 16, 1)
    running: deque = deque()
    submit(fc, "flood", 40, running)
    submit(fc, "light", 10, running)
    order = drain(fc, running, 20)
    share = Counter(order)
    assert abs(share["flood"] - share["light"]) <= 2, order
    # once the light flow is done, the flood gets everything
    assert set(drain(fc, running, 10)) == {"flood"}


def test_share_is_by_seats_not_requests():
    fc = controller(queues=16, hand=1, total=14)  # a level where one request may take up to 3 seats
    running: deque = deque()
    fc.estimator.observe("secrets", "ns", 2 * fc.limits.bytes_per_seat)  # secrets LISTs cost 2 seats
    submit(fc, "heavy", 30, running, req=Req("list", "secrets", namespace="ns"))
    submit(fc, "light", 30, running)
    order = drain(fc, running, 30)
    share = Counter(order)
    assert 1.5 <= share["light"] / share["heavy"] <= 2.6, share


def test_flood_spread_over_its_hand_cannot_starve_a_light_flow():
    fc = controller(queues=64, hand=8)
    running: deque = deque()
    submit(fc, "flood", 50 * 8, running)
    submit(fc, "light", 5, running)
    order = drain(fc, running, 60)
    assert order.count("light") == 5
    assert order.index("light") < 12


def test_queue_full_and_timeout_and_concurrency_limit():
    fc = controller(queues=1, hand=1, qlen=2, total=1)
    running: deque = deque()
    ts = submit(fc, "a", 4, running, now=10.0)
    assert [t.state for t in ts] == ["executing", "queued", "queued", "rejected"]
    assert ts[3].reason == "queue-full"
    assert [t.deadline for t in ts[1:3]] == [10.0 + 15.0] * 2  # the middleware's queue-wait timer fires then
    assert all(fc.timeout(t, 10.0 + 15.0) for t in ts[1:3])
    assert all(t.reason == "time-out" for t in ts[1:3]) and not fc.timeout(ts[0], 30.0)
    fr = controller(reject=True, total=1)
    a, _, _ = fr.admit(User("a"), LIST, 0.0)
    b, _, _ = fr.admit(User("b"), LIST, 0.0)
    assert (a.state, b.state, b.reason) == ("executing", "rejected", "concurrency-limit")


@pytest.mark.parametrize(
    ("limit", "hand", "expected"),
    # upstream's Test_GetMaxSeats table (apf_controller): 15% of the level, and at most limit // handSize
    [(5, 6, 1), (10, 6, 1), (15, 6, 2), (20, 6, 3), (100, 6, 15), (200, 6, 30), (10, 1, 2), (100, 20, 5)],
)
def test_level_max_seats_follow_upstream(limit, hand, expected):
    spec = PriorityLevel(name="l", uid="u", exempt=False, queues=64, hand_size=hand)
    assert level_max_seats(spec, limit) == expected


def test_big_lists_share_the_seeds_two_seat_level():
    # the seeds' shape: 2 seats, 16 queues, hand 4 -> one seat per request, so two 60 MiB LISTs run together
    fc = controller(queues=16, hand=4, total=2)
    fc.estimator.observe("secrets", "", 60 << 20)
    ts = submit(fc, "a", 3, deque(), req=Req("list", "secrets"))
    assert [t.seats for t in ts] == [1, 1, 1]
    assert [t.state for t in ts] == ["executing", "executing", "queued"]


def test_wide_list_seats_scale_in_a_big_level_and_list_bytes_cap_holds():
    fc = controller(queues=8, hand=2, total=100,
                    limits=LevelLimits(server_concurrency_limit=100, list_bytes_cap=100 << 20))
    fc.estimator.observe("secrets", "", 60 << 20)
    ts = submit(fc, "a", 2, deque(), req=Req("list", "secrets"))
    assert ts[0].seats == 8  # ceil(60 MiB / 8 MiB); the level allows up to min(15, 50)
    # seats would allow both; the 100 MiB in-flight LIST budget does not
    assert [t.state for t in ts] == ["executing", "queued"]
    assert [d for d in fc.finish(ts[0])] == [ts[1]]
    fr = controller(queues=8, hand=2, total=4, reject=True)
    fr.estimator.observe("secrets", "", 60 << 20)
    a, _, _ = fr.admit(User("a"), Req("list", "secrets"), 0.0)
    assert (a.state, a.seats) == ("executing", 4)  # a Reject level caps only at its limit: runs alone


def test_watch_releases_seats_at_first_bytes():
    fc = controller(queues=4, hand=1, total=1)
    w, _, _ = fc.admit(User("a"), Req("watch", "pods", namespace="n"), 0.0)
    q, _, _ = fc.admit(User("b"), LIST, 0.0)
    assert (w.state, q.state) == ("executing", "queued")
    assert fc.release_seats(w) == [q]
    assert w.state == "executing" and fc.levels["work"].executing_seats == 1
    assert fc.finish(w) == [] and fc.levels["work"].executing_seats == 1


@pytest.mark.parametrize("reason", ["cancelled"])
def test_cancelled_waiter_leaves_its_queue(reason):
    fc = controller(queues=1, hand=1, total=1)
    running: deque = deque()
    a, b = submit(fc, "a", 2, running)
    fc.cancel(b)
    assert b.state == reason and fc.levels["work"].waiting == 0
    assert fc.finish(a) == []


def test_policy_update_keeps_queues_and_applies_new_limit():
    fc = controller(queues=4, hand=1, total=1)
    running: deque = deque()
    ts = submit(fc, "a", 3, running)
    bigger = controller(queues=4, hand=1, total=3).policy
    # the raised limit lets the two waiting requests run at once
    assert fc.update(bigger, LevelLimits(server_concurrency_limit=3)) == ts[1:]
    assert fc.levels["work"].limit == 3 and fc.levels["work"].executing_seats == 3


def test_distinguisher_byuser_bynamespace_or_none_picks_the_flow():
    objs = [
        queued_level("work", 1),
        queued_level("catch-all", 0),
        *(
            flow_schema(
                name, "work", [{"subjects": [group("*")], "resourceRules": [rr([verb], ["configmaps"])]}], 100, by
            )
            for name, verb, by in (
                ("by-user", "list", "ByUser"),
                ("by-ns", "get", "ByNamespace"),
                ("one", "create", ""),
            )
        ),
    ]
    fc = FlowController(build_policy([(str(i), o) for i, o in enumerate(objs)], 100))

    def flow(who: str, verb: str, ns: str) -> int:
        return fc.admit(User(who), Req(verb, "configmaps", namespace=ns), 0.0)[0].flow

    assert flow("alice", "list", "a") == flow("alice", "list", "b") == flow_hash("by-user", "alice")
    assert flow("bob", "list", "a") == flow_hash("by-user", "bob")
    assert flow("alice", "get", "a") == flow("bob", "get", "a") == flow_hash("by-ns", "a")
    assert flow("alice", "get", "b") == flow_hash("by-ns", "b")
    assert flow("alice", "create", "a") == flow("bob", "create", "b") == flow_hash("one", "")
