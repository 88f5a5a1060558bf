"""The operational endpoints both servers answer: ``/healthz``, ``/livez``, ``/readyz``, ``/metrics``.

The webhook serves them on its TLS port beside ``/validate`` and ``/mutate``;
the proxy on its plain-HTTP side listener (``listener.metricsPort``). The
page comes from :func:`gatekeeper.metrics.render`, so both honour prometheus
multiprocess mode.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

from aiohttp import web

from gatekeeper import metrics

Render = Callable[[], tuple[bytes, str] | Awaitable[tuple[bytes, str]]]
"""A page and its content type, or a coroutine giving them (a proxy worker waits for its siblings' pages)."""


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz`` and ``/livez``: the event loop answers."""
    return web.Response(text="ok")


def add_ops_routes(app: web.Application, not_ready: Callable[[], str | None],
                   render: Render | None = None) -> None:
    """Route the four endpoints; ``not_ready()`` is None when ready, else the 503 body saying why.

    ``render`` defaults to :func:`gatekeeper.metrics.render`; the proxy passes a lambda reading
    ``gatekeeper.proxy.metrics.render_page``, which a worker replaces with the whole-proxy page.
    """

    async def metrics_handler(request: web.Request) -> web.Response:
        page = (render or metrics.render)()
        body, content_type = await page if inspect.isawaitable(page) else page
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def readyz(request: web.Request) -> web.Response:
        reason = not_ready()
        if reason is None:
            return web.Response(text="ok")
        return web.Response(status=503, text=reason)

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
