"""One request/response exchange on the HTTP/1.1 client.

The target goes out byte for byte as the pipeline classified it: checked, never re-parsed or normalised. A body with a
Content-Length is held to it, so no byte of a second request can ride in it."""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import AsyncIterator, Callable, Collection
from typing import TYPE_CHECKING

from gatekeeper.proxy.messages import Headers
from gatekeeper.proxy.upstream.errors import (
    BackendFailed,
    ClientBodyFailed,
    ConnectFailed,
    PoolTimeout,
    UpstreamTimeout,
    connect_cause,
)
from gatekeeper.proxy.upstream.lean import Conn, Pool

if TYPE_CHECKING:
    from gatekeeper.proxy.upstream.mux_stream import MuxStream

TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
TARGET = re.compile(r"/[\x21-\x7e]*")
"""What a method and an origin-form target must match to go upstream, on either protocol (``mux_wire`` too)."""
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class ClientBody:
    """The client's request body as forwarded upstream, remembering whether *the client* failed it."""

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        self.body = body
        self.error: BaseException | None = None

    def __aiter__(self) -> ClientBody:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.body.__anext__()
        except StopAsyncIteration:
            raise
        except BaseException as exc:
            self.error = exc
            raise


def encode_request_head(method: str, target: str, authority: str, headers: Headers, removed: Collection[str],
                        *, has_body: bool) -> tuple[bytes, int | None]:
    """The request head as one ``bytes`` and the body's declared length (None: chunked or no body).

    Drops ``removed`` and the names ``Connection`` lists. A method that is not a token, a target that is not origin-form
    visible ASCII, or CR/LF/NUL in a header raises ValueError: nothing is sent."""
    if not TOKEN.fullmatch(method) or not TARGET.fullmatch(target):
        raise ValueError(f"refusing to send {method[:16]!r} {target[:64]!r} upstream")
    parts = [method, " ", target, " HTTP/1.1\r\nhost: ", authority, "\r\n"]
    lines = 3  # request line, host, the empty line
    length: str | None = None
    for name, value in headers:
        lower = name.lower()
        if lower in removed or lower[:1] == ":":
            if lower == "connection":
                named = {t.strip().lower() for k, v in headers if k.lower() == "connection" for t in v.split(",")}
                if not named <= set(removed):
                    return encode_request_head(method, target, authority, headers, {*removed, *named},
                                               has_body=has_body)
            continue
        if lower == "content-length":
            length = value
        parts += (lower, ": ", value, "\r\n")
        lines += 1
    declared: int | None = None
    if has_body:
        if length is None:
            parts.append("transfer-encoding: chunked\r\n")
            lines += 1
        else:
            if not length.isdigit():
                raise ValueError(f"bad content-length {length[:32]!r}")
            declared = int(length)
    elif length is not None and length.strip("0"):
        # A body announced on a request that has none: the backend would read the next request as that body.
        raise ValueError(f"content-length {length[:32]!r} on a request without a body")
    elif length is None and method in _BODY_METHODS:
        parts.append("content-length: 0\r\n")
        lines += 1
    parts.append("\r\n")
    text = "".join(parts)
    if text.count("\n") != lines or text.count("\r") != lines or "\x00" in text:
        raise ValueError("CR, LF or NUL in a request header")
    return text.encode("utf-8", "surrogateescape"), declared


class BodyFramer:
    """A request body's bytes as they go upstream: raw within the declared Content-Length, else chunked.

    Shared by the pooled exchange and the upgrade splice so no path writes a body unframed (request smuggling with the
    front-proxy certificate's trust). Over- or under-running the length raises ValueError."""

    __slots__ = ("declared", "sent")

    def __init__(self, declared: int | None) -> None:
        self.declared = declared
        self.sent = 0

    def frame(self, chunk: bytes) -> bytes:
        """The wire bytes for one non-empty chunk."""
        self.sent += len(chunk)
        declared = self.declared
        if declared is None:
            return b"%x\r\n%b\r\n" % (len(chunk), chunk)
        if self.sent > declared:
            raise ValueError(f"request body longer than its content-length {declared}")
        return chunk

    def end(self) -> bytes:
        """The bytes that end the body (the last chunk, or nothing); ValueError if it came up short."""
        if self.declared is None:
            return b"0\r\n\r\n"
        if self.sent != self.declared:
            raise ValueError(f"request body of {self.sent} bytes, content-length {self.declared}")
        return b""


async def _send_body(conn: Conn, body: ClientBody, declared: int | None) -> None:
    """Stream the client's body to the backend; any failure aborts the connection (the response side sees it)."""
    transport = conn.transport
    assert transport is not None
    framer = BodyFramer(declared)
    try:
        async for chunk in body:
            if chunk:
                transport.write(framer.frame(chunk))
                await conn.drain()
        if end := framer.end():
            transport.write(end)
        conn.request_sent = True
    except asyncio.CancelledError:
        conn.abort()
        raise
    except BaseException as exc:  # reported through the connection, never lost
        if body.error is None and isinstance(exc, ValueError):
            body.error = exc  # the client's body broke its own framing
        conn._fail(exc)


class StreamedBody:
    """A response body: chunks as they arrive, what carried it released exactly once. ``aclose`` works before iteration
    too, so a dropped response still frees its connection and lease."""

    def __init__(self, source: Conn | MuxStream, name: str, *, swallow_errors: bool,
                 on_done: Callable[[BaseException | None], None]) -> None:
        self.source = source
        self.name = name
        self.swallow = swallow_errors
        self.on_done = on_done
        self.done = False
        self.exhausted = False
        """The chunk last returned was the final one (the next ``__anext__`` stops)."""

    def __aiter__(self) -> StreamedBody:
        return self

    async def __anext__(self) -> bytes:
        if self.done:
            raise StopAsyncIteration
        source = self.source
        try:
            while not source.chunks:
                if source.complete:
                    self._finish(None)
                    raise StopAsyncIteration
                if source.error is not None:
                    raise source.error
                await source.wait()
        except StopAsyncIteration:
            raise
        except (OSError, ValueError) as exc:
            # The backend died mid-stream: a clean end makes client-go re-watch, but would pass any other
            # truncated body off as complete, so the adapter resets the stream.
            self._finish(exc)
            if self.swallow:
                raise StopAsyncIteration from None
            raise BackendFailed(f"{self.name} closed the response mid-stream: {type(exc).__name__}") from exc
        except BaseException as exc:
            self._finish(exc)
            raise
        chunk = source.take()
        if source.complete and not source.chunks:
            # All of it: give the connection back now; the adapter ends the stream with this chunk.
            self.exhausted = True
            self._finish(None)
        return chunk

    def _release(self, error: BaseException | None) -> None:
        """Give back what carried the body; ``error`` None means it was read to its end."""
        raise NotImplementedError

    def _finish(self, error: BaseException | None) -> None:
        if self.done:
            return
        self.done = True
        self._release(error)
        self.on_done(error)

    async def aclose(self) -> None:
        if not self.done:
            # Stopped early (client went away): mid-body, so the connection or stream is closed.
            self._finish(asyncio.CancelledError("response body closed before its end"))


class LeanBody(StreamedBody):
    """A body on a pooled HTTP/1.1 connection: back to the pool when read whole, closed otherwise."""

    def __init__(self, conn: Conn, pool: Pool, name: str, *, swallow_errors: bool,
                 on_done: Callable[[BaseException | None], None]) -> None:
        super().__init__(conn, name, swallow_errors=swallow_errors, on_done=on_done)
        self.conn = conn
        self.pool = pool

    def _release(self, error: BaseException | None) -> None:
        if error is None:
            self.pool.put_back(self.conn)
        else:
            self.conn.abort()
        self.pool.slots.release()


async def round_trip(
    pool: Pool, name: str, ctx: ssl.SSLContext, live: Callable[[], tuple[object, ...]], head: bytes, *,
    method: str, body: ClientBody | None, declared: int | None, header_timeout: float | None,
    acquire_timeout: float, pool_name: str, swallow_body_errors: bool,
    on_done: Callable[[BaseException | None], None],
) -> tuple[int, list[tuple[bytes, bytes]], LeanBody]:
    """Send one request and wait for its response head; the body streams as it is pulled.

    Raises :class:`PoolTimeout` or :class:`ConnectFailed` when nothing was sent, :class:`UpstreamTimeout` without a head
    in time, :class:`ClientBodyFailed` when the client's body broke off, and :class:`BackendFailed` when the backend may
    have seen the request."""
    slots = pool.slots
    if not slots.try_take():  # only a full pool pays for a future and a timeout scope
        try:
            async with asyncio.timeout(acquire_timeout):
                await slots.take()
        except TimeoutError:
            raise PoolTimeout(f"no free {pool_name} connection to {name} within {acquire_timeout:g}s") from None
    conn: Conn | None = None
    try:
        conn = pool.take_idle(ctx, live)
        if conn is None:
            try:
                conn = await pool.connect(ctx)
            except (TimeoutError, OSError, ssl.SSLError) as exc:
                raise ConnectFailed(connect_cause(exc)) from exc
        conn.begin(head, head_only=method == "HEAD", header_timeout=header_timeout)
        conn.request_sent = body is None
        if body is not None:
            conn.body_task = asyncio.create_task(_send_body(conn, body, declared))
        await conn.wait_head()
    except BaseException as exc:
        if conn is not None:
            conn.abort()
        pool.slots.release()
        if body is not None and body.error is not None:
            raise ClientBodyFailed(f"request body failed: {body.error}") from body.error
        if isinstance(exc, ConnectFailed):
            raise
        if isinstance(exc, TimeoutError):
            raise UpstreamTimeout(f"no response headers from {name} within {header_timeout:g}s") from exc
        if isinstance(exc, OSError):
            raise BackendFailed(f"{name}: {type(exc).__name__}") from exc
        raise
    return conn.status, conn.raw_headers, LeanBody(conn, pool, name, swallow_errors=swallow_body_errors,
                                                   on_done=on_done)
