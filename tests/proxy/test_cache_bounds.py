"""Every cache and memo of a proxy process has a bound, a metric and a line in the sizing table (issue 46)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY

from gatekeeper.proxy import caches
from gatekeeper.proxy.flowcontrol.core import listcost
from gatekeeper.proxy.h2wire import hpack_encode
from gatekeeper.proxy.identity.tokens.fetch import TokenIdentities
from gatekeeper.proxy.identity.tokens.settings import TokenSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "proxy" / "memory.md"


def test_every_cache_has_a_bound_and_holds_no_more() -> None:
    for c in caches.current():
        assert c.bound > 0, c.name
        assert 0 <= c.size() <= c.bound, c.name


def test_every_cache_is_in_the_sizing_table() -> None:
    text = DOC.read_text()
    missing = [name for name in [c.name for c in caches.STATIC] + list(caches.TOKEN_CACHES)
               + list(caches.FLOW_CACHES) if f"`{name}`" not in text]
    assert not missing, f"docs/proxy/memory.md does not size: {missing}"


def test_the_gauges_follow_the_caches() -> None:
    identities = TokenIdentities(TokenSettings(cache_entries=77))
    caches.watch_tokens(identities)
    identities.classifier.verified.put(b"k" * 32, object(), expires=2.0, now=1.0)  # type: ignore[arg-type]
    entries = REGISTRY.get_sample_value("gatekeeper_proxy_cache_entries", {"cache": "tokens_verified"})
    bound = REGISTRY.get_sample_value("gatekeeper_proxy_cache_bound_entries", {"cache": "tokens_verified"})
    assert entries is not None and entries >= 1
    assert bound is not None and bound >= 77
    assert REGISTRY.get_sample_value("gatekeeper_proxy_cache_bound_entries",
                                     {"cache": "hpack_encode_fields"}) == hpack_encode.MEMO_ENTRIES


def test_long_list_targets_are_parsed_but_not_kept() -> None:
    """A target may be as long as the header-list limit: memoized, 4096 of them would pin gigabytes."""
    memo_before = listcost.list_shape.cache_info().currsize
    for i in range(20):
        target = f"/api/v1/secrets?limit={i + 1}&labelSelector=" + "a" * (10_000 + 1000 * i)
        shape = listcost.list_shape(target)
        assert shape.limit == i + 1 and shape.selector
    assert listcost.list_shape.cache_info().currsize == memo_before
    short = "/api/v1/secrets?limit=7&resourceVersion=0&x=" + str(memo_before)
    assert listcost.list_shape(short).limit == 7
    assert listcost.list_shape.cache_info().currsize == memo_before + 1


def test_flow_controls_learned_sizes_and_watch_buckets_are_reported_with_their_bounds() -> None:
    from gatekeeper.proxy.flowcontrol.core.controller import FlowController
    from gatekeeper.proxy.flowcontrol.edge.defaults import SEEDS_POLICY
    from gatekeeper.proxy.flowcontrol.edge.loading import load_policy
    from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings

    ctl = FlowController(load_policy(FlowControlSettings(files=[str(SEEDS_POLICY)])))
    caches.watch_flow_control(ctl)
    ctl.estimator.observe("secrets", "ns-1", 1000)
    found = {c.name: (c.size(), c.bound) for c in caches.current() if c.name in caches.FLOW_CACHES}
    assert found["list_sizes"][0] >= 1 and found["list_sizes"][1] == ctl.estimator.max_entries
    assert found["watch_start_buckets"][1] == ctl.watch_starts.max_flows
