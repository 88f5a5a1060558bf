"""Talking to one apiserver: an aiohttp pool, streaming both ways, and raw upgrades.

HTTP/1.1 upstream on purpose (design §2): a request gets its own pooled
connection, so one client cannot make the apiserver send a GOAWAY (its
mitigation for unauthenticated floods) that would kill other clients' streams
on a shared HTTP/2 connection.

* One ``aiohttp.ClientSession`` per backend, with no total timeout (watches
  are endless), ``auto_decompress=False`` (gzip from the apiserver passes
  through with its Content-Length intact) and a pool of
  ``maxConnectionsPerBackend``. Two TLS contexts share that pool: one presents
  the front-proxy client certificate (requests whose identity the proxy
  asserts with ``X-Remote-*``), one presents none (token and anonymous
  requests, see :func:`gatekeeper.proxy.pipeline.auth.wants_front_proxy_cert`).
* Hop-by-hop headers (RFC 9110 7.6.1 plus every header named in
  ``Connection``) are removed both ways.
* Bodies stream with ``iter_any()``; the response body is pulled by the
  client side, so a slow client slows the backend read instead of growing a
  buffer. A LIST of any size and an endless watch never sit in memory whole.
* WebSocket/SPDY upgrades bypass aiohttp: a raw TLS connection, our own
  request head, the backend's 101 head, then the h1 adapter splices bytes.

Errors are sorted by whether bytes may have reached the backend, because
only :class:`ConnectFailed` allows the caller to try another backend.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from gatekeeper.proxy import metrics, target
from gatekeeper.proxy.messages import Headers, ProxyRequest, ProxyResponse, Upgraded
from gatekeeper.proxy.settings import UpstreamSettings
from gatekeeper.proxy.upstream import exchange, lean, mux_pool, mux_wire
from gatekeeper.proxy.upstream.errors import (
    BackendFailed,
    ClientBodyFailed,
    ConnectFailed,
    NoFrontProxyCert,
    PoolTimeout,
    UpstreamTimeout,
    connect_cause,
)
from gatekeeper.tls import ReloadingTLS

__all__ = [
    "BackendClient", "BackendFailed", "ClientBodyFailed", "ConnectFailed", "NoFrontProxyCert", "PoolTimeout",
    "UpstreamTimeout", "is_upgrade", "make_ssl_context", "parse_head", "strip_hop_by_hop",
]

log = logging.getLogger("gatekeeper.proxy.upstream.client")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "transfer-encoding", "upgrade", "http2-settings",
})
# The adapter handles 100-continue with the client; Host is the backend's.
REQUEST_DROP = frozenset({"host", "expect"})
MAX_HEAD_BYTES = 256 * 1024
_REQUEST_REMOVED = HOP_BY_HOP | REQUEST_DROP
_MUX_METHODS = frozenset({"GET", "HEAD"})
H2_ALPN = ("h2", "http/1.1")


def connection_tokens(headers: Headers) -> set[str]:
    values = [v for k, v in headers if k.lower() == "connection"]
    return {t.strip().lower() for v in values for t in v.split(",") if t.strip()}


_KEEP_UPGRADE = frozenset({"upgrade", "connection"})


def removed_headers(headers: Headers, *, keep_upgrade: bool = False,
                    drop: frozenset[str] = frozenset()) -> frozenset[str]:
    """Lower-case names to drop: hop-by-hop ones, those the Connection header names (RFC 9110 7.6.1), ``drop``.

    The Connection header's tokens are only parsed when there is one.
    """
    removed = HOP_BY_HOP | drop
    for k, _ in headers:
        if k.lower() == "connection":
            removed = removed | connection_tokens(headers)
            break
    if keep_upgrade:
        removed = removed - _KEEP_UPGRADE
    return removed


def strip_hop_by_hop(headers: Headers, *, keep_upgrade: bool = False, drop: frozenset[str] = frozenset()) -> Headers:
    """``headers`` without :func:`removed_headers` and pseudo-headers; one pass, one ``lower()`` per name."""
    removed = removed_headers(headers, keep_upgrade=keep_upgrade, drop=drop)
    return [(k, v) for k, v in headers if k.lower() not in removed and k[:1] != ":"]


def is_upgrade(request: ProxyRequest) -> bool:
    """An HTTP/1.1 protocol switch (WebSocket for kubectl >= 1.30 exec/attach/port-forward, SPDY/3.1)."""
    return (
        request.protocol == "http/1.1"
        and request.header("upgrade") is not None
        and "upgrade" in connection_tokens(request.headers)
    )


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


class _ResponseBody:
    """Async iterator over a backend response that releases everything exactly once.

    ``aclose`` works even if iteration never started (an async generator's
    ``finally`` would not run then), so a response dropped by the adapter or
    by flow control still frees its pooled connection and its lease.
    """

    def __init__(
        self, resp: aiohttp.ClientResponse, *, swallow_errors: bool,
        on_done: Callable[[BaseException | None], None], chunk_hint: int = 1 << 16,
    ) -> None:
        self.resp = resp
        self.swallow = swallow_errors
        self.on_done = on_done
        self.done = False
        self.chunk_hint = chunk_hint
        self.exhausted = False
        """The chunk last returned was the final one (the next ``__anext__`` stops)."""

    def __aiter__(self) -> _ResponseBody:
        return self

    async def __anext__(self) -> bytes:
        if self.done:
            raise StopAsyncIteration
        try:
            chunk = await self.resp.content.readany()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            # The backend died mid-stream. For a watch, a clean end of the body is what
            # client-go treats as "watch closed" and re-watches from its last
            # resourceVersion; for anything else a clean end would pass a truncated body
            # off as complete, so the error propagates and the adapter resets the stream.
            self._finish(exc)
            if self.swallow:
                raise StopAsyncIteration from None
            raise BackendFailed(f"backend closed the response mid-stream: {exc}") from exc
        except BaseException as exc:
            self._finish(exc)
            raise
        if not chunk:
            self._finish(None)
            raise StopAsyncIteration
        if self.resp.content.at_eof():
            # That was all of it: give the connection back now, and let the adapter end the
            # stream with this chunk (one HTTP/2 DATA frame with END_STREAM instead of two).
            self.exhausted = True
            self._finish(None)
        return chunk

    def _finish(self, error: BaseException | None) -> None:
        if self.done:
            return
        self.done = True
        if error is None:
            self.resp.release()
        else:
            self.resp.close()
        self.on_done(error)

    async def aclose(self) -> None:
        if not self.done:
            # Stopped early (client went away): the connection is mid-body, close it.
            self.done = True
            self.resp.close()
            self.on_done(asyncio.CancelledError("response body closed before its end"))


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
        self.tls_identity: ReloadingTLS | None = None
        if settings.client_cert_file or settings.client_key_file:
            self.tls_identity = ReloadingTLS(
                lambda: make_ssl_context(settings, client_cert=True),
                [*files, settings.client_cert_file, settings.client_key_file],
                what="upstream CA and front-proxy client certificate", check_interval=interval,
            )
        self.tls_plain = ReloadingTLS(lambda: make_ssl_context(settings, client_cert=False), files,
                                      what="upstream CA", check_interval=interval)
        # upstream.http2: contexts offering h2 first and http/1.1 too (a backend that picks http/1.1, or no
        # protocol, is used over the HTTP/1.1 pool from then on; offering h2 alone would make a strict
        # HTTP/1.1 server fail the handshake, a connect failure that ejects a healthy backend).
        self.mux: mux_pool.MuxPool | None = None
        self.tls_h2_identity: ReloadingTLS | None = None
        self.tls_h2_plain: ReloadingTLS | None = None
        if settings.http2 and settings.client == "lean":
            if self.tls_identity is not None:
                self.tls_h2_identity = ReloadingTLS(
                    lambda: make_ssl_context(settings, client_cert=True, alpn=H2_ALPN),
                    [*files, settings.client_cert_file, settings.client_key_file],
                    what="upstream CA and front-proxy client certificate (HTTP/2)", check_interval=interval,
                )
            self.tls_h2_plain = ReloadingTLS(lambda: make_ssl_context(settings, client_cert=False, alpn=H2_ALPN),
                                             files, what="upstream CA (HTTP/2)", check_interval=interval)
            goaways = metrics.UPSTREAM_GOAWAYS.labels(name)
            self._h2_streams = metrics.UPSTREAM_H2_STREAMS.labels(name)
            self._h2_authority = mux_wire.authority_field(split.netloc)
            self.mux = mux_pool.MuxPool(self.host, self.port, limit=settings.max_connections_per_backend,
                                        max_streams=settings.http2_max_streams,
                                        connect_timeout=settings.connect_timeout_seconds,
                                        retry_seconds=settings.http2_retry_seconds, on_goaway=goaways.inc,
                                        on_fallback=metrics.UPSTREAM_H2_FALLBACKS.labels(name).inc)
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
        return self.tls_identity.get() if self.tls_identity is not None else None

    @property
    def ssl_plain(self) -> ssl.SSLContext:
        return self.tls_plain.get()

    def _session(self, long_running: bool) -> aiohttp.ClientSession:
        session = self._sessions.get(long_running)
        if session is None:
            limit = (self.settings.max_long_running_connections_per_backend if long_running
                     else self.settings.max_connections_per_backend)
            connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, ssl=self.ssl_plain,
                                             enable_cleanup_closed=True)
            session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout_seconds),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            # aiohttp re-sends an idempotent request (PUT and DELETE included) once when a reused
            # connection turns out closed. The proxy cannot know the backend did not act on the
            # first copy, so nothing is ever re-sent behind the client's back.
            session._retry_connection = False
            self._sessions[long_running] = session
        return session

    @property
    def session(self) -> aiohttp.ClientSession:
        """The short-request pool (health probes use it too)."""
        return self._session(False)

    def _ssl(self, identity: bool) -> ssl.SSLContext:
        if not identity:
            return self.ssl_plain
        ctx = self.ssl_identity
        if ctx is None:
            raise NoFrontProxyCert(
                "the proxy has no front-proxy client certificate (upstream.clientCertFile/clientKeyFile), "
                "so it cannot assert a client-certificate identity to the apiserver; use a token or "
                "configure the certificate"
            )
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
                pass  # nothing was sent; the connection that found out, if any, waits in the HTTP/1.1 pool
        if self.lean:  # the default: inline, so a request pays for one coroutine here, not two
            ssl_ctx = self._ssl(identity)
            head, declared = exchange.encode_request_head(
                request.method, request.target, self.authority, headers, _REQUEST_REMOVED,
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
        ssl_ctx = self._ssl(identity)
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
        response_body = _ResponseBody(resp, swallow_errors=swallow_body_errors, on_done=release_slot)
        return ProxyResponse(status=resp.status, headers=resp_headers, body=response_body)

    def _live_contexts(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext]:
        return self.ssl_identity, self.ssl_plain

    def _live_h2_contexts(self) -> tuple[ssl.SSLContext | None, ...]:
        return tuple(t.get() if t is not None else None for t in (self.tls_h2_identity, self.tls_h2_plain))

    async def _send_mux(self, mux: mux_pool.MuxPool, request: ProxyRequest, headers: Headers, identity: bool,
                        on_done: Callable[[BaseException | None], None]) -> ProxyResponse:
        if identity:
            self._ssl(True)  # NoFrontProxyCert, as on the HTTP/1.1 path
            assert self.tls_h2_identity is not None
            ctx = self.tls_h2_identity.get()
        else:
            assert self.tls_h2_plain is not None
            ctx = self.tls_h2_plain.get()
        block = mux_wire.request_block(request.method, request.target, self._h2_authority, headers,
                                       _REQUEST_REMOVED)
        try:
            status, raw, body = await mux_pool.exchange(
                mux, self.name, ctx, self._live_h2_contexts, block, head_only=request.method == "HEAD",
                header_timeout=self.settings.response_header_timeout_seconds,
                acquire_timeout=self.settings.pool_acquire_timeout_seconds, on_done=on_done)
        except mux_pool.NotH2 as exc:  # not counted as a stream: the request goes over HTTP/1.1
            transport = exc.claim()
            if transport is not None:  # the HTTP/1.1 context of the same kind (certificate or none)
                self._pools[False].adopt(transport, self._ssl(identity), self._live_contexts)
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

    async def upgrade(
        self, request: ProxyRequest, headers: Headers, *, identity: bool,
        on_close: Callable[[], Awaitable[None]],
    ) -> ProxyResponse:
        """Open a raw TLS connection, send the upgrade request, hand the 101 connection to the adapter.

        The head is built and checked as on the pooled path (``exchange.encode_request_head``), and a
        request body is framed as there (:class:`exchange.BodyFramer`): chunked when the client sent it
        chunked. Before, the decoded body went out raw with ``Transfer-Encoding`` dropped, so a backend
        that refused the upgrade read it as a second request. The body is written with backpressure:
        a backend that does not read it stops the client's upload instead of growing our buffer.
        """
        ssl_ctx = self._ssl(identity)
        head, declared = exchange.encode_request_head(
            request.method, request.target, self.authority, strip_hop_by_hop(headers, keep_upgrade=True),
            REQUEST_DROP, has_body=request.body is not None)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=ssl_ctx, server_hostname=self.host,
                                        limit=MAX_HEAD_BYTES),
                self.settings.connect_timeout_seconds,
            )
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            raise ConnectFailed(connect_cause(exc)) from exc
        body = exchange.ClientBody(request.body) if request.body is not None else None
        try:
            writer.write(head)
            if body is not None:
                framer = exchange.BodyFramer(declared)
                try:
                    async for chunk in body:
                        if chunk:
                            writer.write(framer.frame(chunk))
                            await writer.drain()
                    writer.write(framer.end())
                except ValueError as exc:
                    body.error = body.error or exc  # the client's body broke its own framing
                    raise
            await writer.drain()
            status, resp_headers = parse_head(await reader.readuntil(b"\r\n\r\n"))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            writer.close()
            if body is not None and body.error is not None:
                raise ClientBodyFailed(f"upgrade request body failed: {body.error}") from body.error
            raise BackendFailed(f"{self.name}: upgrade failed: {type(exc).__name__}") from exc
        except BaseException:
            writer.close()
            raise
        if status == 101:
            return ProxyResponse(status=101, headers=strip_hop_by_hop(resp_headers, keep_upgrade=True),
                                 upgraded=Upgraded(reader, writer, on_close))
        # Refused upgrade (e.g. 403, 400): an ordinary response on a connection we then close.
        return ProxyResponse(status=status, headers=strip_hop_by_hop(resp_headers),
                             body=_RefusedUpgradeBody(reader, writer, resp_headers, on_close))


_NAMES: dict[bytes, str] = {}
"""Response header names as received -> lower-case text: an apiserver sends the same dozen names all day."""
MAX_NAMES = 512
"""Names past this many are decoded every time (a backend cannot grow the table without bound)."""


def response_headers(raw: Sequence[tuple[bytes, bytes]]) -> Headers:
    """Raw response headers as lower-case text pairs, hop-by-hop ones and those ``Connection`` names removed.

    One pass; the rare response with a ``Connection`` header takes a second one.
    """
    out: Headers = []
    named: list[str] | None = None
    names = _NAMES
    for k, v in raw:
        name = names.get(k)
        if name is None:
            name = k.decode("latin-1").lower()
            if len(names) < MAX_NAMES:
                names[k] = name
        if name in HOP_BY_HOP:
            if name == "connection":
                named = [*(named or []), v.decode("latin-1")]
            continue
        out.append((name, v.decode("utf-8", "surrogateescape")))
    if named:
        tokens = {t.strip().lower() for v in named for t in v.split(",")}
        out = [(k, v) for k, v in out if k not in tokens]
    return out


def parse_head(data: bytes) -> tuple[int, Headers]:
    """Status and headers of an HTTP/1.1 response head; ValueError if it is not one."""
    text = data.decode("latin-1")
    status_line, *lines = text.split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP/1.1 response: {status_line[:80]!r}")
    headers: Headers = []
    for line in lines:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"malformed response header line {line[:80]!r}")
        headers.append((name.strip().lower(), value.strip()))
    return int(parts[1]), headers


class _RefusedUpgradeBody:
    """Body of a refused upgrade; its connection is closed once, whether the body was read or not.

    An async generator's ``finally`` does not run when ``aclose`` comes before the first
    ``__anext__`` (a HEAD, a 204/304, a client gone before the body): ``on_close`` (the balancer
    lease) was never called, and the socket was closed only by StreamWriter's finalizer, with a
    ResourceWarning. ``aclose`` here does both in every case.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, headers: Headers,
                 on_close: Callable[[], Awaitable[None]]) -> None:
        self._chunks = _raw_body(reader, headers)
        self._writer = writer
        self._on_close: Callable[[], Awaitable[None]] | None = on_close

    def __aiter__(self) -> _RefusedUpgradeBody:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._chunks.__anext__()
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is None:
            return
        await self._chunks.aclose()
        self._writer.close()
        await on_close()


async def _raw_body(reader: asyncio.StreamReader, headers: Headers) -> AsyncGenerator[bytes, None]:
    """Content-Length, chunked, or until close; a broken body just ends (the caller closes the socket)."""
    values = dict(headers)
    try:
        if "chunked" in values.get("transfer-encoding", "").lower():
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    break
                yield await reader.readexactly(size)
                await reader.readexactly(2)
        elif "content-length" in values:
            left = int(values["content-length"])
            while left > 0:
                chunk = await reader.read(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)
                yield chunk
        else:
            while chunk := await reader.read(1 << 16):
                yield chunk
    except (OSError, asyncio.IncompleteReadError, ValueError):
        pass
