"""The kubernetes Service's endpoints as the fleet's writer plans them, and the writer election (pure cores).

The sandbox test (tests/sandbox/test_deployed_topology_sandbox.py) proves the whole path on real apiservers; these
pin the rules: what is written for which adverts, what is never touched, and who may write when.
"""

from __future__ import annotations

from typing import Any

import pytest

from gatekeeper.base.config import ConfigError, from_mapping
from gatekeeper.proxy.flowcontrol.core import endpoints as ep
from gatekeeper.proxy.flowcontrol.core.fleet import LeaseView
from gatekeeper.proxy.flowcontrol.core.leader import LeaderElection
from gatekeeper.proxy.flowcontrol.edge.fleet import lease_body
from gatekeeper.proxy.flowcontrol.settings import FleetSettings, FlowControlSettings

A, B, C = ep.Advert("10.0.0.11", 6443), ep.Advert("10.0.0.12", 6443), ep.Advert("10.0.0.13", 8443)


def lease(holder: str, annotations: dict[str, str] | None) -> dict[str, Any]:
    return {"metadata": {"name": f"gatekeeper-proxy-{holder}", "annotations": annotations},
            "spec": {"holderIdentity": holder}}


def applied(writes: list[ep.Write], slices: dict[str, dict[str, Any]], endpoints: dict[str, Any] | None
            ) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """The cluster after ``writes`` (an in-memory API for the plan's calls)."""
    slices = dict(slices)
    for w in writes:
        if w.kind == "EndpointSlice":
            if w.op == "delete":
                del slices[w.name]
            else:
                slices[w.name] = dict(w.body or {})
        else:
            endpoints = dict(w.body or {})
    return slices, endpoints


def test_adverts_come_from_the_fleets_leases_and_bad_ones_are_skipped() -> None:
    leases = [lease("cp-1", A.annotations()), lease("cp-2", {ep.ADDRESS_ANNOTATION: "127.0.0.1",
                                                               ep.PORT_ANNOTATION: "6443"}),
              lease("cp-3", {ep.ADDRESS_ANNOTATION: "10.0.0.13", ep.PORT_ANNOTATION: "70000"}),
              lease("cp-4", None), lease("cp-5", {ep.ADDRESS_ANNOTATION: "not-an-ip", ep.PORT_ANNOTATION: "1"}),
              {"metadata": "garbage"}, lease("", A.annotations())]
    assert ep.adverts_of(leases) == {"cp-1": A}


def test_one_port_is_one_slice_named_kubernetes_and_one_endpoints_subset() -> None:
    slices = ep.desired_slices([B, A])
    assert list(slices) == ["kubernetes"]
    s = slices["kubernetes"]
    assert s["addressType"] == "IPv4" and s["ports"] == [{"name": "https", "port": 6443, "protocol": "TCP"}]
    assert [e["addresses"] for e in s["endpoints"]] == [["10.0.0.11"], ["10.0.0.12"]]
    assert s["metadata"]["labels"] == {ep.SERVICE_NAME_LABEL: "kubernetes", ep.MANAGED_BY_LABEL: ep.MANAGED_BY}
    e = ep.desired_endpoints([B, A])
    assert e["metadata"]["labels"] == {ep.SKIP_MIRROR_LABEL: "true"}
    assert e["subsets"] == [{"addresses": [{"ip": "10.0.0.11"}, {"ip": "10.0.0.12"}],
                             "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]}]


def test_proxies_on_different_ports_or_families_get_a_slice_each() -> None:
    v6 = ep.Advert("fd00::1", 6443)
    slices = ep.desired_slices([A, C, v6])
    assert list(slices) == ["kubernetes", "kubernetes-ipv4-8443", "kubernetes-ipv6-6443"]
    assert slices["kubernetes-ipv6-6443"]["addressType"] == "IPv6"
    assert ep.published(slices.values()) == ("10.0.0.11:6443", "10.0.0.13:8443", "[fd00::1]:6443")
    assert [s["ports"][0]["port"] for s in ep.desired_endpoints([A, C])["subsets"]] == [6443, 8443]


def test_an_empty_cluster_gets_the_slice_and_the_endpoints_and_then_nothing_more() -> None:
    writes = ep.plan([A, B], [], None)
    assert [(w.op, w.kind, w.name) for w in writes] == [("create", "EndpointSlice", "kubernetes"),
                                                         ("create", "Endpoints", "kubernetes")]
    slices, endpoints = applied(writes, {}, None)
    assert ep.plan([B, A], slices.values(), endpoints) == []


def test_a_changed_set_updates_in_place_keeping_the_resource_version_and_foreign_metadata() -> None:
    slices, endpoints = applied(ep.plan([A, B], [], None), {}, None)
    slices["kubernetes"]["metadata"] = {**slices["kubernetes"]["metadata"], "resourceVersion": "41",
                                        "annotations": {"x": "y"}}
    writes = ep.plan([A], slices.values(), endpoints)
    (update, endpoints_update) = writes
    assert (update.op, update.name) == ("update", "kubernetes") and endpoints_update.kind == "Endpoints"
    assert update.body is not None
    assert update.body["metadata"]["resourceVersion"] == "41" and update.body["metadata"]["annotations"] == {"x": "y"}
    assert [e["addresses"] for e in update.body["endpoints"]] == [["10.0.0.11"]]


def test_the_apiservers_own_slice_is_taken_over_and_stale_fleet_slices_go() -> None:
    upstream = {"metadata": {"name": "kubernetes", "labels": {ep.SERVICE_NAME_LABEL: "kubernetes"},
                             "resourceVersion": "7"},
                "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.21"], "conditions": {"ready": True}}],
                "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]}
    stale = {**ep.desired_slices([C, A])["kubernetes-ipv4-8443"]}
    mirrored = {"metadata": {"name": "kubernetes-abcde", "labels": {
        ep.SERVICE_NAME_LABEL: "kubernetes", ep.MANAGED_BY_LABEL: "endpointslicemirroring-controller.k8s.io"}},
        "addressType": "IPv4"}
    writes = ep.plan([A], [upstream, stale, mirrored], None)
    assert {(w.op, w.name) for w in writes if w.kind == "EndpointSlice"} == {
        ("update", "kubernetes"), ("delete", "kubernetes-ipv4-8443")}  # another manager's slice is left alone
    (update,) = [w for w in writes if w.op == "update"]
    assert update.body is not None and update.body["metadata"]["labels"][ep.MANAGED_BY_LABEL] == ep.MANAGED_BY


def test_an_address_family_change_replaces_the_slice() -> None:
    slices, endpoints = applied(ep.plan([A], [], None), {}, None)
    writes = ep.plan([ep.Advert("fd00::1", 6443)], slices.values(), endpoints)
    assert [(w.op, w.name) for w in writes if w.kind == "EndpointSlice"] == [("delete", "kubernetes"),
                                                                              ("create", "kubernetes")]


def test_no_advert_left_writes_nothing_so_the_last_set_stays() -> None:
    slices, endpoints = applied(ep.plan([A], [], None), {}, None)
    assert ep.plan([], slices.values(), endpoints) == []


def test_the_advert_rides_on_the_fleet_lease_and_goes_when_dropped() -> None:
    settings = FleetSettings(enabled=True)
    assert lease_body(settings, "cp-1", 0.0, A.annotations())["metadata"]["annotations"] == A.annotations()
    assert "annotations" not in lease_body(settings, "cp-1", 0.0, {})["metadata"]


# -- the writer election -----------------------------------------------------------------------------------------

def record(holder: str, renewed: str, rv: str = "1") -> LeaseView:
    return LeaseView("gatekeeper-endpoints-f", holder, renewed, 15.0, rv)


def test_the_first_proxy_creates_the_writer_lease_and_renews_it() -> None:
    me = LeaderElection("cp-1", 15.0)
    assert me.observe(None, 0.0) == "create"
    me.wrote(0.0)
    assert me.leading(1.0)
    assert me.observe(record("cp-1", "t1"), 5.0) == "renew"


def test_a_live_holder_is_followed_and_an_expired_one_taken_over() -> None:
    other = LeaderElection("cp-2", 15.0)
    assert other.observe(record("cp-1", "t1"), 0.0) == "follow"
    assert other.observe(record("cp-1", "t2"), 10.0) == "follow"  # renewed: the clock starts again
    assert other.observe(record("cp-1", "t2"), 24.9) == "follow"
    assert other.observe(record("cp-1", "t2"), 25.0) == "acquire"
    assert other.observe(record("", "t3"), 26.0) == "acquire"  # released on drain: at once
    assert not other.leading(26.0)


def test_a_holder_that_cannot_renew_stops_writing_before_anyone_may_take_over() -> None:
    me = LeaderElection("cp-1", 15.0)
    me.observe(None, 0.0)
    me.wrote(0.0)
    assert me.leading(9.9) and not me.leading(10.0)  # two thirds of the duration, as client-go
    me.wrote(12.0)
    me.lost()
    assert not me.leading(12.5)


# -- settings ---------------------------------------------------------------------------------------------------

def flow(fleet: dict[str, Any]) -> FlowControlSettings:
    settings: FlowControlSettings = from_mapping(FlowControlSettings, {"fleet": fleet}, "t.yaml", "flowControl")
    settings.validate()
    return settings


def test_publishing_needs_the_fleet_and_a_usable_address() -> None:
    with pytest.raises(ValueError, match=r"needs fleet\.enabled"):
        flow({"publishEndpoints": {"enabled": True, "advertiseAddress": "10.0.0.11"}})
    for bad in ("127.0.0.1", "169.254.1.1", "::1", "0.0.0.0", "node-1"):
        with pytest.raises(ValueError, match="advertiseAddress"):
            flow({"enabled": True, "publishEndpoints": {"enabled": True, "advertiseAddress": bad}})
    with pytest.raises(ConfigError, match="publishEndpoints"):
        flow({"enabled": True, "publishEndpoints": {"enabled": True, "advertize": "x"}})


def test_the_advert_defaults_to_host_ip_and_the_listener_port() -> None:
    publish = flow({"enabled": True, "publishEndpoints": {"enabled": True}}).fleet.publish_endpoints
    assert publish.resolve(6443, {"HOST_IP": "10.0.0.11"}) == ("10.0.0.11", 6443)
    with pytest.raises(ValueError, match="HOST_IP"):
        publish.resolve(6443, {})
    with pytest.raises(ValueError, match="advertisePort"):
        publish.resolve(0, {"HOST_IP": "10.0.0.11"})
    explicit = flow({"enabled": True, "publishEndpoints": {"enabled": True, "advertiseAddress": "fd00::1",
                                                           "advertisePort": 443}}).fleet.publish_endpoints
    assert explicit.resolve(8443, {"HOST_IP": "10.0.0.11"}) == ("fd00::1", 443)


async def test_the_endpoint_calls_carry_the_fleets_own_identity() -> None:
    from gatekeeper.proxy.flowcontrol.edge.endpoints import publisher_for
    from gatekeeper.proxy.flowcontrol.edge.fleet import FleetMember
    from gatekeeper.proxy.flowcontrol.settings import PublishEndpointsSettings
    from gatekeeper.proxy.messages import UserInfo

    sent: list[list[tuple[str, str]]] = []

    class Upstream:
        name = "a"

        async def call(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes | None, *,
                       deadline: float, max_bytes: int) -> tuple[int, bytes]:
            sent.append(headers)
            return 200, b"{}"

    fleet = FleetMember(FleetSettings(enabled=True, identity="p1"), lambda share: {},
                        user=UserInfo(name="system:gk", groups=["g1"]))
    fleet.upstreams = [Upstream()]  # type: ignore[list-item]
    publisher = publisher_for(fleet, PublishEndpointsSettings(enabled=True, advertise_address="10.0.0.7"), 6443,
                              writer=True)
    assert publisher is not None
    await publisher._request("PATCH", "/x", {"a": 1})
    assert sent == [[("accept", "application/json"), ("x-remote-user", "system:gk"), ("x-remote-group", "g1"),
                     ("content-type", "application/json")]]
