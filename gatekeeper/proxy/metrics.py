"""Prometheus metrics of the proxy's pipeline (the backend and skew gauges: ``pipeline/stages.py``); the list is in
docs/proxy/metrics.md.

Labels are bounded against invented input (see :func:`resource_label`). The TLS port's ``/metrics`` is for
``listener.metricsGroups`` only."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from prometheus_client import Counter, Histogram

from gatekeeper.proxy.tally import CounterTally, HistogramTally  # before the metrics: its flush collects first
from gatekeeper.runtime.metrics import build_info
from gatekeeper.runtime.metrics import render as render  # the one renderer (multiprocess-aware); pipeline.py's /metrics
from gatekeeper.runtime.ops import this_process_page

render_page: Callable[[], Awaitable[tuple[bytes, str]]] = this_process_page
"""What the proxy's ``/metrics`` answers. A coroutine: a worker awaits the other workers' pages
(``worker_metrics.render_in_worker``) while its loop serves clients."""

build_info()

REQUESTS = Counter(
    "gatekeeper_proxy_requests",
    "Requests answered by each backend, by Kubernetes verb, resource and HTTP code.",
    ["backend", "verb", "resource", "code"],
)
REQUEST_DURATION = Histogram(
    "gatekeeper_proxy_request_duration_seconds",
    "Time from sending a request upstream to the backend's response headers.",
    ["verb"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
UPSTREAM_ERRORS = Counter(
    "gatekeeper_proxy_upstream_errors",
    "Upstream failures by backend and kind (connect, backend, mid_stream).",
    ["backend", "kind"],
)
UPSTREAM_RETRIES = Counter(
    "gatekeeper_proxy_upstream_retries",
    "Safe requests (GET/HEAD without body) sent to another backend after a connect failure.",
)
UPSTREAM_GOAWAYS = Counter(
    "gatekeeper_proxy_upstream_goaways",
    "GOAWAY frames received on multiplexed HTTP/2 upstream connections, by backend: each one "
    "costs a reconnect; many mean the apiserver's --goaway-chance is high or unauthenticated requests reach it.",
    ["backend"],
)
UPSTREAM_H2_STREAMS = Counter(
    "gatekeeper_proxy_upstream_http2_streams",
    "Requests sent as streams on multiplexed HTTP/2 upstream connections, by backend; the "
    "rest of gatekeeper_proxy_requests_total went over HTTP/1.1 (watches, bodies, unverified callers).",
    ["backend"],
)

UPSTREAM_H2_FALLBACKS = Counter(
    "gatekeeper_proxy_upstream_http2_fallbacks",
    "Connections on which a backend answered the HTTP/2 ALPN offer with HTTP/1.1, by backend: the "
    "connection and its request went to the HTTP/1.1 pool; a backend that stays HTTP/1.1 adds one per "
    "upstream.http2RetrySeconds per worker.",
    ["backend"],
)
UPSTREAM_H2_REFUSED = Counter(
    "gatekeeper_proxy_upstream_http2_refused",
    "Multiplexed requests the backend refused on both HTTP/2 stream attempts (above a GOAWAY's last stream id, "
    "or REFUSED_STREAM: provably not processed), sent once over HTTP/1.1 instead, by backend; never an "
    "ejection. A few under load are kube-apiserver's --goaway-chance; many, a backend refusing streams.",
    ["backend"],
)
UPSTREAM_H2_PAUSES = Counter(
    "gatekeeper_proxy_upstream_http2_pauses",
    "Times a 401 on a multiplexed HTTP/2 upstream stream paused multiplexing for that kind of caller (front-proxy "
    "certificate or token) for upstream.http2UnauthorizedPauseSeconds, by backend: a token verified by the proxy "
    "but refused by the apiserver (revoked, or its bound object deleted), or a front-proxy certificate it rejects.",
    ["backend"],
)


_known_resources: set[str] = set()
MAX_KNOWN_RESOURCES = 500
"""Hard cap on learned resource label values (a big cluster with many CRDs serves a few hundred)."""

RESOURCE_HANDLER_ERRORS = frozenset({400, 409, 410, 422})
"""Codes the apiserver gives only from an existing resource's handler; a made-up resource gets 404/401/403/429."""

KNOWN_VERBS = frozenset({
    # Kubernetes verbs RequestInfo derives for resource requests
    "get", "list", "watch", "create", "update", "patch", "delete", "deletecollection", "proxy",
    # lower-case HTTP methods, the verb of non-resource requests
    "head", "post", "put", "options", "connect", "trace",
})


def verb_label(verb: str) -> str:
    """The verb, or ``other`` for one a client made up (``FOO /api``): the label set stays fixed."""
    return verb if verb in KNOWN_VERBS else "other"


def resource_label(resource_key: str, code: int) -> str:
    """The resource label: learned names, ``<unknown>`` for unlearned ones, ``<other>`` past the cap.

    Clients can invent paths, so a name is learned only from an answer only a real resource gives: 1xx-3xx or one of
    :data:`RESOURCE_HANDLER_ERRORS`."""
    if not resource_key:
        return ""
    if resource_key in _known_resources:
        return resource_key
    if code < 400 or code in RESOURCE_HANDLER_ERRORS:
        if len(_known_resources) < MAX_KNOWN_RESOURCES:
            _known_resources.add(resource_key)
            return resource_key
        return "<other>"
    return "<unknown>"


_ResponseTallies = tuple[HistogramTally, CounterTally]
_response_tallies: dict[tuple[str, str, str, int], _ResponseTallies] = {}
_duration_tallies: dict[str, HistogramTally] = {}
MAX_RESPONSE_TALLIES = 4096
"""Bound on the memo of label sets; past it the memo starts over (pending counts are kept, see tally.py)."""


def _tallies_for(backend: str, verb: str, resource_key: str, code: int) -> _ResponseTallies:
    label = verb_label(verb)
    duration = _duration_tallies.get(label)
    if duration is None:
        duration = _duration_tallies[label] = HistogramTally(REQUEST_DURATION.labels(label))
    resource = resource_label(resource_key, code)
    tallies = duration, CounterTally(REQUESTS.labels(backend, label, resource, str(code)))
    if resource != "<unknown>":  # every other answer is final (learned names are never forgotten)
        if len(_response_tallies) >= MAX_RESPONSE_TALLIES:
            _response_tallies.clear()
        _response_tallies[(backend, verb, resource_key, code)] = tallies
    return tallies


def observe_response(backend: str, verb: str, resource_key: str, code: int, seconds: float) -> None:
    """Count one backend answer: one memo lookup and two tallies (``tally.py``) per request."""
    tallies = _response_tallies.get((backend, verb, resource_key, code)) or _tallies_for(
        backend, verb, resource_key, code)
    tallies[0].observe(seconds)
    tallies[1].inc()

