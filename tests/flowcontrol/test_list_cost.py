"""A LIST's cost follows its shape: limit, selectors, resourceVersion, and watch cache vs storage.

The examples here are the table in docs/flowcontrol/seats.md.
"""

from __future__ import annotations

import pytest
from test_middleware import req, seeds_settings

from gatekeeper.kube import requestinfo
from gatekeeper.proxy.flowcontrol.core.listcost import ListShape, continued_response, from_storage, list_shape
from gatekeeper.proxy.flowcontrol.core.seats import SizeEstimator
from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse

MIB = 1 << 20


def test_list_shape_reads_the_options_that_decide_cost() -> None:
    s = list_shape("/api/v1/secrets?limit=500&labelSelector=app%3Dweb&resourceVersion=7&continue=abc")
    assert s == ListShape(limit=500, selector=True, resource_version="7", continued=True)
    assert list_shape("/api/v1/secrets") == ListShape()
    assert list_shape("/api/v1/secrets?limit=banana&fieldSelector=") == ListShape()


@pytest.mark.parametrize(
    ("query", "storage"),
    [
        ("", False),  # consistent read: the watch cache (ConsistentListFromCache)
        ("resourceVersion=0&limit=500", False),  # any version
        ("resourceVersionMatch=NotOlderThan&resourceVersion=5", False),
        ("resourceVersionMatch=Exact&resourceVersion=5", True),
        ("limit=500&resourceVersion=5", True),  # legacy exact read of a page
        ("limit=500&continue=xyz", True),
        ("labelSelector=a%3Db", False),  # the cache filters in memory
    ],
)
def test_watch_cache_or_storage_follows_the_cachers_delegation_rules(query: str, storage: bool) -> None:
    assert from_storage(list_shape("/api/v1/secrets?" + query)) is storage
    assert from_storage(list_shape("/api/v1/secrets?" + query), storage_only=True) is True


def learnt(storage_only: frozenset[str] = frozenset()) -> SizeEstimator:
    """80 MiB of secrets (a plain LIST), and 500-object pages of 500 KB (1000 bytes per object)."""
    e = SizeEstimator(bytes_per_seat=8 * MIB, max_seats=10, storage_only=storage_only)
    e.observe("secrets", "", 80 * MIB)
    e.observe("secrets", "", 500_000, list_shape("/api/v1/secrets?limit=500"), continued=True)
    return e


TABLE = [
    # target, seats, bytes (with a watch cache for secrets), seats, bytes (storageOnlyResources: [secrets])
    ("/api/v1/secrets", 10, 80 * MIB, 10, 80 * MIB),
    ("/api/v1/secrets?limit=500", 1, 500_000, 1, 500_000),
    ("/api/v1/secrets?limit=20000", 3, 20_000_000, 3, 20_000_000),
    ("/api/v1/secrets?limit=500&labelSelector=team%3Da", 1, 500_000, 10, 80 * MIB),
    ("/api/v1/secrets?labelSelector=team%3Da", 10, 80 * MIB, 10, 80 * MIB),
    ("/api/v1/secrets?limit=500&resourceVersion=12345&labelSelector=team%3Da", 10, 80 * MIB, 10, 80 * MIB),
    ("/api/v1/secrets?fieldSelector=metadata.name%3Dx", 1, 1000, 1, 1000),
]


@pytest.mark.parametrize(("target", "seats", "nbytes", "s_seats", "s_bytes"), TABLE)
def test_list_cost_table(target: str, seats: int, nbytes: int, s_seats: int, s_bytes: int) -> None:
    info = requestinfo.parse("GET", target)
    for est, want in ((learnt(), (seats, nbytes)), (learnt(frozenset({"secrets"})), (s_seats, s_bytes))):
        got = est.estimate("list", "secrets", "", list_shape(target), single=bool(info.name))
        assert (got.seats, got.list_bytes) == want


def test_before_a_page_is_seen_a_limited_list_costs_the_whole_collection() -> None:
    e = SizeEstimator(bytes_per_seat=8 * MIB)
    e.observe("secrets", "", 80 * MIB)
    assert e.estimate("list", "secrets", "", list_shape("/api/v1/secrets?limit=500")).seats == 10


def test_filtered_responses_do_not_shrink_the_collection_estimate() -> None:
    e = learnt()
    e.observe("secrets", "", 10, list_shape("/api/v1/secrets?labelSelector=a%3Db"))
    e.observe("secrets", "", 10, list_shape("/api/v1/secrets?limit=5&continue=x"), continued=False)
    assert e.list_bytes("secrets", "") == 80 * MIB


def test_continue_token_is_read_from_the_json_metadata_only() -> None:
    page = b'{"kind":"SecretList","metadata":{"resourceVersion":"9","continue":"eyJ2Ijo"},"items":[{"data":"'
    assert continued_response(page, "application/json") is True
    assert continued_response(b'{"metadata":{"continue":""},"items":[]}', "application/json") is False
    assert continued_response(b'{"metadata":{},"items":[{"continue":"x"}]}', "application/json") is False
    assert continued_response(b"k8s\x00...", "application/vnd.kubernetes.protobuf") is None


async def test_middleware_learns_per_object_size_from_a_paginated_response() -> None:
    fc = FlowControl(seeds_settings())
    page = b'{"kind":"SecretList","metadata":{"continue":"abc"},"items":[' + b"x" * 4000 + b"]}"

    async def handler(r: ProxyRequest) -> ProxyResponse:
        async def body():  # type: ignore[no-untyped-def]
            yield page

        return ProxyResponse(status=200, headers=[("content-type", "application/json")], body=body())

    resp = await fc(req("/api/v1/secrets?limit=4"), handler)
    async for _ in resp.body:
        pass
    resp.finish(None)
    assert fc.controller.estimator.per_object["secrets"] == pytest.approx(len(page) / 4)
    assert fc.controller.estimator.list_bytes("secrets", "") == 0  # a page is not the collection


def test_list_options_the_apiserver_drops_are_not_counted_on() -> None:
    """``limit=1;`` is dropped by Go's query parser: the apiserver lists everything, so no limit here."""
    from gatekeeper.proxy.flowcontrol.core.listcost import FULL, list_shape

    assert list_shape("/api/v1/secrets?limit=1;") == FULL
    assert list_shape("/api/v1/secrets?limit=1%zz&labelSelector=a%zz") == FULL
    assert list_shape("/api/v1/secrets?limit=1;&limit=7").limit == 7
    assert list_shape("/api/v1/secrets?limit=5").limit == 5


def test_learned_sizes_are_bounded_and_a_forgotten_namespace_costs_the_whole_collection() -> None:
    """Any caller can LIST a made-up namespace (a 200 with no objects): the table of sizes cannot grow for good."""
    from gatekeeper.proxy.flowcontrol.core.seats import SizeEstimator

    est = SizeEstimator(max_entries=100)
    est.observe("secrets", "", 80 << 20)
    est.observe("secrets", "real", 5 << 20)
    for i in range(1000):
        est.observe("secrets", f"made-up-{i}", 50)
    assert len(est.sizes) <= 100
    assert est.list_bytes("secrets", "real") == 80 << 20  # forgotten: the conservative whole-collection size


def test_a_watch_ignores_limit_and_continue_and_reads_resource_versions_as_the_apiserver_does() -> None:
    """The apiserver streams every object of a watch whatever limit says, and parses the resourceVersion with
    strconv.ParseUint: "00" is 0, the current state first."""
    shape = list_shape("/api/v1/secrets?watch=1&sendInitialEvents=true&limit=1&continue=x").watched()
    assert (shape.limit, shape.continued) == (0, False)
    for rv, resumes in (("", False), ("0", False), ("00", False), ("000", False), ("12", True), ("+12", False),
                        ("1e3", False), ("18446744073709551616", False)):
        assert list_shape(f"/api/v1/secrets?watch=1&resourceVersion={rv}").resumes is resumes, rv
    assert not list_shape("/api/v1/secrets?watch=1&resourceVersion=12&sendInitialEvents=true").resumes
