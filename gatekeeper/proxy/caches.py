"""Every cache and memo a proxy process keeps, with its bound, as two gauges read at scrape time.

Why in one place: a cache that grows without a bound is a leak that takes months to show (issue 46). Each entry
here names the structure, its bound in entries and the most one entry may hold; docs/operations/memory.md turns
them into bytes per worker, and a test checks that every name here is in that table. The caches stay where they
are used (memos on the hot path are plain dicts and ``lru_cache``: no indirection per request); this module only
reads their sizes when ``/metrics`` is scraped. Token caches are per pipeline: :func:`watch_tokens` adds them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gatekeeper.proxy import metrics as proxy_metrics
from gatekeeper.proxy.flowcontrol.core import controller, listcost, queueset
from gatekeeper.proxy.h2wire import hpack_encode, huffman
from gatekeeper.proxy.identity.tokens.fetch import TokenIdentities
from gatekeeper.proxy.listen import h2_headers
from gatekeeper.proxy.pipeline import stages
from gatekeeper.proxy.upstream import hop_by_hop, mux_wire


@dataclass(frozen=True)
class Cache:
    """One bounded structure of a proxy process."""

    name: str
    """The ``cache`` label value."""
    bound: int
    """Most entries it holds (per process; per pipeline for the token caches)."""
    size: Callable[[], int]
    """Entries it holds now."""


def _lru(fn: object) -> Callable[[], int]:
    return lambda: fn.cache_info().currsize  # type: ignore[attr-defined]


STATIC: tuple[Cache, ...] = (
    Cache("hpack_encode_fields", hpack_encode.MEMO_ENTRIES, lambda: len(hpack_encode._memo)),
    Cache("huffman_decode", huffman.MEMO_ENTRIES, _lru(huffman._memo)),
    Cache("huffman_decode_short", huffman.SHORT_MEMO_ENTRIES, _lru(huffman._short_memo)),
    Cache("h2_request_fields", h2_headers.FIELD_MEMO_ENTRIES, lambda: len(h2_headers._checked_fields)),
    Cache("h2_response_fields", h2_headers.RESPONSE_MEMO_ENTRIES, lambda: len(h2_headers._response_fields)),
    Cache("upstream_request_fields", mux_wire.MEMO_ENTRIES, lambda: len(mux_wire._memo)),
    Cache("hop_by_hop_names", hop_by_hop.MAX_NAMES, lambda: len(hop_by_hop._NAMES)),
    Cache("checked_targets", stages._checked_target.cache_info().maxsize or 0, _lru(stages._checked_target)),
    Cache("flow_hashes", controller.flow_hash.cache_info().maxsize or 0, _lru(controller.flow_hash)),
    Cache("queue_hands", queueset.deal.cache_info().maxsize or 0, _lru(queueset.deal)),
    Cache("list_shapes", listcost.list_shape.cache_info().maxsize or 0, _lru(listcost.list_shape)),
    Cache("response_metric_labels", proxy_metrics.MAX_RESPONSE_TALLIES, lambda: len(proxy_metrics._response_tallies)),
    Cache("resource_label_values", proxy_metrics.MAX_KNOWN_RESOURCES, lambda: len(proxy_metrics._known_resources)),
)
TOKEN_CACHES = ("tokens_verified", "tokens_failed")
"""Per pipeline, bounded by ``flowControl.tokens.cacheEntries`` and ``failedCacheEntries``."""
FLOW_CACHES = ("list_sizes", "watch_start_buckets")
"""Per flow control: learned LIST sizes by namespace (a caller can LIST made-up namespaces), and the watch-start
buckets of callers who owe a watch (``flowControl.watchStarts.maxFlows``)."""

_identities: weakref.WeakSet[TokenIdentities] = weakref.WeakSet()
_controllers: weakref.WeakSet[controller.FlowController] = weakref.WeakSet()


def watch_tokens(identities: TokenIdentities) -> None:
    """Report this pipeline's token caches too (weakly: a closed pipeline drops out)."""
    _identities.add(identities)


def watch_flow_control(ctl: controller.FlowController) -> None:
    """Report this flow control's learned sizes and watch-start buckets too (weakly, as the token caches)."""
    _controllers.add(ctl)


def current() -> list[Cache]:
    """Every cache of this process now: the static ones, then each watched pipeline's token caches."""
    out = list(STATIC)
    for ident in list(_identities):
        c = ident.classifier
        out.append(Cache(TOKEN_CACHES[0], c.verified.max_entries, c.verified.__len__))
        out.append(Cache(TOKEN_CACHES[1], c.failed.max_entries, c.failed.__len__))
    for ctl in list(_controllers):
        out.append(Cache(FLOW_CACHES[0], ctl.estimator.max_entries, ctl.estimator.sizes.__len__))
        out.append(Cache(FLOW_CACHES[1], ctl.watch_starts.max_flows, ctl.watch_starts.__len__))
    return out


class _Gauges(Collector):
    def collect(self) -> Iterator[Metric]:
        entries = GaugeMetricFamily("gatekeeper_proxy_cache_entries",
                                    "Entries in each bounded cache or memo (summed over workers).", labels=["cache"])
        bound = GaugeMetricFamily("gatekeeper_proxy_cache_bound_entries",
                                  "Most entries each cache or memo may hold (summed over workers).", labels=["cache"])
        totals: dict[str, tuple[int, int]] = {}
        for c in current():
            n, b = totals.get(c.name, (0, 0))
            totals[c.name] = (n + c.size(), b + c.bound)
        for name, (n, b) in totals.items():
            entries.add_metric([name], n)
            bound.add_metric([name], b)
        yield entries
        yield bound


REGISTRY.register(_Gauges())
