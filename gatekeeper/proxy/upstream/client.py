"""Talking to one apiserver: which upstream path a request takes, and the pools and TLS contexts behind them.

Only callers the apiserver will authenticate share an HTTP/2 connection: kube-apiserver answers an unauthenticated
HTTP/2 request with GOAWAY, which would kill other clients' streams. The paths are described in docs/proxy/index.md
(Upstream connections). Errors are sorted by whether bytes may have reached the backend: only :class:`ConnectFailed`
allows trying another backend."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from gatekeeper.proxy import metrics
from gatekeeper.proxy.messages import Headers, ProxyRequest, ProxyResponse, one_chunk
from gatekeeper.proxy.tally import CounterTally
from gatekeeper.proxy.upstream import exchange, lean, mux_pool, mux_wire
from gatekeeper.proxy.upstream.errors import (
    BackendFailed,
    ClientBodyFailed,
    ConnectFailed,
    NoFrontProxyCert,
    PoolTimeout,
    RequestResetByBackend,
    UpstreamTimeout,
)
from gatekeeper.proxy.upstream.hop_by_hop import REQUEST_REMOVED, response_headers
from gatekeeper.proxy.upstream.settings import UpstreamSettings
from gatekeeper.proxy.upstream.upgrade import UPGRADE_REMOVED, open_upgrade
from gatekeeper.serving.tls import ReloadingTLS

__all__ = [
    "BackendClient", "BackendFailed", "ClientBodyFailed", "ConnectFailed", "NoFrontProxyCert", "PoolTimeout",
    "RequestResetByBackend", "UpstreamTimeout", "make_ssl_context",
]

log = logging.getLogger("gatekeeper.proxy.upstream.client")

_MUX_METHODS = frozenset({"GET", "HEAD"})
H2_ALPN = ("h2", "http/1.1")
OWN_CALLS = 8
"""Connections of the pool that carries the proxy's own calls (:meth:`BackendClient.call`), per backend."""
PROBE_MAX_BYTES = 64 * 1024
"""A /readyz answer is a few hundred bytes; a probe reads no more than this of one."""
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

    Together, so a connection the HTTP/2 pool found to be HTTP/1.1 and handed to the HTTP/1.1 pool is never kept under a
    context of newer files than it was made with (it would never be retired as stale)."""

    http1: ssl.SSLContext
    h2: ssl.SSLContext
    """Offers ``h2`` and ``http/1.1`` in ALPN (:data:`H2_ALPN`)."""


def make_contexts(settings: UpstreamSettings, *, client_cert: bool) -> Contexts:
    return Contexts(make_ssl_context(settings, client_cert=client_cert),
                    make_ssl_context(settings, client_cert=client_cert, alpn=H2_ALPN))


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
        self.settings = settings
        interval = settings.cert_check_interval_seconds
        files = [settings.ca_file]
        # Each kind also gets a context offering h2 and http/1.1: offering h2 alone would fail the handshake of
        # a strict HTTP/1.1 server, a connect failure that ejects a healthy backend.
        self.tls_identity: ReloadingTLS[Contexts] | None = None
        if settings.client_cert_file or settings.client_key_file:
            self.tls_identity = ReloadingTLS(
                lambda: make_contexts(settings, client_cert=True),
                [*files, settings.client_cert_file, settings.client_key_file],
                what="upstream CA and front-proxy client certificate", check_interval=interval,
            )
        self.tls_plain = ReloadingTLS(lambda: make_contexts(settings, client_cert=False), files,
                                      what="upstream CA", check_interval=interval)
        self._h2_streams = CounterTally(metrics.UPSTREAM_H2_STREAMS.labels(name))  # per request: batched (tally.py)
        self._h2_authority = mux_wire.authority_field(split.netloc)
        self.mux = mux_pool.MuxPool(self.host, self.port, limit=settings.max_connections_per_backend,
                                    max_streams=settings.http2_max_streams,
                                    connect_timeout=settings.connect_timeout_seconds,
                                    retry_seconds=settings.http2_retry_seconds,
                                    pause_seconds=settings.http2_unauthorized_pause_seconds,
                                    on_goaway=metrics.UPSTREAM_GOAWAYS.labels(name).inc,
                                    on_fallback=metrics.UPSTREAM_H2_FALLBACKS.labels(name).inc,
                                    on_pause=metrics.UPSTREAM_H2_PAUSES.labels(name).inc,
                                    on_refused=metrics.UPSTREAM_H2_REFUSED.labels(name).inc)
        self.authority = split.netloc
        # Separate pools for short and long-running requests, so open watches never starve GETs (and vice versa).
        self._pools = {
            long_running: lean.Pool(self.host, self.port, connect_timeout=settings.connect_timeout_seconds,
                                    limit=(settings.max_long_running_connections_per_backend if long_running
                                           else settings.max_connections_per_backend))
            for long_running in (False, True)
        }
        self._own = lean.Pool(self.host, self.port, limit=OWN_CALLS, connect_timeout=settings.connect_timeout_seconds)

    @property
    def ssl_identity(self) -> ssl.SSLContext | None:
        return self.tls_identity.get().http1 if self.tls_identity is not None else None

    @property
    def ssl_plain(self) -> ssl.SSLContext:
        return self.tls_plain.get().http1

    async def close(self) -> None:
        self.mux.close()
        for pool in (*self._pools.values(), self._own):
            pool.close()

    def connections(self) -> int:
        """Open upstream connections (busy + idle) in every pool."""
        return sum(max(0, pool.open) for pool in (*self._pools.values(), self._own)) + self.mux.open_connections()

    async def send(
        self, request: ProxyRequest, headers: Headers, *, identity: bool, swallow_body_errors: bool,
        on_done: Callable[[BaseException | None], None], long_running: bool = False, multiplex: bool = False,
        upgrade: bool = False,
    ) -> ProxyResponse:
        """Forward one request; the response body streams from the backend as it is pulled.

        ``multiplex``: the apiserver will authenticate the caller, so a short bodiless GET or HEAD may share an HTTP/2
        connection. ``upgrade``: a protocol switch, on a connection of its own (:mod:`upgrade`). Raises the errors of
        :func:`lean.round_trip`."""
        tls = self.tls_identity if identity else self.tls_plain
        if tls is None:
            raise NoFrontProxyCert(NO_FRONT_PROXY_CERT)
        contexts = tls.get()  # one pair for every path: a handed-over HTTP/2 handshake joins its HTTP/1.1 pool
        mux = self.mux
        if (multiplex and not long_running and request.body is None
                and request.method in _MUX_METHODS and (mux.h2 or mux.wants_h2())):
            try:
                return await self._send_mux(mux, request, headers, contexts, on_done)
            except mux_pool.NotH2:
                # Nothing was sent or processed; a failed HTTP/1.1 connect next is a ConnectFailed as for any
                # request, so a backend really going away is ejected.
                pass
        head, declared = exchange.encode_request_head(
            request.method, request.target, self.authority, headers, UPGRADE_REMOVED if upgrade else REQUEST_REMOVED,
            has_body=request.body is not None)
        if upgrade:
            return await open_upgrade(request, head, declared, name=self.name, host=self.host, port=self.port,
                                      ssl_ctx=contexts.http1, connect_timeout=self.settings.connect_timeout_seconds,
                                      on_done=on_done)
        settings = self.settings
        status, raw, lean_body = await lean.round_trip(
            self._pools[long_running], self.name, contexts.http1, self._live_contexts, head,
            method=request.method,
            body=exchange.ClientBody(request.body) if request.body is not None else None,
            declared=declared, header_timeout=None if long_running else settings.response_header_timeout_seconds,
            acquire_timeout=settings.pool_acquire_timeout_seconds,
            pool_name="long-running" if long_running else "short-request",
            swallow_body_errors=swallow_body_errors, on_done=on_done,
        )
        return ProxyResponse(status=status, headers=response_headers(raw), body=lean_body)

    def _live_contexts(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext]:
        return self.ssl_identity, self.ssl_plain

    def _live_h2_contexts(self) -> tuple[ssl.SSLContext | None, ...]:
        return tuple(t.get().h2 if t is not None else None for t in (self.tls_identity, self.tls_plain))

    async def _send_mux(self, mux: mux_pool.MuxPool, request: ProxyRequest, headers: Headers, contexts: Contexts,
                        on_done: Callable[[BaseException | None], None]) -> ProxyResponse:
        block = mux_wire.request_block(request.method, request.target, self._h2_authority, headers,
                                       REQUEST_REMOVED)
        try:
            status, raw, body = await mux_pool.exchange(
                mux, self.name, contexts.h2, self._live_h2_contexts, block, head_only=request.method == "HEAD",
                header_timeout=self.settings.response_header_timeout_seconds,
                acquire_timeout=self.settings.pool_acquire_timeout_seconds, on_done=on_done)
        except mux_pool.NotH2 as exc:  # not counted as a stream (also Paused, Refused): it goes over HTTP/1.1
            transport = exc.claim()
            if transport is not None:  # made with contexts.h2: kept under the HTTP/1.1 context built with it
                self._pools[False].adopt(transport, contexts.http1, self._live_contexts)
            raise
        except BaseException:
            self._h2_streams.inc()
            raise
        self._h2_streams.inc()
        return ProxyResponse(status=status, headers=response_headers(raw), body=body)

    async def call(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes | None = None, *,
                   deadline: float, max_bytes: int) -> tuple[int, bytes]:
        """The proxy's own request (a probe, a key fetch, a TokenReview): status and body, whole.

        On an HTTP/1.1 pool of its own: a pool clients filled must not fail a probe and eject a busy backend. Raises
        ValueError over ``max_bytes``, TimeoutError past ``deadline``, and the errors of :meth:`send`."""

        head, declared = exchange.encode_request_head(
            method, path, self.authority, [*headers, *([("content-length", str(len(body)))] if body else [])],
            REQUEST_REMOVED, has_body=body is not None)
        async with asyncio.timeout(deadline):
            status, _, response = await lean.round_trip(
                self._own, self.name, self.ssl_identity or self.ssl_plain, self._live_contexts, head,
                method=method, body=exchange.ClientBody(one_chunk(body)) if body is not None else None,
                declared=declared, header_timeout=deadline, acquire_timeout=deadline, pool_name="own-call",
                swallow_body_errors=False, on_done=lambda _error: None)
            chunks, size = [], 0
            try:
                async for chunk in response:
                    size += len(chunk)
                    if size > max_bytes:
                        raise ValueError(f"{self.name}: {path} is larger than {max_bytes} bytes")
                    chunks.append(chunk)
            finally:
                await response.aclose()
            return status, b"".join(chunks)

    async def probe(self, path: str = "/readyz", deadline: float = 3.0) -> bool:
        """Active health: /readyz answers 200; 401/403 count as up (reachable, the probe lacks rights)."""
        headers = [("x-remote-user", "system:gatekeeper-proxy-probe"), ("accept", "text/plain")]
        try:
            status, _ = await self.call("GET", path, headers, deadline=deadline, max_bytes=PROBE_MAX_BYTES)
        except (TimeoutError, OSError, ValueError):  # every upstream error is an OSError (ConnectionError)
            return False
        return status in (200, 401, 403)
