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
  requests, see :func:`gatekeeper.proxy.auth.wants_front_proxy_cert`).
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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict

from gatekeeper.proxy.messages import Headers, ProxyRequest, ProxyResponse, Upgraded
from gatekeeper.proxy.settings import UpstreamSettings

log = logging.getLogger("gatekeeper.proxy.upstream")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "transfer-encoding", "upgrade", "http2-settings",
})
# The adapter handles 100-continue with the client; Host is the backend's.
REQUEST_DROP = frozenset({"host", "expect"})
MAX_HEAD_BYTES = 256 * 1024


class ConnectFailed(ConnectionError):
    """No byte of the request reached the backend (TCP/TLS connect failed or timed out)."""


class NoFrontProxyCert(RuntimeError):
    """A verified client-certificate user arrived but no front-proxy certificate is configured."""


class BackendFailed(ConnectionError):
    """The backend failed after the request may have reached it: never retried."""


def connection_tokens(headers: Headers) -> set[str]:
    values = [v for k, v in headers if k.lower() == "connection"]
    return {t.strip().lower() for v in values for t in v.split(",") if t.strip()}


_KEEP_UPGRADE = frozenset({"upgrade", "connection"})


def strip_hop_by_hop(headers: Headers, *, keep_upgrade: bool = False, drop: frozenset[str] = frozenset()) -> Headers:
    """Drop hop-by-hop headers, those the Connection header names (RFC 9110 7.6.1), and ``drop``.

    Hot path (every request and response): one pass, one ``lower()`` per name,
    and the Connection header's tokens are only parsed when there is one.
    """
    removed = HOP_BY_HOP | drop
    for k, _ in headers:
        if k.lower() == "connection":
            removed = removed | connection_tokens(headers)
            break
    if keep_upgrade:
        removed = removed - _KEEP_UPGRADE
    return [(k, v) for k, v in headers if k.lower() not in removed and k[:1] != ":"]


def is_upgrade(request: ProxyRequest) -> bool:
    """An HTTP/1.1 protocol switch (WebSocket for kubectl >= 1.30 exec/attach/port-forward, SPDY/3.1)."""
    return (
        request.protocol == "http/1.1"
        and request.header("upgrade") is not None
        and "upgrade" in connection_tokens(request.headers)
    )


def make_ssl_context(settings: UpstreamSettings, *, client_cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=settings.ca_file or None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
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
        self.settings = settings
        self.ssl_identity: ssl.SSLContext | None = None
        if settings.client_cert_file or settings.client_key_file:
            self.ssl_identity = make_ssl_context(settings, client_cert=True)
        self.ssl_plain = make_ssl_context(settings, client_cert=False)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self.settings.max_connections_per_backend, limit_per_host=0, ssl=self.ssl_plain,
                enable_cleanup_closed=True,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout_seconds),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    def _ssl(self, identity: bool) -> ssl.SSLContext:
        if not identity:
            return self.ssl_plain
        if self.ssl_identity is None:
            raise NoFrontProxyCert(
                "the proxy has no front-proxy client certificate (upstream.clientCertFile/clientKeyFile), "
                "so it cannot assert a client-certificate identity to the apiserver; use a token or "
                "configure the certificate"
            )
        return self.ssl_identity

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def connections(self) -> int:
        """Open upstream connections (busy + idle); reads aiohttp internals, 0 if they change."""
        if self._session is None:
            return 0
        conn: Any = self._session.connector
        try:
            return len(conn._acquired) + sum(len(v) for v in conn._conns.values())
        except (AttributeError, TypeError):
            return 0

    async def send(
        self, request: ProxyRequest, headers: Headers, *, identity: bool, swallow_body_errors: bool,
        on_done: Callable[[BaseException | None], None],
    ) -> ProxyResponse:
        """Forward one request; the response body streams from the backend as it is pulled.

        Raises :class:`ConnectFailed` when nothing was sent, :class:`BackendFailed`
        when the backend failed after it may have seen the request.
        """
        out = CIMultiDict(strip_hop_by_hop(headers, drop=REQUEST_DROP))
        ssl_ctx = self._ssl(identity)
        try:
            resp = await self.session.request(
                request.method, self.url + request.target, headers=out,
                data=request.body, allow_redirects=False, ssl=ssl_ctx, compress=None,
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise ConnectFailed(f"{self.name}: {exc}") from exc
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise BackendFailed(f"{self.name}: {type(exc).__name__}: {exc}") from exc
        resp_headers = response_headers(resp.raw_headers)
        body = _ResponseBody(resp, swallow_errors=swallow_body_errors, on_done=on_done)
        response = ProxyResponse(status=resp.status, headers=resp_headers, body=body)
        return response

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
        """Open a raw TLS connection, send the upgrade request, hand the 101 connection to the adapter."""
        ssl_ctx = self._ssl(identity)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=ssl_ctx, server_hostname=self.host,
                                        limit=MAX_HEAD_BYTES),
                self.settings.connect_timeout_seconds,
            )
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"{self.name}: {type(exc).__name__}: {exc}") from exc
        try:
            writer.write(encode_head(request.method, request.target, f"{self.host}:{self.port}",
                                     strip_hop_by_hop(headers, keep_upgrade=True)))
            if request.body is not None:
                async for chunk in request.body:
                    writer.write(chunk)
            await writer.drain()
            status, resp_headers = parse_head(await reader.readuntil(b"\r\n\r\n"))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            writer.close()
            raise BackendFailed(f"{self.name}: upgrade failed: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            writer.close()
            raise
        if status == 101:
            return ProxyResponse(status=101, headers=strip_hop_by_hop(resp_headers, keep_upgrade=True),
                                 upgraded=Upgraded(reader, writer, on_close))
        # Refused upgrade (e.g. 403, 400): an ordinary response on a connection we then close.
        return ProxyResponse(status=status, headers=strip_hop_by_hop(resp_headers),
                             body=_raw_body(reader, writer, resp_headers, on_close))


def response_headers(raw: Sequence[tuple[bytes, bytes]]) -> Headers:
    """aiohttp's raw response headers as lower-case text pairs, hop-by-hop ones removed."""
    return strip_hop_by_hop([(k.decode("latin-1").lower(), v.decode("utf-8", "surrogateescape")) for k, v in raw])


def encode_head(method: str, target: str, host: str, headers: Headers) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"host: {host}"]
    lines += [f"{k}: {v}" for k, v in headers if k.lower() not in REQUEST_DROP]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


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


async def _raw_body(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, headers: Headers,
    on_close: Callable[[], Awaitable[None]],
) -> AsyncIterator[bytes]:
    """Body of a refused upgrade: Content-Length, chunked, or until close; then close the socket."""
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
    finally:
        writer.close()
        await on_close()
