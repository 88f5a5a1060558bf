"""The HTTP/1.1 message both upstream paths agree on: the request head, body framing, and the streamed response body.

The target goes out byte for byte as the pipeline classified it: checked, never re-parsed or normalised. A body with a
Content-Length is held to it, so no byte of a second request can ride in it."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from collections.abc import Set as AbstractSet

from gatekeeper.proxy.messages import Headers
from gatekeeper.proxy.upstream.errors import BackendFailed
from gatekeeper.proxy.upstream.hop_by_hop import refuse_named_fields
from gatekeeper.proxy.upstream.slots import OneWaiter

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


def encode_request_head(method: str, target: str, authority: str, headers: Headers, removed: AbstractSet[str],
                        *, has_body: bool) -> tuple[bytes, int | None]:
    """The request head as one ``bytes`` and the body's declared length (None: chunked or no body).

    Drops ``removed``. What ``Connection`` names the front stage dropped (``auth.drop_connection_named``): one naming
    a field not in ``removed`` raises, as does a method that is not a token, a target that is not origin-form
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
                refuse_named_fields(value, removed)
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


class StreamedBody:
    """A response body: chunks as they arrive, what carried it released exactly once. ``aclose`` works before iteration
    too, so a dropped response still frees its connection and lease."""

    def __init__(self, source: OneWaiter, name: str, *, swallow_errors: bool,
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
