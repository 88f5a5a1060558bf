"""Everything after the protocol adapters: identity -> RequestInfo -> [flow control] -> balancer + upstream.

Flow control may coalesce identical LISTs and call the dispatcher once for many, so everything the dispatcher
holds (backend lease, pooled connection) is released when the body is exhausted or closed or ``finish()`` is
called: the caller only has to drive or drop the body it got.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gatekeeper.kube import requestinfo
from gatekeeper.kube.duration import DurationError
from gatekeeper.proxy import metrics, rejections, target
from gatekeeper.proxy.adapter import error_response
from gatekeeper.proxy.identity import auth
from gatekeeper.proxy.identity.tokens.classify import source_host, unverified_flow
from gatekeeper.proxy.identity.tokens.fetch import TokenIdentities
from gatekeeper.proxy.messages import Handler, Headers, Middleware, ProxyRequest, ProxyResponse, UserInfo, one_chunk
from gatekeeper.proxy.pipeline.balancer import Backend, Balancer, EjectionPolicy, Lease
from gatekeeper.proxy.pipeline.deadline import INVALID_TIMEOUT, Deadlines, request_timeout
from gatekeeper.proxy.pipeline.settings import PipelineSettings
from gatekeeper.proxy.upstream import errors as up
from gatekeeper.proxy.upstream.client import BackendClient
from gatekeeper.runtime.tasks import stop_task

log = logging.getLogger("gatekeeper.proxy.pipeline.stages")
upstream_log = rejections.RateLimitedLog(log, rejections.LOG_INTERVAL)
"""A dead backend fails every request; one line per backend per interval says so."""

SAFE_METHODS = frozenset({"GET", "HEAD"})
RELAYED_SUBRESOURCES = frozenset({"proxy", "log", "exec", "attach", "portforward"})
"""Subresources whose answer the apiserver relays from another server (a pod, endpoints, a kubelet)."""
BUILTIN_GROUPS = frozenset({
    "admissionregistration.k8s.io", "apiextensions.k8s.io", "apiregistration.k8s.io", "apps",
    "authentication.k8s.io", "authorization.k8s.io", "autoscaling", "batch", "certificates.k8s.io",
    "coordination.k8s.io", "discovery.k8s.io", "events.k8s.io", "flowcontrol.apiserver.k8s.io",
    "internal.apiserver.k8s.io", "networking.k8s.io", "node.k8s.io", "policy", "rbac.authorization.k8s.io",
    "resource.k8s.io", "scheduling.k8s.io", "storage.k8s.io", "storagemigration.k8s.io",
})
"""API groups kube-apiserver serves itself (no aggregated ones); one missing only makes the storm detector see less."""


def own_answer(method: str, info: requestinfo.RequestInfo) -> bool:
    """Whether a 5xx answer says something about the apiserver itself, so it may feed the storm detector. Not when
    a tenant decides the status, else one tenant could empty the rotation: relayed subresources (a Service without
    endpoints is a 503), groups outside :data:`BUILTIN_GROUPS` (a down APIService is a 503 to anyone), and writes
    (a failing admission webhook makes every apiserver answer 500)."""
    if info.verb == "proxy" or info.subresource in RELAYED_SUBRESOURCES:
        return False
    if method not in SAFE_METHODS:
        return False
    if info.is_resource_request:
        return info.api_prefix == "api" or info.api_group in BUILTIN_GROUPS
    path = info.path
    if path.startswith("/openapi/v3/apis/"):  # the aggregator relays a group's spec from its own server
        path = path[11:]
    if path.startswith("/apis/"):
        group = path[6:].partition("/")[0]
        return not group or group in BUILTIN_GROUPS
    return True


# --- middlewares --------------------------------------------------------------------------------


_checked_target = functools.lru_cache(maxsize=4096)(target.check)
"""``target.check`` is pure and clients repeat their targets; long targets are checked every time."""
MEMO_TARGET_CHARS = 512


def _refuse_target(request: ProxyRequest) -> ProxyResponse | None:
    """The answer to a target that could steer or mis-classify the request (target.py), or to ``OPTIONS *``."""
    if len(request.target) <= MEMO_TARGET_CHARS:
        bad = _checked_target(request.method, request.target)
    else:
        bad = target.check(request.method, request.target)
    if bad is not None:
        rejections.reject(bad.reason, f"{request.peer} {request.method}: {bad.message}")
        return error_response(400, "BadRequest", f"gatekeeper proxy: {bad.message}")
    if request.target == "*":
        # What Go's net/http (and so kube-apiserver) answers to OPTIONS *: 200, no body.
        return ProxyResponse(status=200, headers=[("content-length", "0")])
    return None


def _establish_identity(request: ProxyRequest) -> ProxyResponse | None:
    """Drop Connection-named and client-sent X-Remote-* headers and set ``request.user``, or refuse its name."""
    bad = auth.bad_certificate_names(request.peer_cert, request.connection_memo)
    if bad:
        rejections.reject("bad_identity", f"{request.peer}: {bad}")
        return error_response(401, "Unauthorized", f"gatekeeper proxy: {bad}")
    request.headers = auth.strip_remote(auth.drop_connection_named(request.headers))
    request.user = auth.identify(request.peer_cert, request.headers, request.connection_memo)
    return None


def _metrics_page_for(metrics_groups: Collection[str]) -> Callable[[ProxyRequest], Awaitable[ProxyResponse]]:
    """``GET /metrics`` on the main port: it names every backend and callers' resources, so only verified
    client-certificate users in ``metrics_groups`` get it (a token cannot be checked here); others a 403."""
    allowed = frozenset(metrics_groups)
    needs = ", ".join(sorted(allowed)) or "(none: proxy.listener.metricsGroups is empty)"

    async def own_page(request: ProxyRequest) -> ProxyResponse:
        user = request.user or auth.identify(request.peer_cert, request.headers)
        if user.source != "x509" or allowed.isdisjoint(user.groups):
            return error_response(
                403, "Forbidden",
                f'gatekeeper proxy: user "{user.name}" cannot get path "/metrics" on the proxy: it needs a '
                f"client certificate in one of the groups {needs} (proxy.listener.metricsGroups), "
                "or read the proxy's metricsPort listener",
            )
        body, content_type = await metrics.render_page()
        return ProxyResponse(status=200, headers=[("content-type", content_type),
                                                  ("content-length", str(len(body)))],
                             body=one_chunk(b"" if request.method == "HEAD" else body))

    return own_page


def _is_local(request: ProxyRequest) -> bool:
    return request.method in SAFE_METHODS and request.target.split("?", 1)[0] == "/metrics"


async def resolve_token(identities: TokenIdentities, request: ProxyRequest) -> str:
    """Who a bearer-token caller is, for classification, queuing and caps (the token goes upstream untouched)."""
    credential = auth.bearer_credential(request.headers)
    who = identities.cached(credential, request.connection_memo) or await identities.resolve(credential)
    request.identity = who
    request.token_verified = who.verified
    request.caller = who.name if who.verified else unverified_flow(request.peer)
    return credential


def front_for(metrics_groups: Collection[str], deadlines: Deadlines | None = None,
              request_timeout_seconds: float = 60.0, identities: TokenIdentities | None = None) -> Middleware:
    """The front stage: target checks, ``OPTIONS *``, the caller, RequestInfo, ``/metrics``, the deadline; one stage
    so everything after it sees the same caller whether flow control is on or not."""
    own_page = _metrics_page_for(metrics_groups)
    deadlines = deadlines or Deadlines()

    async def front(request: ProxyRequest, next_handler: Handler) -> ProxyResponse:
        refused = _refuse_target(request) or _establish_identity(request)
        if refused is not None:
            return refused
        request.info = info = requestinfo.parse(request.method, request.target)
        if _is_local(request):
            return await own_page(request)
        try:
            seconds = request_timeout(info, request.target, request_timeout_seconds)
        except DurationError as exc:
            rejections.reject("bad_timeout", f"{request.peer} {request.method} {request.target[:200]}: {exc}")
            return error_response(400, "BadRequest", f"{INVALID_TIMEOUT} - {exc}")
        credential = ""
        if identities is not None and request.user is not None and request.user.source == "token":
            credential = await resolve_token(identities, request)
        if seconds is not None:
            deadlines.arm(request, seconds)  # leaves the registry by itself once this task is done
        response = await next_handler(request)
        if response.upgraded is not None:
            deadlines.disarm(request)  # the 101 starts a tunnel (exec, attach, port-forward): not a request
        if credential and request.token_verified and response.status == 401:
            # Verified here but refused upstream (revoked, or its pod or secret gone): later requests are unverified.
            identities.refused_upstream(credential)  # type: ignore[union-attr]
        return response

    return front


def chain(middlewares: Sequence[Middleware], final: Handler) -> Handler:
    handler = final
    for mw in reversed(middlewares):
        handler = _bind(mw, handler)
    return handler


def _bind(mw: Middleware, next_handler: Handler) -> Handler:
    """``request -> mw(request, next_handler)`` without an extra coroutine per stage and request."""
    return lambda request: mw(request, next_handler)


# --- the final handler --------------------------------------------------------------------------


def upstream_headers(headers: Headers, user: UserInfo, peer: str) -> Headers:
    """Client headers without spoofable ``X-Remote-*``, the proxy's identity assertion added (x509 callers), and the
    client address appended to X-Forwarded-For (the apiserver logs it as a source IP in audit), in one pass."""
    out: Headers = []
    prior: list[str] = []
    for k, v in headers:
        if k == "x-forwarded-for":
            if peer:
                prior.append(v)
                continue
        elif k.lower().startswith(auth.REMOTE_PREFIX):
            continue
        out.append((k, v))
    if user.source == "x509":
        out += auth.identity_headers(user)
    if peer:
        prior.append(source_host(peer))
        out.append(("x-forwarded-for", ", ".join(prior)))
    return out


def is_upgrade(request: ProxyRequest) -> bool:
    """An HTTP/1.1 protocol switch (WebSocket for kubectl >= 1.30 exec/attach/port-forward, SPDY/3.1). The front
    stage left ``Connection`` as this one field, and only beside an ``Upgrade`` (``auth.drop_connection_named``)."""
    return request.protocol == "http/1.1" and ("connection", "upgrade") in request.headers


class Dispatcher:
    """Choose a backend per request and forward; retries only a safe request that failed at connect."""

    def __init__(self, balancer: Balancer, clients: dict[str, BackendClient], *,
                 max_long_running_per_caller: int = 0) -> None:
        """``max_long_running_per_caller``: ``upstream.maxLongRunningPerCaller`` (0: no cap, for tests)."""
        self.balancer = balancer
        self.clients = clients
        self.max_long_running_per_caller = max_long_running_per_caller

    def _over_long_running_cap(self, request: ProxyRequest, caller: str) -> ProxyResponse | None:
        """A 429 when ``caller`` holds its share of long-running requests: watches run outside every seat and hold
        a pooled connection for 30-60 min, so unbounded one tenant could take the whole pool."""
        cap = self.max_long_running_per_caller
        held = self.balancer.long_running_of(caller)
        if not cap or held < cap:
            return None
        rejections.reject("long_running_cap", f"{request.peer} ({caller}): {held} long-running requests open, "
                          f"{request.method} {request.target[:200]} refused")
        return error_response(429, "TooManyRequests",
                              f"gatekeeper proxy: {held} long-running requests (watches, followed logs, exec, "
                              "port-forward) of this caller are open through this proxy, its limit "
                              "(upstream.maxLongRunningPerCaller); close some or retry later", retry_after=1)

    async def __call__(self, request: ProxyRequest) -> ProxyResponse:
        info, user = request.info, request.user
        assert info is not None and user is not None, "the front stage sets both"
        upgrade = is_upgrade(request)
        long_running = info.long_running or upgrade
        caller = ""
        if long_running:
            # The front stage's caller or whom an allowed impersonator acts for; else the certificate or anonymous.
            caller = request.caller or user.name
            refused = self._over_long_running_cap(request, caller)
            if refused is not None:
                return refused
        headers = upstream_headers(request.headers, user, request.peer)
        asserts_identity = auth.wants_front_proxy_cert(user)
        reserved = self.balancer.by_name.get(request.reserved_backend)
        safe = request.method in SAFE_METHODS and request.body is None and not upgrade and reserved is None
        tried: set[str] = set()
        last_error = ""
        while True:
            backend = reserved or self.balancer.choose(tried)
            if backend is None:
                return error_response(503, "ServiceUnavailable",
                                      f"gatekeeper proxy: no apiserver reachable ({last_error})", retry_after=1)
            client = self.clients[backend.name]
            lease = self.balancer.acquire(backend, long_running=long_running, caller=caller)
            started = time.monotonic()
            try:
                response = await client.send(request, headers, identity=asserts_identity,
                                             swallow_body_errors=info.verb == "watch", on_done=_Done(backend, lease),
                                             long_running=info.long_running, upgrade=upgrade,
                                             multiplex=(asserts_identity or request.token_verified) and not upgrade)
            except up.ConnectFailed as exc:
                lease.release()
                self._connect_failed(backend, exc)
                tried.add(backend.name)
                last_error = f"{backend.name}: {exc}"
                if safe:
                    metrics.UPSTREAM_RETRIES.inc()
                    continue
                # Nothing reached the backend; client-go re-sends on 503 + Retry-After.
                return error_response(503, "ServiceUnavailable",
                                      f"gatekeeper proxy: apiserver {backend.name} unreachable ({exc})", retry_after=1)
            except up.AFTER_CONNECT as exc:
                lease.release()
                return self._failed(request, info, backend, exc)
            except BaseException:
                lease.release()
                raise
            if own_answer(request.method, info):
                self.balancer.report_response(backend, response.status)
            metrics.observe_response(backend.name, info.verb, info.resource_key, response.status,
                                     time.monotonic() - started)
            response.on_complete.append(lease.release)
            return response

    def _connect_failed(self, backend: Backend, exc: up.ConnectFailed) -> None:
        self.balancer.report_connect_failure(backend)
        metrics.UPSTREAM_ERRORS.labels(backend.name, "connect").inc()
        upstream_log.warning(f"connect:{backend.name}", f"connect to {backend.name} failed: {exc.__cause__ or exc}")

    def _failed(self, request: ProxyRequest, info: requestinfo.RequestInfo, backend: Backend,
                exc: Exception) -> ProxyResponse:
        """The answer to an exchange that failed after connecting, and what it says about the backend. Exception
        details (addresses, SSLContext reprs) go to the log only, not to the client."""
        what = f"{request.method} {request.target[:200]}"
        if isinstance(exc, up.PoolTimeout):
            rejections.reject("pool_timeout", str(exc))
            return error_response(503, "ServiceUnavailable", f"gatekeeper proxy: apiserver {backend.name} is busy "
                                  "(no free connection in time)", retry_after=1)
        if isinstance(exc, up.UpstreamTimeout):
            rejections.reject("upstream_header_timeout", f"{what}: {exc}")
            return error_response(504, "Timeout", f"gatekeeper proxy: apiserver {backend.name} did not answer in time")
        if isinstance(exc, up.ClientBodyFailed):  # the client broke off its own body: nothing to eject
            log.debug("%s: %s", what, exc)
            return error_response(400, "BadRequest", "gatekeeper proxy: the request body ended early")
        if isinstance(exc, up.NoFrontProxyCert):
            return error_response(500, "InternalError", f"gatekeeper proxy: {exc}")
        metrics.UPSTREAM_ERRORS.labels(backend.name, "backend").inc()
        if isinstance(exc, up.RequestResetByBackend):
            # This request's stream, not the backend: no ejection, else any client's malformed GETs empty the rotation.
            if own_answer(request.method, info):
                self.balancer.report_response(backend, 502)
            upstream_log.warning(f"reset:{backend.name}", f"{what} on {backend.name}: {exc}")
            return error_response(502, "InternalError", f"gatekeeper proxy: apiserver {backend.name} reset the request")
        self.balancer.report_connect_failure(backend)  # BackendFailed: the connection broke before an answer
        upstream_log.warning(f"failed:{backend.name}", f"{what} on {backend.name} failed: {exc.__cause__ or exc}")
        return error_response(502, "InternalError",
                              f"gatekeeper proxy: apiserver {backend.name} failed before answering")


class _Done:
    """The upstream body ended: free the lease, count a body cut off by the backend (``on_done``)."""

    __slots__ = ("backend", "lease")

    def __init__(self, backend: Backend, lease: Lease) -> None:
        self.backend = backend
        self.lease = lease

    def __call__(self, error: BaseException | None) -> None:
        self.lease.release()
        if error is not None and not isinstance(error, (asyncio.CancelledError, GeneratorExit)):
            metrics.UPSTREAM_ERRORS.labels(self.backend.name, "mid_stream").inc()


@dataclass(eq=False)
class Pipeline:
    """A built pipeline: the handler for the adapters plus what must start and stop with it."""

    handler: Handler
    balancer: Balancer
    clients: dict[str, BackendClient]
    health_interval: float
    deadlines: Deadlines
    identities: TokenIdentities
    """Token callers' identities (the front stage's); started and closed with the pipeline."""
    _probe_task: asyncio.Task[None] | None = field(default=None, repr=False)

    def upstream_connections(self, backend: str) -> int:
        client = self.clients.get(backend)
        return client.connections() if client else 0

    async def start(self) -> None:
        _sources.add(self)
        await self.identities.start()  # the issuer's keys, before the first token caller
        await self.probe_once()
        self._probe_task = asyncio.create_task(self._probe_loop(), name="gatekeeper-proxy-health")

    async def probe_once(self) -> None:
        results = await asyncio.gather(*(self.clients[b.name].probe() for b in self.balancer.backends))
        for backend, ok in zip(self.balancer.backends, results, strict=True):
            before = self.balancer.health(backend)
            self.balancer.report_probe(backend, ok)
            after = self.balancer.health(backend)
            if before != after:
                log.info("backend %s: %s -> %s", backend.name, before, after)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.probe_once()
            except Exception:  # keep probing whatever one round did
                log.exception("health probe round failed")

    def ready(self) -> bool:
        """At least one backend can take requests."""
        return any(self.balancer.health(b) == "healthy" for b in self.balancer.backends)

    async def close(self) -> None:
        await stop_task(self._probe_task)
        self._probe_task = None
        self.deadlines.close()
        await self.identities.close()
        await asyncio.gather(*(c.close() for c in self.clients.values()))


_sources: weakref.WeakSet[Pipeline] = weakref.WeakSet()
"""The started pipelines whose backends the collector shows; a process normally runs one, tests may run several."""


class BackendCollector(Collector):
    """Gauges read from balancer state when scraped, so they can never drift from it. Here, beside the pipeline it
    reads, so it reads the balancer itself rather than a description of it."""

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily("gatekeeper_proxy_backend_in_flight",
                                      "Requests each backend is serving now, watches included.",
                                      labels=["backend"])
        watches = GaugeMetricFamily("gatekeeper_proxy_backend_watches",
                                    "Open long-running requests per backend.", labels=["backend"])
        conns = GaugeMetricFamily("gatekeeper_proxy_upstream_connections",
                                  "Pooled connections (busy + idle) per backend.", labels=["backend"])
        up = GaugeMetricFamily("gatekeeper_proxy_backend_up",
                               "1 if the backend receives new requests.", labels=["backend"])
        state = GaugeMetricFamily("gatekeeper_proxy_backend_state",
                                  "1 for the backend's current health state.", labels=["backend", "state"])
        ejections = CounterMetricFamily("gatekeeper_proxy_backend_ejections",
                                        "Passive ejections per backend.", labels=["backend"])
        skew_flight = GaugeMetricFamily("gatekeeper_proxy_skew_in_flight_ratio",
                                        "(max+1)/(min+1) of per-backend in-flight requests; 1 is even.")
        skew_rate = GaugeMetricFamily("gatekeeper_proxy_skew_request_rate_ratio",
                                      "(max+1)/(min+1) of per-backend recent request counts; 1 is even.")
        any_source = False
        for source in list(_sources):
            any_source = True
            bal = source.balancer
            for b in bal.backends:
                in_flight.add_metric([b.name], b.in_flight)
                watches.add_metric([b.name], b.watches)
                conns.add_metric([b.name], source.upstream_connections(b.name))
                health = bal.health(b)
                up.add_metric([b.name], 1.0 if health == "healthy" else 0.0)
                for s in ("healthy", "ejected", "unready"):
                    state.add_metric([b.name, s], 1.0 if s == health else 0.0)
                ejections.add_metric([b.name], b.ejections_total)
            skew = bal.skew()
            skew_flight.add_metric([], skew.in_flight_ratio)
            skew_rate.add_metric([], skew.rate_ratio)
        yield from (in_flight, watches, conns, up, state, ejections)
        if any_source:
            yield skew_flight
            yield skew_rate


REGISTRY.register(BackendCollector())


def build(
    settings: PipelineSettings,
    *,
    flow_control: Middleware | None = None,
    policy: EjectionPolicy | None = None,
    balancer: Balancer | None = None,
) -> Pipeline:
    """target -> identity -> RequestInfo -> /metrics -> deadline (one front stage) -> [flow control] -> dispatcher."""
    balancer = balancer or Balancer(settings.backends, policy=policy)
    clients = {b.name: BackendClient(b.name, b.url, settings.upstream) for b in balancer.backends}
    deadlines = Deadlines()
    identities = TokenIdentities(settings.tokens)
    identities.use_upstream(list(clients.values()))
    middlewares: list[Middleware] = [front_for(settings.listener.metrics_groups, deadlines,
                                               settings.protocol.request_timeout_seconds, identities)]
    if flow_control is not None:
        middlewares.append(flow_control)
    handler = chain(middlewares, Dispatcher(
        balancer, clients, max_long_running_per_caller=settings.upstream.max_long_running_per_caller))
    return Pipeline(handler=handler, balancer=balancer, clients=clients,
                    health_interval=settings.upstream.health_interval_seconds, deadlines=deadlines,
                    identities=identities)
