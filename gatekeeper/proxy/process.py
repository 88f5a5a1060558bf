"""The proxy process put together: the pipeline, its side listener and the TLS listener, in one event loop. Import only
once the metrics mode is set: prometheus_client picks single- or multiprocess values at import."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from gatekeeper.proxy import caches, gcpace, memtrace, metrics
from gatekeeper.proxy.flowcontrol.edge.endpoints import EndpointPublisher, publisher_for
from gatekeeper.proxy.flowcontrol.edge.ledger import SeatLedger, attach
from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl, from_settings
from gatekeeper.proxy.handoff.inbox import Inbox
from gatekeeper.proxy.handoff.protocol import ClosedCounts
from gatekeeper.proxy.listen.server import serve as serve_listener
from gatekeeper.proxy.pipeline.stages import Pipeline, build
from gatekeeper.proxy.settings import ProxySettings
from gatekeeper.proxy.worker_metrics import register_recent_requests, serve_app, whole_proxy_page
from gatekeeper.proxy.workers import PARENT_ENV
from gatekeeper.runtime.ops import add_ops_routes

log = logging.getLogger("gatekeeper.proxy")

def tune_gc(settings: ProxySettings) -> None:
    """Freeze what startup built (never traversed by full collections again) and collect less often. Process entry
    points only: tests call ``run`` in-process."""
    gc.collect()
    gc.freeze()
    if settings.gc_young_threshold:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(settings.gc_young_threshold, older, oldest)


def flow_control_middleware(settings: ProxySettings) -> FlowControl | None:
    """Flow control's middleware (None when ``flowControl.enabled`` is false); :func:`run` starts and closes it."""
    return from_settings(settings.flow_control)


def metrics_app(ready: Callable[[], bool]) -> web.Application:
    async def worker_page(request: web.Request) -> web.Response:
        """This process's own samples, whatever ``metrics.render_page`` became (the supervisor merges them)."""
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    add_ops_routes(app, lambda: None if ready() else "no healthy backend, the listener is not serving yet, or it is "
                                                     "shutting down", render=lambda: metrics.render_page())
    app.router.add_get("/metrics/worker", worker_page)
    return app


async def start_pipeline(settings: ProxySettings) -> tuple[FlowControl | None, Pipeline]:
    """The pipeline as the proxy serves with it, started (flow control too); the benchmark starts it the same way."""
    flow = flow_control_middleware(settings)
    pipeline = build(settings, flow_control=flow)
    if flow is not None:
        flow.use_upstream(list(pipeline.clients.values()))
        flow.use_backends([b.name for b in pipeline.balancer.backends], pipeline.balancer.by_load)
        await flow.start()
    await pipeline.start()
    return flow, pipeline


def start_endpoints(settings: ProxySettings, flow: FlowControl | None, *, writer: bool) -> EndpointPublisher | None:
    """``fleet.publishEndpoints``: our advert on the fleet Lease; ``writer`` (one process per proxy) also takes part
    in electing the one proxy that writes the ``kubernetes`` Service's endpoints."""
    fc = settings.flow_control
    publisher = publisher_for(getattr(flow, "fleet", None), fc.fleet.publish_endpoints, settings.listener.port,
                              writer=writer)
    if publisher is not None:
        publisher.start()
    return publisher


async def run(
    settings: ProxySettings,
    *,
    on_ready: Callable[[dict[str, Any]], None] | None = None,
    serve: Callable[..., Awaitable[Any]] | None = None,
    setup: Callable[[Any, Any], None] | None = None,
    endpoints_writer: bool = True,
) -> None:
    """Run until the listener returns (SIGTERM drained); ``on_ready`` gets the bound URLs; ``setup`` runs first;
    ``endpoints_writer``: this process may write the ``kubernetes`` Service's endpoints (one per proxy)."""
    serve = serve or serve_listener
    flow, pipeline = await start_pipeline(settings)
    if setup is not None:
        setup(flow, pipeline)
    endpoints = start_endpoints(settings, flow, writer=endpoints_writer)
    leaving: set[asyncio.Task[None]] = set()
    caches.watch_tokens(pipeline.identities)
    if flow is not None and getattr(flow, "controller", None) is not None:
        caches.watch_flow_control(flow.controller)
    collections = gcpace.FullCollections(settings.gc_full_interval_seconds)
    collections.start()
    listening = asyncio.Event()
    draining = asyncio.Event()
    runner: web.AppRunner | None = None
    info: dict[str, Any] = {}
    try:
        if settings.listener.metrics_port >= 0:
            runner, mport = await serve_app(
                metrics_app(lambda: listening.is_set() and not draining.is_set() and pipeline.ready()),
                settings.listener.metrics_address, settings.listener.metrics_port,
            )
            info["metricsUrl"] = f"http://{settings.listener.metrics_address}:{mport}"

        def ready(port: int) -> None:
            info["url"] = f"https://{settings.listener.address}:{port}"
            listening.set()
            log.info("gatekeeper proxy serving on %s (metrics %s), backends: %s", info["url"],
                     info.get("metricsUrl", "disabled"), ", ".join(b.url for b in pipeline.balancer.backends))
            if on_ready is not None:
                on_ready(dict(info))

        def stopping() -> None:
            # Load balancers stop sending new connections while the open ones drain, and so does kube-proxy once
            # our advert is off the kubernetes Service's endpoints.
            draining.set()
            log.info("draining: /readyz now answers 503")
            if endpoints is not None:
                leaving.add(asyncio.get_running_loop().create_task(endpoints.leave()))

        await serve(settings, pipeline.handler, ready=ready, stopping=stopping)
    finally:
        collections.stop()
        if runner is not None:
            await runner.cleanup()
        if endpoints is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*leaving), settings.flow_control.fleet.renew_interval_seconds)
            await endpoints.close()
        await pipeline.close()
        if flow is not None:
            with contextlib.suppress(Exception):
                await flow.close()


def run_single(settings: ProxySettings) -> None:
    """``gatekeeper proxy`` as one process (``--workers 1``): serve until SIGTERM has drained it."""
    uvloop.install()
    tune_gc(settings)
    asyncio.run(run(settings))


def worker_settings(settings: ProxySettings, port: int) -> ProxySettings:
    """A worker takes its connections from the parent and reports the parent's port; its metrics page is private
    (loopback, any port)."""
    listener = replace(settings.listener, port=port, metrics_address="127.0.0.1", metrics_port=0)
    return replace(settings, listener=listener)


def _die_with_parent() -> None:
    parent = int(os.environ.get(PARENT_ENV, "0") or 0)
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if parent and os.getppid() != parent:
        sys.exit(0)  # the parent died before we could ask to follow it


def run_worker(settings: ProxySettings, index: int, runtime: Path, port: int, handoff_fd: int) -> None:
    """One worker: the ordinary proxy, binding nothing (connections come over ``handoff_fd``), plus the ledger."""
    _die_with_parent()
    memtrace.install(index)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # flow control installs its reload handler; never die of it
    settings = worker_settings(settings, port)

    def setup(flow: Any, pipeline: Any) -> None:
        ledger = SeatLedger(runtime / "ledger", index)
        register_recent_requests(pipeline)
        metrics.render_page = whole_proxy_page(runtime, ledger, index)
        if flow is not None and getattr(flow, "controller", None) is not None:
            if flow.fleet is not None:
                flow.fleet.set_worker(index)  # before attach re-reads the levels
            attach(flow, ledger)

    def on_ready(info: dict[str, Any]) -> None:
        path = runtime / f"worker-{index}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), **info}))
        tmp.replace(path)

    inbox = Inbox(handoff_fd, ClosedCounts(runtime / "closed"), index)
    serve_fn = functools.partial(serve_listener, handoff=inbox, supervised=True)
    uvloop.install()
    tune_gc(settings)
    asyncio.run(run(settings, on_ready=on_ready, setup=setup, serve=serve_fn, endpoints_writer=index == 0))
