"""Identical queued LISTs of one identity join one dispatch; different identities never do."""

from __future__ import annotations

from collections import deque

from fc_helpers import Req, User
from test_queueing import controller

from gatekeeper.proxy.flowcontrol.core.coalesce import coalesce_key, identity_key

LIST = Req("list", "secrets", namespace="ns")
TARGET = "/api/v1/namespaces/ns/secrets?limit=500"
HDRS = [("accept", "application/json"), ("authorization", "Bearer abc")]


def key_for(user: str, headers=HDRS, target=TARGET, method="GET"):
    return coalesce_key(method, target, headers, identity_key(user, [], "token", headers))


def test_key_separates_identities_queries_and_formats():
    base = key_for("alice")
    assert base == key_for("alice")
    assert base != key_for("bob")
    assert base != key_for("alice", headers=[("accept", "application/json"), ("authorization", "Bearer xyz")])
    assert base != key_for(
        "alice", headers=[("accept", "application/vnd.kubernetes.protobuf"), ("authorization", "Bearer abc")]
    )
    assert base != key_for("alice", target=TARGET + "&labelSelector=a%3Db")
    assert base != key_for("alice", headers=[*HDRS, ("impersonate-user", "eve")])
    assert key_for("alice", method="POST") is None


def test_identical_waiters_join_the_next_dispatch():
    fc = controller(queues=8, hand=2, total=1)
    first, _, _ = fc.admit(User("alice"), LIST, 0.0, key=("other",))
    same = [fc.admit(User("alice"), LIST, 0.0, key=key_for("alice"))[0] for _ in range(5)]
    bob = [fc.admit(User("bob"), LIST, 0.0, key=key_for("bob"))[0] for _ in range(2)]
    assert first.state == "executing" and all(t.state == "queued" for t in same + bob)
    running = deque([first])
    upstream_calls = []
    while running:
        t = running.popleft()
        for d in fc.finish(t):
            if d.state == "executing":
                upstream_calls.append(d)
                running.append(d)
                assert fc.levels["work"].executing_seats == 1  # followers hold no seats
    leaders = [t for t in upstream_calls if t in same]
    assert len(leaders) == 1, "five identical queued LISTs must make one upstream call"
    leader = leaders[0]
    assert sorted(map(id, leader.followers)) == sorted(id(t) for t in same if t is not leader)
    assert all(t.leader is leader and t.state == "done" for t in leader.followers)
    bob_leaders = [t for t in upstream_calls if t in bob]
    assert len(bob_leaders) == 1 and not any(f in same for f in bob_leaders[0].followers)
    assert len(upstream_calls) == 2


def test_requests_without_key_are_never_merged():
    fc = controller(queues=8, hand=2, total=1)
    a = fc.admit(User("alice"), LIST, 0.0)[0]
    b = fc.admit(User("alice"), LIST, 0.0)[0]
    c = fc.admit(User("alice"), LIST, 0.0)[0]
    assert fc.finish(a) == [b] and b.followers == [] and c.state == "queued"


async def test_empty_shared_response_reaches_every_follower():
    from test_middleware import Upstream, call, req, seeds_settings, until

    from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl

    fc = FlowControl(seeds_settings())
    up = Upstream(body=b"")
    import asyncio

    up.gate.clear()
    blockers = [asyncio.create_task(call(fc, req(target=f"/api/v1/namespaces/n{i}/secrets"), up)) for i in range(2)]
    await until(lambda: up.calls == 2, "two blockers to hold both seats")
    same = [asyncio.create_task(call(fc, req(), up)) for _ in range(4)]
    level = fc.controller.levels["secrets-list"]
    await until(lambda: level.waiting == 4, "four identical LISTs to queue")
    up.gate.set()
    results = await asyncio.gather(*blockers, *same)
    assert [s for s, _, _ in results] == [200] * 6
    assert up.calls == 3
