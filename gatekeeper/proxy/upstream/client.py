"""Talking to one apiserver: which upstream path a request takes, and the pools and TLS contexts behind them.

HTTP/1.1 upstream by default (design §2): a request gets its own pooled
connection, so one client cannot make the apiserver send a GOAWAY (its
mitigation for unauthenticated floods) that would kill other clients' streams
on a shared HTTP/2 connection.

:class:`BackendClient` owns everything per backend and routes each request:

* ``upstream.http2``: a short bodiless GET or HEAD from a caller the apiserver
  authenticates shares an HTTP/2 connection (:mod:`upstream.mux_pool`).
* ``upstream.client: lean`` (the default): the proxy's own HTTP/1.1 pool
  (:mod:`upstream.exchange`, :mod:`upstream.lean`).
* ``upstream.client: aiohttp``: the older client (:mod:`upstream.aio`), whose
  sessions also carry the health probes whichever client is set.
* Upgrades bypass every pool (:mod:`upstream.upgrade`).

Two kinds of TLS context share each pool: one presents the front-proxy client
certificate (requests whose identity the proxy asserts with ``X-Remote-*``),
one presents none (token and anonymous requests, see
:func:`gatekeeper.proxy.pipeline.auth.wants_front_proxy_cert`). Each kind is
an HTTP/1.1 context and, with ``upstream.http2``, an HTTP/2 one, built by one
reload from one read of the files (:class:`Contexts`). Hop-by-hop
headers are removed both ways (:mod:`upstream.hop_by_hop`). Response bodies
are pulled by the client side, so a slow client slows the backend read
instead of growing a buffer; a LIST of any size and an endless watch never
sit in memory whole.

Errors are sorted by whether bytes may have reached the backend, because
only :class:`ConnectFailed` allows the caller to try another backend.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from gatekeeper.proxy import metrics, target
from gatekeeper.proxy.messages import Headers, ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import UpstreamSettings
from gatekeeper.proxy.upstream import exchange, lean, mux_pool, mux_wire
from gatekeeper.proxy.upstream.aio import ResponseBody, new_session
from gatekeeper.proxy.upstream.errors import (
    BackendFailed,
    ClientBodyFailed,
    ConnectFailed,
    NoFrontProxyCert,
    PoolTimeout,
    RequestResetByBackend,
    UpstreamTimeout,
    connect_cause,
)
from gatekeeper.proxy.upstream.hop_by_hop import REQUEST_DROP, REQUEST_REMOVED, response_headers, strip_hop_by_hop
from gatekeeper.tls import ReloadingTLS

__all__ = [
    "BackendClient", "BackendFailed", "ClientBodyFailed", "ConnectFailed", "NoFrontProxyCert", "PoolTimeout",
    "RequestResetByBackend", "UpstreamTimeout", "make_ssl_context",
]

log = logging.getLogger("gatekeeper.proxy.upstream.client")

_MUX_METHODS = frozenset({"GET", "HEAD"})
H2_ALPN = ("h2", "http/1.1")
NO_FRONT_PROXY_CERT = (
    "the proxy has no front-proxy client certificate (upstream.clientCertFile/clientKeyFile), so it cannot "
    "assert a client-certificate identity to the apiserver; use a token or configure the certificate")


def make_ssl_context(settings: UpstreamSettings, *, client_cert: bool,
                     alpn: Sequence[str] = ("http/1.1",)) -> ssl.SSLContext:
    """Trust exactly ``upstream.caFile``: with no CA nothing verifies, the system roots are never loaded."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if settings.ca_file:
        ctx.load_verify_locations(cafile=settings.ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(list(alpn))
    if client_cert:
        if not settings.client_cert_file or not settings.client_key_file:
            raise ValueError("upstream.clientCertFile and clientKeyFile are required to assert identities")
        ctx.load_cert_chain(settings.client_cert_file, settings.client_key_file)
    return ctx


@dataclass(frozen=True, slots=True)
class Contexts:
    """The contexts of one kind of caller (front-proxy certificate or none), built together by one reload.

    Why together: a connection the HTTP/2 pool opened and found to be HTTP/1.1 goes to the HTTP/1.1 pool
    (``lean.Pool.adopt``), kept under ``http1``. Reloaded separately, each on its own check schedule, the two
    could straddle a rotation: a connection made with the previous files, kept under a context of the new
    ones, never retired as stale. Built together, ``h2`` and ``http1`` always carry the same files.
    """

    http1: ssl.SSLContext
    h2: ssl.SSLContext | None
    """With ``upstream.http2``: offers ``h2`` and ``http/1.1`` in ALPN (:data:`H2_ALPN`)."""


def make_contexts(settings: UpstreamSettings, *, client_cert: bool, http2: bool) -> Contexts:
    return Contexts(make_ssl_context(settings, client_cert=client_cert),
                    make_ssl_context(settings, client_cert=client_cert, alpn=H2_ALPN) if http2 else None)


class BackendClient:
    """The connection pool and request plumbing for one apiserver."""

    def __init__(self, name: str, url: str, settings: UpstreamSettings) -> None:
        self.name = name
        self.url = url.rstrip("/")
        split = urlsplit(self.url)
        if split.scheme != "https" or not split.hostname:
            raise ValueError(f"backend url must be https://host:port, got {url!r}")
        self.host = split.hostname
        self.port = split.port or 443
        self.base_url = URL(self.url)
        self.settings = settings
        interval = settings.cert_check_interval_seconds
        files = [settings.ca_file]
        # upstream.http2: each kind also gets a context offering h2 first and http/1.1 too (a backend that
        # picks http/1.1, or no protocol, is used over the HTTP/1.1 pool from then on; offering h2 alone
        # would make a strict HTTP/1.1 server fail the handshake, a connect failure that ejects a healthy
        # backend).
        http2 = settings.http2 and settings.client == "lean"
        self.tls_identity: ReloadingTLS[Contexts] | None = None
        if settings.client_cert_file or settings.client_key_file:
            self.tls_identity = ReloadingTLS(
                lambda: make_contexts(settings, client_cert=True, http2=http2),
                [*files, settings.client_cert_file, settings.client_key_file],
                what="upstream CA and front-proxy client certificate", check_interval=interval,
            )
        self.tls_plain = ReloadingTLS(lambda: make_contexts(settings, client_cert=False, http2=http2), files,
                                      what="upstream CA", check_interval=interval)
        self.mux: mux_pool.MuxPool | None = None
        if http2:
            goaways = metrics.UPSTREAM_GOAWAYS.labels(name)
            self._h2_streams = metrics.UPSTREAM_H2_STREAMS.labels(name)
            self._h2_authority = mux_wire.authority_field(split.netloc)
            self.mux = mux_pool.MuxPool(self.host, self.port, limit=settings.max_connections_per_backend,
                                        max_streams=settings.http2_max_streams,
                                        connect_timeout=settings.connect_timeout_seconds,
                                        retry_seconds=settings.http2_retry_seconds,
                                        pause_seconds=settings.http2_unauthorized_pause_seconds,
                                        on_goaway=goaways.inc,
                                        on_fallback=metrics.UPSTREAM_H2_FALLBACKS.labels(name).inc,
                                        on_pause=metrics.UPSTREAM_H2_PAUSES.labels(name).inc,
                                        on_refused=metrics.UPSTREAM_H2_REFUSED.labels(name).inc)
        # Short requests and long-running ones (watches, exec, logs -f) have separate pools, so
        # thousands of open watches never starve GETs of a connection (and vice versa).
        self._slots = asyncio.Semaphore(settings.max_connections_per_backend)
        self._long_slots = asyncio.Semaphore(settings.max_long_running_connections_per_backend)
        self._sessions: dict[bool, aiohttp.ClientSession] = {}
        self.lean = settings.client == "lean"
        self.authority = split.netloc
        self._pools = {
            long_running: lean.Pool(self.host, self.port, connect_timeout=settings.connect_timeout_seconds,
                                    limit=(settings.max_long_running_connections_per_backend if long_running
                                           else settings.max_connections_per_backend))
            for long_running in (False, True)
        }

    @property
    def ssl_identity(self) -> ssl.SSLContext | None:
        return self.tls_identity.get().http1 if self.tls_identity is not None else None

    @property
    def ssl_plain(self) -> ssl.SSLContext:
        return self.tls_plain.get().http1

    def _session(self, long_running: bool) -> aiohttp.ClientSession:
        session = self._sessions.get(long_running)
        if session is None:
            limit = (self.settings.max_long_running_connections_per_backend if long_running
                     else self.settings.max_connections_per_backend)
            session = new_session(limit, self.ssl_plain, self.settings.connect_timeout_seconds)
            self._sessions[long_running] = session
        return session

    @property
    def session(self) -> aiohttp.ClientSession:
        """The short-request pool (health probes use it too)."""
        return self._session(False)

    def ssl_for(self, identity: bool) -> ssl.SSLContext:
        if not identity:
            return self.ssl_plain
        ctx = self.ssl_identity
        if ctx is None:
            raise NoFrontProxyCert(NO_FRONT_PROXY_CERT)
        return ctx

    def upstream_url(self, request_target: str) -> URL:
        """The backend URL for an origin-form target, built from parts: never re-parsed, never normalised."""
        path, query = target.split(request_target)
        if not path.startswith("/"):
            raise ValueError(f"not an origin-form target: {request_target[:64]!r}")
        return URL.build(scheme=self.base_url.scheme, authority=self.base_url.raw_authority, path=path,
                         query_string=query, encoded=True)

    async def close(self) -> None:
        if self.mux is not None:
            self.mux.close()
        for pool in self._pools.values():
            pool.close()
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()

    def connections(self) -> int:
        """Open upstream connections (busy + idle) in both pools; reads aiohttp internals, 0 if they change."""
        total = sum(max(0, pool.open) for pool in self._pools.values())
        if self.mux is not None:
            total += self.mux.open_connections()
        for session in self._sessions.values():
            conn: Any = session.connector
            try:
                total += len(conn._acquired) + sum(len(v) for v in conn._conns.values())
            except (AttributeError, TypeError):
                return 0
        return total

    async def _acquire_slot(self, long_running: bool) -> asyncio.Semaphore:
        slots = self._long_slots if long_running else self._slots
        try:
            async with asyncio.timeout(self.settings.pool_acquire_timeout_seconds):
                await slots.acquire()
        except TimeoutError:
            pool = "long-running" if long_running else "short-request"
            raise PoolTimeout(
                f"no free {pool} connection to {self.name} within "
                f"{self.settings.pool_acquire_timeout_seconds:g}s"
            ) from None
        return slots

    async def send(
        self, request: ProxyRequest, headers: Headers, *, identity: bool, swallow_body_errors: bool,
        on_done: Callable[[BaseException | None], None], long_running: bool = False, multiplex: bool = False,
    ) -> ProxyResponse:
        """Forward one request; the response body streams from the backend as it is pulled.

        ``multiplex``: the caller is one the apiserver will authenticate (see :mod:`upstream.mux`), so a short
        bodiless GET or HEAD may share an HTTP/2 connection when ``upstream.http2`` is on.

        Raises :class:`PoolTimeout` or :class:`ConnectFailed` when nothing was sent,
        :class:`UpstreamTimeout` when no response headers came in time,
        :class:`ClientBodyFailed` when the client's body broke off, and
        :class:`BackendFailed` when the backend failed after it may have seen the request.
        """
        mux = self.mux
        if (multiplex and mux is not None and not long_running and request.body is None
                and request.method in _MUX_METHODS and (mux.h2 or mux.wants_h2())):
            try:
                return await self._send_mux(mux, request, headers, identity, on_done)
            except mux_pool.NotH2:
                # Nothing was sent, or nothing processed (a pause after a 401, every stream refused); the
                # connection that found out, if any, waits in the HTTP/1.1 pool. A failed HTTP/1.1 connect
                # next is a ConnectFailed, as for any request: a backend really going away is ejected.
                pass
        if self.lean:  # the default: inline, so a request pays for one coroutine here, not two
            ssl_ctx = self.ssl_for(identity)
            head, declared = exchange.encode_request_head(
                request.method, request.target, self.authority, headers, REQUEST_REMOVED,
                has_body=request.body is not None)
            settings = self.settings
            status, raw, lean_body = await exchange.exchange(
                self._pools[long_running], self.name, ssl_ctx, self._live_contexts, head,
                method=request.method,
                body=exchange.ClientBody(request.body) if request.body is not None else None,
                declared=declared, header_timeout=None if long_running else settings.response_header_timeout_seconds,
                acquire_timeout=settings.pool_acquire_timeout_seconds,
                pool_name="long-running" if long_running else "short-request",
                swallow_body_errors=swallow_body_errors, on_done=on_done,
            )
            return ProxyResponse(status=status, headers=response_headers(raw), body=lean_body)
        out = CIMultiDict(strip_hop_by_hop(headers, drop=REQUEST_DROP))
        ssl_ctx = self.ssl_for(identity)
        url = self.upstream_url(request.target)
        body = exchange.ClientBody(request.body) if request.body is not None else None
        slots = await self._acquire_slot(long_running)
        released = False

        def release_slot(error: BaseException | None) -> None:
            nonlocal released
            if not released:
                released = True
                slots.release()
                on_done(error)

        header_timeout = None if long_running else self.settings.response_header_timeout_seconds
        try:
            async with asyncio.timeout(header_timeout):
                resp = await self._session(long_running).request(
                    request.method, url, headers=out,
                    data=body, allow_redirects=False, ssl=ssl_ctx, compress=None,
                )
        except BaseException as exc:
            released = True
            slots.release()
            if body is not None and body.error is not None:
                raise ClientBodyFailed(f"request body failed: {body.error}") from body.error
            if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
                raise ConnectFailed(connect_cause(exc)) from exc
            if isinstance(exc, TimeoutError):
                raise UpstreamTimeout(
                    f"no response headers from {self.name} within {header_timeout:g}s") from exc
            if isinstance(exc, (aiohttp.ClientError, OSError)):
                raise BackendFailed(f"{self.name}: {type(exc).__name__}") from exc
            raise
        resp_headers = response_headers(resp.raw_headers)
        response_body = ResponseBody(resp, swallow_errors=swallow_body_errors, on_done=release_slot)
        return ProxyResponse(status=resp.status, headers=resp_headers, body=response_body)

    def _live_contexts(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext]:
        return self.ssl_identity, self.ssl_plain

    def _live_h2_contexts(self) -> tuple[ssl.SSLContext | None, ...]:
        return tuple(t.get().h2 if t is not None else None for t in (self.tls_identity, self.tls_plain))

    async def _send_mux(self, mux: mux_pool.MuxPool, request: ProxyRequest, headers: Headers, identity: bool,
                        on_done: Callable[[BaseException | None], None]) -> ProxyResponse:
        tls = self.tls_identity if identity else self.tls_plain
        if tls is None:
            mux.give_back()  # a retry of HTTP/2 granted to this request was never tried
            raise NoFrontProxyCert(NO_FRONT_PROXY_CERT)  # as on the HTTP/1.1 path
        contexts = tls.get()
        ctx = contexts.h2
        assert ctx is not None
        block = mux_wire.request_block(request.method, request.target, self._h2_authority, headers,
                                       REQUEST_REMOVED)
        try:
            status, raw, body = await mux_pool.exchange(
                mux, self.name, ctx, self._live_h2_contexts, block, head_only=request.method == "HEAD",
                header_timeout=self.settings.response_header_timeout_seconds,
                acquire_timeout=self.settings.pool_acquire_timeout_seconds, on_done=on_done)
        except mux_pool.NotH2 as exc:  # not counted as a stream (also Paused, Refused): it goes over HTTP/1.1
            transport = exc.claim()
            if transport is not None:  # made with ctx: kept under the HTTP/1.1 context built with it
                self._pools[False].adopt(transport, contexts.http1, self._live_contexts)
            raise
        except BaseException:
            self._h2_streams.inc()
            raise
        self._h2_streams.inc()
        return ProxyResponse(status=status, headers=response_headers(raw), body=body)

    async def probe(self, path: str = "/readyz", deadline: float = 3.0) -> bool:
        """Active health: /readyz answers 200; 401/403 count as up (reachable, the probe lacks rights)."""
        headers = {"X-Remote-User": "system:gatekeeper-proxy-probe", "Accept": "text/plain"}
        try:
            async with self.session.get(self.url + path, headers=headers,
                                        ssl=self.ssl_identity or self.ssl_plain,
                                        timeout=aiohttp.ClientTimeout(total=deadline)) as resp:
                await resp.read()
                return resp.status in (200, 401, 403)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False


