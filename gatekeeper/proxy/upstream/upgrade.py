"""Protocol upgrades (WebSocket, SPDY/3.1: exec, attach, port-forward) to one apiserver, past every pool.

An upgraded connection belongs to its client until one side closes it, so it never comes from or goes back to a pool. A
refused upgrade is an ordinary response on a connection then closed."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncGenerator, Awaitable, Callable

from gatekeeper.proxy.messages import Headers, ProxyRequest, ProxyResponse, Upgraded
from gatekeeper.proxy.upstream import exchange
from gatekeeper.proxy.upstream.errors import BackendFailed, ClientBodyFailed, ConnectFailed, connect_cause
from gatekeeper.proxy.upstream.hop_by_hop import REQUEST_REMOVED, strip_hop_by_hop
from gatekeeper.proxy.upstream.lean import BodyFramer

MAX_HEAD_BYTES = 256 * 1024
UPGRADE_REMOVED = REQUEST_REMOVED - {"connection", "upgrade"}
"""What never leaves on an upgrade request: it keeps ``Connection: upgrade`` (all the front stage left of it)."""


async def open_upgrade(request: ProxyRequest, head: bytes, declared: int | None, *, name: str, host: str, port: int,
                       ssl_ctx: ssl.SSLContext, connect_timeout: float,
                       on_done: Callable[[BaseException | None], None]) -> ProxyResponse:
    """Open a raw TLS connection, send the upgrade request, hand the 101 connection to the adapter.

    ``head`` is framed as on the pooled path (:data:`UPGRADE_REMOVED`), and so is the body: an unframed body was read
    by a refusing backend as a second request. The body is written with backpressure."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ssl_ctx, server_hostname=host, limit=MAX_HEAD_BYTES),
            connect_timeout,
        )
    except (TimeoutError, OSError, ssl.SSLError) as exc:
        raise ConnectFailed(connect_cause(exc)) from exc
    body = exchange.ClientBody(request.body) if request.body is not None else None
    try:
        writer.write(head)
        if body is not None:
            framer = BodyFramer(declared)
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
        raise BackendFailed(f"{name}: upgrade failed: {type(exc).__name__}") from exc
    except BaseException:
        writer.close()
        raise

    async def on_close() -> None:
        on_done(None)

    if status == 101:
        return ProxyResponse(status=101, headers=strip_hop_by_hop(resp_headers, keep_upgrade=True),
                             upgraded=Upgraded(reader, writer, on_close))
    # Refused upgrade (e.g. 403, 400): an ordinary response on a connection we then close.
    return ProxyResponse(status=status, headers=strip_hop_by_hop(resp_headers),
                         body=_RefusedUpgradeBody(reader, writer, resp_headers, on_close))


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
    """Body of a refused upgrade; its connection is closed once, whether the body was read or not. An async generator's
    ``finally`` does not run if ``aclose`` precedes the first ``__anext__``, leaking the lease and the socket."""

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
