"""The operational endpoints both servers answer: ``/healthz``, ``/livez``, ``/readyz``, ``/metrics``.

The webhook serves them on its TLS port beside ``/validate`` and ``/mutate``;
the proxy on its plain-HTTP side listener (``listener.metricsPort``). The
page comes from :func:`gatekeeper.runtime.metrics.render`, so both honour prometheus
multiprocess mode.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from aiohttp import web

from gatekeeper.runtime import metrics
from gatekeeper.runtime.multiproc import MULTIPROC_ENV

T = TypeVar("T")

Render = Callable[[], tuple[bytes, str] | Awaitable[tuple[bytes, str]]]
"""A page and its content type, or a coroutine giving them (a proxy worker waits for its siblings' pages)."""

_SCRAPE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gatekeeper-metrics")
"""The one thread that reads prometheus multiprocess files (threads start on first use, not at import)."""


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the metrics thread: blocking file reads and page parsing, never on a serving loop.

    Merging the multiprocess files is all Python (mmap reads, struct unpacking, text formatting): measured
    with 4 workers' files of ~2,200 series each (a 440 KB page), one scrape held the event loop that also
    proxies requests or answers admission reviews for 90 ms (webhook) to 220 ms (proxy worker and parent),
    400-900 ms with the machine busy. One thread, not a pool: scrapes do not overlap anyway (see
    :class:`SharedRender`), and a slow disk must not turn into a pile of blocked threads. Only code that
    touches no event-loop state may run here (files, pure functions), not the live collectors."""
    return await asyncio.get_running_loop().run_in_executor(_SCRAPE_THREAD, fn, *args)


class SharedRender(Generic[T]):
    """One render in flight per process; scrapes that arrive meanwhile wait for its result.

    Prometheus servers, an admin's ``curl`` and a ``kubectl get --raw /metrics`` can scrape at once; each
    used to render its own page. Sharing the in-flight render bounds the work (and the memory of pages
    under construction) to one page whatever the number of scrapers; a late arrival gets a page at most
    one render old. A scraper that goes away does not cancel the render the others wait for.
    """

    def __init__(self, render: Callable[[], Awaitable[T]]) -> None:
        self.render = render
        self._inflight: asyncio.Future[T] | None = None
        self.renders = 0
        """How many renders ran (tests count the ones concurrent scrapes shared)."""

    async def __call__(self) -> T:
        fut = self._inflight
        if fut is None or fut.get_loop() is not asyncio.get_running_loop():
            self.renders += 1
            fut = self._inflight = asyncio.ensure_future(self.render())
            fut.add_done_callback(self._done)
        return await asyncio.shield(fut)

    def _done(self, fut: asyncio.Future[T]) -> None:
        if self._inflight is fut:
            self._inflight = None
        if not fut.cancelled():
            fut.exception()  # retrieved: every waiter may have gone; each one still present gets it raised


async def _process_page() -> tuple[bytes, str]:
    if os.environ.get(MULTIPROC_ENV):  # every worker's files: read on the metrics thread
        return await off_loop(metrics.render)
    return metrics.render()  # this process's registry, in memory: live collectors read loop state


this_process_page = SharedRender(_process_page)
"""The default ``/metrics`` page: :func:`gatekeeper.runtime.metrics.render`, its multiprocess files read off the
loop."""


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz`` and ``/livez``: the event loop answers."""
    return web.Response(text="ok")


def add_ops_routes(app: web.Application, not_ready: Callable[[], str | Awaitable[str | None] | None],
                   render: Render | None = None) -> None:
    """Route the four endpoints; ``not_ready()`` is None when ready, else the 503 body saying why (awaited if a
    coroutine: the proxy's parent asks its workers).

    ``render`` defaults to :data:`this_process_page`; the proxy passes a lambda reading
    ``gatekeeper.proxy.metrics.render_page``, which a worker replaces with the whole-proxy page.
    """

    async def metrics_handler(request: web.Request) -> web.Response:
        page = (render or this_process_page)()
        body, content_type = await page if inspect.isawaitable(page) else page
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def readyz(request: web.Request) -> web.Response:
        reason = not_ready()
        if inspect.isawaitable(reason):
            reason = await reason
        if reason is None:
            return web.Response(text="ok")
        return web.Response(status=503, text=reason)

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
