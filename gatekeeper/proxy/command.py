"""`gatekeeper proxy --config FILE`: run the front proxy.

Wires the pieces together and owns nothing else: the pipeline (identity,
RequestInfo, flow control, balancer, upstream), a plain-HTTP side listener for
``/metrics``, ``/healthz`` and ``/readyz`` (``listener.metricsPort``), and the
TLS listener from ``gatekeeper.proxy.listen.server`` that speaks h2 and HTTP/1.1 and
handles SIGTERM (stop accepting, GOAWAY, drain, exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gatekeeper.errors import UsageError
from gatekeeper.ops import add_ops_routes
from gatekeeper.proxy.settings import ProxySettings  # also registers the proxy: config section

if TYPE_CHECKING:
    from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl

log = logging.getLogger("gatekeeper.proxy")


NAME = "proxy"
HELP = "run the API-aware front proxy in front of several kube-apiservers"
DESCRIPTION = (
    "Serve h2 and HTTP/1.1 over TLS, balance every request across the configured apiservers "
    "(least in-flight, power of two choices), assert client-certificate identities with the "
    "front-proxy certificate, apply flow control, and send graceful GOAWAYs. /metrics, /healthz "
    "and /readyz are served on listener.metricsPort (plain HTTP)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's options and handler (``set_defaults(func=...)``); the CLI makes the parser."""
    p.add_argument("--config", required=True, type=Path, help="YAML config file with a proxy: section")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="worker processes sharing the port (default proxy.workers; 0 = one per usable core)")
    p.add_argument("--check", action="store_true",
                   help="validate the config, its certificate and key files and its flow-control policy, print a "
                        "summary and exit (0: the proxy would start on it; 2: the problems, on stderr)")
    for hidden in ("--worker-index", "--worker-port", "--handoff-fd"):  # set by the supervisor (proxy/workers.py)
        p.add_argument(hidden, type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--runtime-dir", type=Path, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_run)


def _check_files(settings: ProxySettings) -> None:
    files = {
        "proxy.listener.certFile": settings.listener.cert_file,
        "proxy.listener.keyFile": settings.listener.key_file,
        "proxy.listener.clientCaFile": settings.listener.client_ca_file,
        "proxy.upstream.caFile": settings.upstream.ca_file,
        "proxy.upstream.clientCertFile": settings.upstream.client_cert_file,
        "proxy.upstream.clientKeyFile": settings.upstream.client_key_file,
    }
    if not settings.upstream.ca_file:
        raise UsageError("proxy.upstream.caFile is required: the CA that signed the apiservers' serving "
                         "certificates (the system roots are never trusted for them)")
    for key, path in files.items():
        if path and not Path(path).is_file():
            raise UsageError(f"{key}: {path} does not exist or is not a file")
    if settings.listener.client_ca_file and not settings.upstream.client_cert_file:
        raise UsageError(
            "proxy.listener.clientCaFile is set (client certificates are accepted) but "
            "proxy.upstream.clientCertFile is not: the proxy needs a front-proxy client certificate "
            "to tell the apiservers who a certificate user is"
        )


def _run(args: argparse.Namespace) -> int:
    from gatekeeper.config import load_config
    from gatekeeper.proxy import workers

    settings: ProxySettings = load_config(args.config, need="proxy").proxy
    if args.check:
        return _run_check(settings)
    _check_files(settings)
    if args.worker_index is not None and args.runtime_dir is not None and args.worker_port is not None:
        workers.run_worker(settings, args.worker_index, args.runtime_dir, args.worker_port, args.handoff_fd)
        return 0
    if args.workers is not None and args.workers < 0:
        raise UsageError("--workers: must be >= 0 (0 = one per usable core)")
    n = workers.worker_count(settings, args.workers)
    if n > 1:
        return workers.supervise(settings, args.config, n)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency, but plain asyncio works too
        pass
    tune_gc(settings)
    asyncio.run(run(settings))
    return 0


def _run_check(settings: ProxySettings) -> int:
    from gatekeeper.proxy.check import check

    summary, problems = check(settings, _check_files)
    print("\n".join(summary))
    for problem in problems:
        print(f"gatekeeper proxy --check: error: {problem}", file=sys.stderr)
    return 2 if problems else 0


def tune_gc(settings: ProxySettings) -> None:
    """Before serving: freeze what startup built and collect the young generation less often.

    Modules, settings and tables live as long as the process; frozen, they are no
    longer traversed by every full collection. Only process entry points call this
    (never ``run``, which tests also call in-process).
    """
    gc.collect()
    gc.freeze()
    if settings.gc_young_threshold:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(settings.gc_young_threshold, older, oldest)


def flow_control_middleware(settings: ProxySettings) -> FlowControl | None:
    """Flow control's middleware (None when ``flowControl.enabled`` is false); :func:`run` starts and closes it.

    Imported here, not at the top: ``gatekeeper.cli`` imports every command module to build its parser,
    and prometheus_client (flow control's metrics) must not be imported before ``gatekeeper webhook
    --workers N`` has set ``PROMETHEUS_MULTIPROC_DIR``.
    """
    from gatekeeper.proxy.flowcontrol.edge.middleware import from_settings

    return from_settings(settings.flow_control)


def metrics_app(ready: Callable[[], bool]) -> web.Application:
    from gatekeeper.proxy import metrics

    async def worker_page(request: web.Request) -> web.Response:
        """This process's own samples, whatever ``metrics.render_page`` became (the supervisor merges them)."""
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    add_ops_routes(app, lambda: None if ready() else "no healthy backend, the listener is not serving yet, or it is "
                                                     "shutting down", render=lambda: metrics.render_page())
    app.router.add_get("/metrics/worker", worker_page)
    return app


async def start_metrics_listener(
    address: str, port: int, ready: Callable[[], bool],
) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(metrics_app(ready), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, address, port)
    await site.start()
    server: Any = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, int(bound)


async def run(
    settings: ProxySettings,
    *,
    on_ready: Callable[[dict[str, Any]], None] | None = None,
    serve: Callable[..., Awaitable[Any]] | None = None,
    setup: Callable[[Any, Any], None] | None = None,
) -> None:
    """Run until the listener returns (SIGTERM drained); ``on_ready`` gets the bound URLs.

    ``setup(flow_control, pipeline)`` runs before the listener starts (a worker attaches its seat ledger)."""
    from gatekeeper.proxy.pipeline.stages import build

    if serve is None:
        from gatekeeper.proxy.listen.server import serve as serve_fn

        serve = serve_fn
    flow = flow_control_middleware(settings)
    pipeline = build(settings, flow_control=flow)
    if flow is not None:
        # flow control fetches the issuer's keys through the same clients
        flow.use_upstream(list(pipeline.clients.values()))
        await flow.start()
    await pipeline.start()
    if setup is not None:
        setup(flow, pipeline)
    listening = asyncio.Event()
    draining = asyncio.Event()
    runner: web.AppRunner | None = None
    info: dict[str, Any] = {}
    try:
        if settings.listener.metrics_port >= 0:
            runner, mport = await start_metrics_listener(
                settings.listener.metrics_address, settings.listener.metrics_port,
                lambda: listening.is_set() and not draining.is_set() and pipeline.ready(),
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
            # Load balancers stop sending new connections while the open ones drain.
            draining.set()
            log.info("draining: /readyz now answers 503")

        await serve(settings, pipeline.handler, ready=ready, stopping=stopping)
    finally:
        if runner is not None:
            await runner.cleanup()
        await pipeline.close()
        if flow is not None:
            with contextlib.suppress(Exception):
                await flow.close()
