"""The aiohttp pieces of a backend: how its sessions are built, and the response body that frees their connections.

aiohttp carries requests when ``upstream.client: aiohttp`` (the older client;
``lean`` is the default) and every health probe. Its session settings are
where the proxy's semantics live (no total timeout, no decompression, no
retries behind the client's back), and its response body must give a pooled
connection and a lease back exactly once however the adapter stops reading.
The request path itself stays inline in ``BackendClient.send``: a call of its
own would cost every aiohttp request a coroutine.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

import aiohttp

from gatekeeper.proxy.upstream.errors import BackendFailed


def new_session(limit: int, ssl_ctx: ssl.SSLContext, connect_timeout: float) -> aiohttp.ClientSession:
    """A session whose pool holds at most ``limit`` connections to the one backend."""
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, ssl=ssl_ctx,
                                     enable_cleanup_closed=True)
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )
    # aiohttp re-sends an idempotent request (PUT and DELETE included) once when a reused
    # connection turns out closed. The proxy cannot know the backend did not act on the
    # first copy, so nothing is ever re-sent behind the client's back.
    session._retry_connection = False
    return session


class ResponseBody:
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

    def __aiter__(self) -> ResponseBody:
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
