"""A fleet of proxies holds one budget: shares with their rounding, membership by the local clock, the
growth/shrink rules, and the partition fallback (core/fleet.py), and the Lease edge against a fake apiserver."""

from __future__ import annotations

import asyncio
import itertools

import orjson
import pytest
from fc_helpers import queued_level, secrets_list_schema
from prometheus_client import REGISTRY

from gatekeeper.proxy.flowcontrol.core.fleet import FleetShare, LeaseView, Membership, fleet_bound, share
from gatekeeper.proxy.flowcontrol.edge.fleet import FleetMember, lease_body, parse_leases
from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl
from gatekeeper.proxy.flowcontrol.settings import FleetSettings, FlowControlSettings

TTL = 15.0


@pytest.mark.parametrize("size", range(1, 7))
@pytest.mark.parametrize("limit", [1, 2, 3, 5, 10, 98, 588])
def test_shares_add_up_to_the_budget_or_one_seat_per_proxy(limit: int, size: int) -> None:
    shares = [share(limit, size, rank, "secrets-list") for rank in range(size)]
    assert all(s >= 1 for s in shares), "a proxy with 0 seats would 429 every client pinned to it"
    assert sum(shares) == fleet_bound(limit, size) == (max(limit, size) if size > 1 else limit)
    assert max(shares) - min(shares) <= 1


def test_the_seeds_two_seats_over_three_proxies_overshoot_by_one_and_say_so() -> None:
    assert [share(2, 3, r, "secrets-list") for r in range(3)] == [1, 1, 1]
    assert fleet_bound(2, 3) == 3


def test_left_over_seats_of_different_levels_land_on_different_proxies() -> None:
    levels = [f"level-{i}" for i in range(12)]
    with_extra = {next(r for r in range(3) if share(4, 3, r, lv) == 2) for lv in levels}
    assert len(with_extra) > 1


def lease(name: str, renew: str, holder: str | None = None) -> LeaseView:
    return LeaseView(name, holder or name, renew, TTL)


def test_a_lease_is_alive_while_its_renew_time_keeps_changing_by_the_local_clock() -> None:
    m = Membership("a", TTL, fallback_members=3)
    m.renewed(0)
    m.observe([lease("a", "t0"), lease("b", "t0")], now=0)
    assert m.alive(0) == ("a", "b")
    m.observe([lease("a", "t1"), lease("b", "t0")], now=10)  # b stopped renewing at local time 0
    assert m.alive(10) == ("a", "b")
    m.observe([lease("a", "t2"), lease("b", "t0")], now=16)
    assert m.alive(16) == ("a",)
    m.observe([lease("a", "t3"), lease("b", "t5")], now=17)  # b is back
    assert m.alive(17) == ("a", "b")


def test_a_growing_fleet_takes_effect_at_once_and_a_shrinking_one_when_the_lease_expires() -> None:
    m = Membership("a", TTL, fallback_members=1)
    for t in range(0, 100, 5):
        m.renewed(t)
        m.observe([lease("a", f"a{t}"), lease("b", f"b{t}")] + ([lease("c", f"c{t}")] if t >= 20 else []), t)
        size, _ = m.decide(t)
        assert size == (3 if t >= 20 else 2), t  # c joined: at once
    # c stops renewing at t=95 (its renewTime stays "c95"): its Lease expires at t=110, within the TTL
    sizes = {}
    for t in range(100, 160, 5):
        m.renewed(t)
        m.observe([lease("a", f"a{t}"), lease("b", f"b{t}"), lease("c", "c95")], t)
        sizes[t] = m.decide(t)[0]
    assert all(sizes[t] == 3 for t in range(100, 110, 5)), sizes
    assert all(sizes[t] == 2 for t in range(110, 160, 5)), sizes


def test_a_proxy_that_keeps_coming_and_going_moves_the_others_shares_at_most_once_per_ttl() -> None:
    m = Membership("a", TTL, fallback_members=1)
    changes: list[tuple[int, int]] = []
    renew, last = 0, None
    for t in range(0, 400):
        m.renewed(t)
        if t % 40 < 3:  # b renews for 3 s, then is silent 37 s (longer than a TTL)
            renew += 1
        m.observe([lease("a", f"a{t}"), lease("b", f"b{renew}")], t)
        size = m.decide(t)[0]
        if size != last:
            changes.append((t, size))
            last = size
    shrinks = [t for t, size in changes if size == 1]
    assert len(shrinks) >= 5
    assert all(later - earlier >= TTL for earlier, later in itertools.pairwise(shrinks))
    assert all(t - grown >= TTL for (grown, size_before), (t, size) in itertools.pairwise(changes)
               if size == 1 and size_before == 2), changes


def test_a_flapping_proxy_never_lowers_the_fleet_size_the_others_use() -> None:
    m = Membership("a", TTL, fallback_members=1)
    renew = 0
    for t in range(0, 200, 5):
        m.renewed(t)
        if (t // 10) % 2 == 0:  # b renews for 10 s, pauses 10 s, ...: never a whole TTL without renewing
            renew += 1
        m.observe([lease("a", f"a{t}"), lease("b", f"b{renew}")], t)
        assert m.decide(t)[0] == 2, t


def test_a_partitioned_proxy_falls_back_to_a_conservative_share_never_unlimited() -> None:
    m = Membership("a", TTL, fallback_members=4)
    m.renewed(0)
    m.observe([lease("a", "t0"), lease("b", "t0")], 0)
    assert m.decide(0) == (2, 0)
    assert not m.partitioned(10)
    assert m.partitioned(15) and m.decide(15)[0] == 4  # max(last fleet 2, fallbackMembers 4)
    m2 = Membership("a", TTL, fallback_members=1)
    assert m2.partitioned(0) and m2.decide(0) == (1, 0)  # never renewed, alone: its own budget, not more


def test_flow_control_runs_only_its_share_of_a_level() -> None:
    async def go() -> None:
        fc = FlowControl(FlowControlSettings(
            server_concurrency_limit=100,
            priority_level_configurations=[queued_level("secrets-list", 4), queued_level("catch-all", 96)],
            flow_schemas=[secrets_list_schema(by="ByUser")]))
        before = fc.controller.levels["secrets-list"].nominal
        seats = fc.share_seats(FleetShare(3, 0))
        here, whole = seats["secrets-list"]
        assert whole == before and here == fc.controller.levels["secrets-list"].nominal
        assert sum(share(whole, 3, r, "secrets-list") for r in range(3)) == whole
        fc.apply(fc.controller.policy)  # a policy reload keeps the fleet's division
        assert fc.controller.levels["secrets-list"].nominal == here
    asyncio.run(go())


class FakeApiserver:
    """Answers the Lease apply and list as kube-apiserver would, from a dict of Leases."""

    name = "fake"
    ssl_identity = object()

    def __init__(self, others: list[dict], status: int = 200) -> None:
        self.others = others
        self.status = status
        self.calls: list[tuple[str, str, list[tuple[str, str]], bytes | None]] = []

    async def call(self, method, path, headers, body=None, *, deadline, max_bytes):
        self.calls.append((method, path, headers, body))
        if self.status != 200:
            return self.status, b'{"kind":"Status"}'
        if method == "PATCH":
            return 200, body
        mine = [orjson.loads(c[3]) for c in self.calls if c[0] == "PATCH"][-1:]
        return 200, orjson.dumps({"kind": "LeaseList", "items": [*mine, *self.others]})


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_the_lease_edge_applies_its_lease_as_the_proxy_and_divides_by_the_fleet() -> None:
    settings = FleetSettings(enabled=True, identity="node-a")
    others = [lease_body(settings, "node-b", 0), lease_body(settings, "node-c", 0),
              {"metadata": {}, "spec": "not a lease"}]  # a malformed item is skipped
    applied: list = []

    def apply(share_of):
        applied.append(share_of)
        return {"secrets-list": (share_of("secrets-list", 2), 2)}

    async def go() -> None:
        api = FakeApiserver(others)
        member = FleetMember(settings, apply)
        member.use_upstream([api])
        await member.renew_and_list()
        member.step_decision()
        method, path, headers, body = api.calls[0]
        assert method == "PATCH" and "fieldManager=gatekeeper-proxy" in path and "force=true" in path
        assert path.startswith("/apis/coordination.k8s.io/v1/namespaces/gatekeeper-system/leases/"
                               "gatekeeper-proxy-node-a")
        assert ("x-remote-user", "system:gatekeeper-proxy") in headers  # its own identity (tokens.proxyUser)
        sent = orjson.loads(body)
        assert sent["spec"]["holderIdentity"] == "node-a"
        assert sent["metadata"]["labels"] == {"gatekeeper.dev/fleet": "gatekeeper"}
        assert "labelSelector=gatekeeper.dev%2Ffleet%3Dgatekeeper" in api.calls[1][1]
        assert member.decided == (3, 0)
        assert sample("gatekeeper_fleet_members") == 3
        assert sample("gatekeeper_fleet_share_seats", priority_level="secrets-list") == 1
    asyncio.run(go())


def test_a_forbidden_renewal_is_counted_and_never_widens_the_share() -> None:
    settings = FleetSettings(enabled=True, identity="node-z", fallback_members=3)

    async def go() -> None:
        member = FleetMember(settings, lambda share_of: {"l": (share_of("l", 6), 6)})
        member.use_upstream([FakeApiserver([], status=403)])
        before = sample("gatekeeper_fleet_lease_renew_failures_total", reason="forbidden") or 0
        await member.renew_and_list()
        member.step_decision()
        assert sample("gatekeeper_fleet_lease_renew_failures_total", reason="forbidden") == before + 1
        assert member.decided == (3, 0)  # never renewed: the fallback fleet, 2 of the 6 seats
    asyncio.run(go())


def test_without_the_front_proxy_certificate_the_fleet_refuses_to_start() -> None:
    class Plain(FakeApiserver):
        ssl_identity = None

    member = FleetMember(FleetSettings(enabled=True, identity="n"), lambda s: {})
    with pytest.raises(ValueError, match="clientCertFile"):
        member.use_upstream([Plain([])])


def test_parse_leases_reads_a_lease_list() -> None:
    s = FleetSettings()
    views = parse_leases(orjson.dumps({"items": [lease_body(s, "x", 0)]}))
    assert views == [LeaseView("gatekeeper-proxy-x", "x", views[0].renew_time, 15.0)]
