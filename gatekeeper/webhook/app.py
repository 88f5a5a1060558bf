"""The webhook's HTTP edge: aiohttp routes around the pure policies.

Routes: ``POST /validate`` (size policy), ``POST /mutate`` (GPU policy),
``GET /healthz``, ``GET /readyz``, ``GET /metrics``. This module only maps
HTTP to :mod:`gatekeeper.webhook.policies` and exceptions to status codes:
a body that is not an AdmissionReview v1 gets 400 with the reason as text,
never a traceback.

Metrics (Prometheus):

``gatekeeper_webhook_reviews_total{policy,operation,decision}``
    ``policy`` is ``secret-size``, ``gpu`` or ``none`` (no policy for that
    kind); ``decision`` is allowed, warned, denied, mutated, skipped or error. An error that is
    the webhook's own (a bug: 500; a ResourceClaimTemplate it cannot create: 503) is answered as an
    HTTP error with a ``Status`` body, so the configuration's ``failurePolicy`` decides (Fail refuses
    the write, Ignore admits it unchanged); only a refusal of the caller (403) is a denial.
``gatekeeper_webhook_review_duration_seconds{route}``
    Time from body received to response built (template creation included).
``gatekeeper_webhook_bad_requests_total{route}``
    Bodies rejected with 400; route ``http`` for malformed HTTP that aiohttp refused before any route
    (logged at debug level only, listen.py).
``gatekeeper_webhook_gpu_rewrites_total{mode}``
    Pods rewritten, by GPU mode.
``gatekeeper_webhook_gpu_mode_decisions_total{mode,source}``
    GPU pods decided, by mode and what chose it (annotation, namespace, default, enforced, opt-out).
``gatekeeper_webhook_gpu_denials_total{reason}``
    GPU pods denied, by reason: ``unknown-model``, ``unknown-fallback``, ``memory-too-large``,
    ``contradictory-ask`` (HAMi resources that contradict each other or the mode), ``too-many-ways``,
    ``forbidden`` (an enforced namespace) or ``invalid`` (anything else the pod got wrong).
``gatekeeper_webhook_template_reconciliations_total{result}``
    ResourceClaimTemplate checks: created, exists (409), cached, error; and the lifecycle loop's
    recreated (deleted while pods use it) and collected (unreferenced past the grace period).
``gatekeeper_webhook_refused_requests_total{route,reason}``
    Requests refused before any policy ran: ``too-large`` (413, above
    ``server.maxBodyBytes``) or ``unauthenticated`` (403, no verified
    apiserver client certificate while ``server.clientCaFile`` is set), and
    reviews whose object creation was refused for an unverified caller
    (``unauthenticated-create``), ``body-timeout`` (408, body not received within
    ``server.bodyTimeoutSeconds``), ``content-encoding`` (415, a compressed body) and
    ``body-budget`` (503, bodies being read already hold ``server.maxBufferedBodyBytes``),
    ``body-budget-caller`` (503, an unverified caller's bodies already hold its
    ``server.maxBufferedBodyCallerShare`` of that budget) and
    ``write-timeout`` (a response not taken within ``server.writeTimeoutSeconds``: connection aborted;
    route ``other`` for the ops endpoints).
``gatekeeper_webhook_connections_total``
    TLS connections whose handshake completed. kube-apiserver keeps its connections to a webhook open and reuses
    them (HTTP/1.1 keep-alive, up to ``idleTimeoutSeconds`` idle), so this grows with apiservers and idle periods,
    not with reviews; growing with reviews means every review pays a TLS handshake (about 24 reviews' worth of
    CPU, measured with callgrind).
``gatekeeper_webhook_refused_connections_total{reason}``
    ``connection-cap``: a connection closed after its handshake because
    ``server.maxConnections`` were open; ``request-budget``: a connection aborted because
    the worker's connections held more than ``server.maxBufferedRequestBytes`` of request heads
    and queued requests and it held the most (listen.py, request_budget.py); ``handshake-timeout``:
    a connection that did not finish TLS within ``server.tlsHandshakeTimeoutSeconds`` (accept.py).

Trust: with ``server.clientCaFile`` only the apiserver (a client certificate
from that CA whose CN or DNS SAN is in ``allowedClientNames``) gets reviews
answered. Without it every caller is unverified: reviews are still answered
(a forged review only hurts its sender, since the apiserver never sees the
answer), but nothing is ever created for one, so a pod that POSTs a forged
AdmissionReview cannot make the webhook create ResourceClaimTemplates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

import orjson
from aiohttp import web
from prometheus_client import Counter, Histogram

from gatekeeper.kube.admission import Decision, ReviewError, parse_review, response
from gatekeeper.kube.status import failure_json
from gatekeeper.runtime.metrics import build_info, child
from gatekeeper.runtime.ops import add_ops_routes
from gatekeeper.webhook import policies
from gatekeeper.webhook.body import TRIM_AFTER_BYTES, BodyTooLarge, heap_trimmer, read_body
from gatekeeper.webhook.deviceclasses import ExtendedResourceMap
from gatekeeper.webhook.namespace_modes import NamespaceModes
from gatekeeper.webhook.settings import ServerSettings, WebhookSettings
from gatekeeper.webhook.templates import TemplateError, TemplateKeeper

log = logging.getLogger(__name__)
_TRIM = heap_trimmer()


class Metrics:
    """The webhook's collectors (created once per process)."""

    def __init__(self) -> None:
        build_info()
        self.reviews = Counter("gatekeeper_webhook_reviews_total", "Admission reviews answered",
                               ["policy", "operation", "decision"])
        self.duration = Histogram("gatekeeper_webhook_review_duration_seconds", "Review latency",
                                  ["route"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                      0.1, 0.25, 0.5, 1.0, 2.5))
        self.bad_requests = Counter("gatekeeper_webhook_bad_requests_total", "Bodies rejected with 400",
                                    ["route"])
        self.rewrites = Counter("gatekeeper_webhook_gpu_rewrites_total", "GPU pods rewritten", ["mode"])
        self.mode_decisions = Counter("gatekeeper_webhook_gpu_mode_decisions_total",
                                      "GPU pods decided, by mode and by what chose the mode", ["mode", "source"])
        self.gpu_denials = Counter("gatekeeper_webhook_gpu_denials_total", "GPU pods denied, by reason",
                                   ["reason"])
        self.templates = Counter("gatekeeper_webhook_template_reconciliations_total",
                                 "ResourceClaimTemplate create-if-missing results", ["result"])
        self.refused = Counter("gatekeeper_webhook_refused_requests_total",
                               "Requests refused before or instead of acting on them", ["route", "reason"])
        self.refused_connections = Counter("gatekeeper_webhook_refused_connections_total",
                                           "Connections closed by the listener's bounds "
                                           "(maxConnections, maxBufferedRequestBytes, tlsHandshakeTimeoutSeconds)",
                                           ["reason"])
        self.connections = Counter("gatekeeper_webhook_connections_total",
                                   "TLS connections accepted (handshake completed, before any connection cap): the "
                                   "apiserver keeps its connections, so this grows by about one per apiserver and "
                                   "idle period, not per review")
        self.handshakes_late = Counter("gatekeeper_webhook_tls_handshakes_late_total",
                                       "TLS handshakes given another tlsHandshakeTimeoutSeconds because the delay was "
                                       "the worker's (its loop stalled, or the client's bytes waited unread): the "
                                       "webhook is short of CPU")


_METRICS: Metrics | None = None


def metrics() -> Metrics:
    global _METRICS
    if _METRICS is None:
        _METRICS = Metrics()
    return _METRICS


Authenticate = Callable[[web.Request, WebhookSettings], str]
SETTINGS_KEY = web.AppKey("settings", WebhookSettings)
AUTH_KEY: web.AppKey[Authenticate] = web.AppKey("authenticate")
KEEPER_KEY = web.AppKey("keeper", TemplateKeeper)
READY_KEY = web.AppKey("ready", dict)
MAPPING_KEY = web.AppKey("extended_resource_map", ExtendedResourceMap)
NAMESPACE_MODES_KEY = web.AppKey("namespace_modes", NamespaceModes)


def verified_caller(request: web.Request, settings: WebhookSettings) -> str:
    """The apiserver's certificate name if the caller proved it is the apiserver, else ``""``.

    The TLS layer already checked the chain against ``clientCaFile`` (CERT_OPTIONAL); here only the
    name is matched, so another client of the same CA is not taken for the apiserver.
    """
    srv = settings.server
    transport = request.transport
    if not srv.client_ca_file or transport is None:
        return ""
    cert = transport.get_extra_info("peercert")
    if not cert:
        return ""
    known = _CALLERS.get(id(cert))
    if known is not None and known[0] is cert and known[1] is srv:
        return known[2]
    names = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    names += [v for k, v in cert.get("subjectAltName", ()) if k == "DNS"]
    name = next((n for n in names if n in srv.allowed_client_names), "")
    if len(_CALLERS) >= MAX_CALLERS:
        _CALLERS.clear()
    _CALLERS[id(cert)] = (cert, srv, name)
    return name


MAX_CALLERS = 64
"""Connections whose caller name is kept (every apiserver keeps a few; past this the table starts over)."""
_CALLERS: dict[int, tuple[Any, ServerSettings, str]] = {}
"""Peer certificate (the TLS layer's own dict, the same object for every request of a connection, kept from the
handshake) -> the settings it was matched against and the name: the apiserver's reviews arrive on a few kept
connections, one per apiserver and more under load, so the names are matched once per connection instead of per
review, ~10 Python calls of ~350 (tests/webhook/test_webhook_review_path.py). The entry holds the certificate, so
its id cannot be reused while the entry lives, and ``is`` checks it is the same one."""


BudgetRefusal = Literal["body-budget", "body-budget-caller"]
"""Why :meth:`BodyBudget.take` refused: the ``reason`` label of ``gatekeeper_webhook_refused_requests_total``."""


class BodyBudget:
    """Bytes of review bodies this process is reading or parsing at once (``maxBufferedBodyBytes``).

    Each connection may hold up to ``maxBodyBytes``; without a process-wide bound, ``maxConnections`` slow
    senders hold gigabytes. Over the budget a review gets 503 at once, before its body is read.

    The budget is shared by every caller, so a caller that is not a verified apiserver is also held to
    ``per_caller`` bytes (``maxBufferedBodyCallerShare``, keyed by peer IP: in open mode any pod can call, and
    one pod's slow bodies took the whole budget, refusing the apiserver's reviews).
    """

    def __init__(self, limit: int, per_caller: int | None = None) -> None:
        self.limit = limit
        self.per_caller = limit if per_caller is None else per_caller
        self.used = 0
        self.by_caller: dict[str, int] = {}
        """Bytes held per caller key; a key is dropped when it holds nothing (at most one per open request)."""

    def take(self, n: int, key: str | None = None) -> BudgetRefusal | None:
        """Reserve ``n`` bytes for caller ``key`` (None: a verified apiserver, not held to a share).

        Returns None when they are reserved, else the refusal reason, and nothing is reserved:
        ``body-budget`` (the whole budget is held) or ``body-budget-caller`` (that caller's share is).
        The reason is the metric's label; deciding it here, once, keeps the check and the label from drifting."""
        if self.used + n > self.limit:
            return "body-budget"
        if key is not None and self.by_caller.get(key, 0) + n > self.per_caller:
            return "body-budget-caller"
        self.used += n
        if key is not None:
            self.by_caller[key] = self.by_caller.get(key, 0) + n
        return None

    def give(self, n: int, key: str | None = None) -> None:
        self.used -= n
        if key is not None:
            left = self.by_caller.pop(key) - n
            if left:
                self.by_caller[key] = left


BUDGET_KEY = web.AppKey("body_budget", BodyBudget)


def _closing(resp: web.Response) -> web.Response:
    """The body was not read to its end: close the connection rather than linger reading the rest."""
    resp.force_close()
    return resp


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(doc), status=status, content_type="application/json")


async def _review(request: web.Request, route: str) -> web.Response:
    m = metrics()
    started = time.perf_counter()
    settings = request.app[SETTINGS_KEY]
    caller = request.app[AUTH_KEY](request, settings)
    if settings.server.client_ca_file and not caller:
        m.refused.labels(route, "unauthenticated").inc()
        return web.Response(status=403, text="gatekeeper webhook: only the kube-apiserver may call this "
                                             "(client certificate from webhook.server.clientCaFile with a "
                                             "name in allowedClientNames)\n")
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding != "identity":
        # The apiserver never compresses reviews; inflating one is work (up to maxBodyBytes per request)
        # and a failure mode (corrupt data) nobody legitimate needs.
        m.refused.labels(route, "content-encoding").inc()
        return _closing(web.Response(status=415, text=f"Content-Encoding {encoding!r} is not accepted: send the "
                                                      "AdmissionReview as plain JSON\n"))
    # Reserve the body's size before reading it: bodies held at once (slow senders, a burst) stay within
    # maxBufferedBodyBytes, not maxConnections x maxBodyBytes. Without a Content-Length, assume the largest.
    size = request.content_length
    need = settings.server.max_body_bytes if size is None else min(size, settings.server.max_body_bytes)
    budget = request.app[BUDGET_KEY]
    key = None if caller else (request.remote or "")  # a verified apiserver is not held to a share
    reason = budget.take(need, key)
    if reason is not None:
        m.refused.labels(route, reason).inc()
        held = (f"review bodies being read already hold webhook.server.maxBufferedBodyBytes ({budget.limit} bytes)"
                if reason == "body-budget" else
                f"review bodies being read from {key} already hold its share of the body budget, "
                f"webhook.server.maxBufferedBodyCallerShare ({budget.per_caller} bytes)")
        return _closing(web.Response(status=503, headers={"Retry-After": "1"},
                                     text=f"gatekeeper webhook busy: {held}\n"))
    try:
        return await _read_and_decide(request, route, settings, caller, started)
    finally:
        budget.give(need, key)


async def _read_and_decide(request: web.Request, route: str, settings: WebhookSettings, caller: str,
                           started: float) -> web.Response:
    m = metrics()
    try:
        limit = settings.server.max_body_bytes
        if request.content.is_eof():  # already received whole (the usual small review): nothing to wait for
            body = await read_body(request.content, request.content_length, limit)
        else:
            async with asyncio.timeout(settings.server.body_timeout_seconds):
                body = await read_body(request.content, request.content_length, limit)
    except BodyTooLarge:
        m.refused.labels(route, "too-large").inc()
        return _closing(web.Response(status=413, text=f"AdmissionReview larger than webhook.server.maxBodyBytes "
                                                      f"({settings.server.max_body_bytes} bytes)\n"))
    except TimeoutError:
        m.refused.labels(route, "body-timeout").inc()
        return _closing(web.Response(status=408, text=f"AdmissionReview body not received within "
                                                      f"webhook.server.bodyTimeoutSeconds "
                                                      f"({settings.server.body_timeout_seconds:g} s)\n"))
    except web.RequestPayloadError as exc:  # a malformed chunked body
        m.bad_requests.labels(route).inc()
        return _closing(web.Response(status=400, text=f"bad AdmissionReview body: {exc}\n"))
    size = len(body)
    out = await _decide(request, route, settings, caller, started, body)
    del body
    if size >= TRIM_AFTER_BYTES and _TRIM is not None:
        # The decoded tree went with _decide's frame and the body with this reference: give the heap back.
        _TRIM()
    return out


async def _decide(request: web.Request, route: str, settings: WebhookSettings, caller: str, started: float,
                  body: memoryview) -> web.Response:
    m = metrics()
    try:
        req = parse_review(body)
    except ReviewError as exc:
        m.bad_requests.labels(route).inc()
        return web.Response(status=400, text=f"bad AdmissionReview: {exc}\n")
    try:
        if route == "validate":
            policy, decision = policies.validate(req, settings)
        else:
            mapping = request.app.get(MAPPING_KEY)
            ns_modes = request.app.get(NAMESPACE_MODES_KEY)
            policy, decision = policies.mutate(req, settings, mapping is not None and mapping.mapped,
                                               ns_modes.modes if ns_modes is not None else None)
        if decision.allowed and decision.templates and not req.dry_run:
            keeper = request.app.get(KEEPER_KEY)
            if not caller:
                m.refused.labels(route, "unauthenticated-create").inc()
                decision = Decision(allowed=False, outcome="error", code=403, reason="Forbidden",
                                    message="gatekeeper creates ResourceClaimTemplates only for a verified "
                                            "kube-apiserver caller; set webhook.server.clientCaFile and "
                                            "allowedClientNames (docs: Authenticated webhook), or use a "
                                            "GPU mode that creates nothing (time-slicing, mps, mig)")
            elif keeper is None:
                decision = Decision(allowed=False, outcome="error", code=503, reason="ServiceUnavailable",
                                    message="gatekeeper has no Kubernetes client to create "
                                            "ResourceClaimTemplates (set webhook.kubeconfig)")
            else:
                try:
                    await keeper.ensure(decision.templates)
                except TemplateError as exc:
                    decision = Decision(allowed=False, outcome="error", code=503,
                                        reason="ServiceUnavailable", message=str(exc))
    except Exception:  # a bug of ours must not become a traceback in someone's kubectl output
        log.exception("policy failed on review %s", req.uid)
        policy = "error"
        decision = Decision(allowed=False, outcome="error", code=500, reason="InternalError",
                            message="gatekeeper webhook internal error; see the webhook's log")
    audit = decision.audit
    if decision.outcome == "mutated":
        child(m.rewrites, audit.get("gpu-mode", "")).inc()
    if "gpu-denied-reason" in audit:
        child(m.gpu_denials, audit["gpu-denied-reason"]).inc()
    if "gpu-mode-source" in audit:
        child(m.mode_decisions, audit.get("gpu-mode", "denied"), audit["gpu-mode-source"]).inc()
    child(m.reviews, policy, req.operation, decision.outcome).inc()
    out = _call_failed(decision) if decision.outcome == "error" and decision.code >= 500 else \
        _json(response(req.uid, decision))
    child(m.duration, route).observe(time.perf_counter() - started)
    return out


def _call_failed(decision: Decision) -> web.Response:
    """The webhook could not do its job (a bug of ours, a template it cannot create): an HTTP error with a
    Kubernetes ``Status`` body, not a denial.

    ``allowed: false`` is obeyed whatever the webhook configuration's ``failurePolicy`` says; a failed call is
    settled by it: ``Fail`` refuses the write (kubectl shows this message after "failed calling webhook"),
    ``Ignore`` admits it unchanged. Answered as a denial, a broken template RBAC kept refusing GPU pods even
    after the documented way out of the write path, ``failurePolicy=Ignore``. No ``Retry-After``: client-go would
    retry the call inside the apiserver's one ``timeoutSeconds``.
    """
    return web.Response(body=failure_json(decision.code, decision.reason, decision.message), status=decision.code,
                        content_type="application/json")


async def validate(request: web.Request) -> web.Response:
    return await _review(request, "validate")


async def mutate(request: web.Request) -> web.Response:
    return await _review(request, "mutate")


def _not_ready(app: web.Application) -> str | None:
    state = app[READY_KEY]
    return None if state.get("ready") else f"not ready: {state.get('reason', 'starting')}\n"


_UNBLOCKED_BYTES = 16 * 1024
"""A response this small, written into an empty transport buffer, stays under its high-water mark (64 KiB)."""


def _response_bytes(resp: web.StreamResponse) -> int:
    """About the bytes ``resp`` puts on the wire: its body (a streamed one is not known: 0) and its head."""
    body = resp.body if isinstance(resp, web.Response) else None
    size = len(body) if isinstance(body, (bytes, bytearray)) else 0
    return size + 64 + sum(len(k) + len(v) + 4 for k, v in resp.headers.items())


def _write_bounded(settings: WebhookSettings) -> Any:
    """Middleware: every response, errors included, is written within ``writeTimeoutSeconds`` or the connection
    is aborted. aiohttp waits for a socket to drain with no limit, and a handler waiting there is not idle, so a
    client that pipelines requests and never reads held its connection (and kernel buffers) forever."""
    timeout = settings.server.write_timeout_seconds

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            resp = await handler(request)
        except web.HTTPException as exc:  # 404/405 and the like are responses too
            resp = exc
        if resp.prepared:
            return resp
        will_write = getattr(request.protocol, "will_write", None)  # listen.MeteredRequestHandler
        if will_write is not None:
            will_write(_response_bytes(resp))
        transport = request.transport
        if (transport is not None and not transport.get_write_buffer_size() and isinstance(resp, web.Response)
                and isinstance(resp.body, bytes) and len(resp.body) <= _UNBLOCKED_BYTES):
            # Nothing queued and a small answer: aiohttp's own write cannot wait for a drain, so no timer
            # (a timeout scope costs about 3-6 us, a few % of a review). A client that stops reading fills
            # the kernel's buffer, then ours, and from then on every response gets the timeout.
            return resp
        try:
            async with asyncio.timeout(timeout):
                await resp.prepare(request)
                await resp.write_eof()
        except TimeoutError:
            route = request.path.strip("/") if request.path in ("/validate", "/mutate") else "other"
            metrics().refused.labels(route, "write-timeout").inc()
            if request.transport is not None:
                request.transport.abort()  # aiohttp's own write of resp then meets a closed connection: no log
        except ConnectionResetError:
            # The connection went away while the response waited to be written: the client left, or the listener
            # closed it (maxBufferedRequestBytes). Nothing to answer; aiohttp would log an ERROR with a traceback,
            # a log line any client could have for the price of a connection.
            pass
        return resp

    return middleware


def build_app(settings: WebhookSettings, keeper: TemplateKeeper | None = None,
              *, ready: bool = True, authenticate: Authenticate | None = None) -> web.Application:
    """``ready=False``: /readyz answers 503 until the server sets ``app[READY_KEY]["ready"]``.

    ``authenticate`` names the verified caller (``""``: none); in-process tests without TLS pass one.
    """
    app = web.Application(client_max_size=settings.server.max_body_bytes, middlewares=[_write_bounded(settings)])
    app[SETTINGS_KEY] = settings
    app[AUTH_KEY] = authenticate or verified_caller
    if keeper is not None:
        app[KEEPER_KEY] = keeper
    app[READY_KEY] = {"ready": ready, "reason": "starting"}
    app[BUDGET_KEY] = BodyBudget(settings.server.max_buffered_body_bytes,
                                 settings.server.max_buffered_body_bytes_per_caller)
    metrics()
    app.router.add_post("/validate", validate)
    app.router.add_post("/mutate", mutate)
    add_ops_routes(app, lambda: _not_ready(app))
    return app
