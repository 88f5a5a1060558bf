"""Run the webhook: one uvloop process, or N processes sharing the port (SO_REUSEPORT).

With ``--workers N`` the kernel spreads new connections over N listening
sockets bound to the same port, one per process, so reviews use N cores
without a shared accept lock. Metrics switch to prometheus-client's
multiprocess mode so any worker's ``/metrics`` reports all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import ssl
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web

from gatekeeper.runtime.metrics import child, register_page_collector
from gatekeeper.runtime.multiproc import MULTIPROC_ENV
from gatekeeper.serving.netbind import bind_listeners
from gatekeeper.webhook import kube_api
from gatekeeper.webhook.app import MAPPING_KEY, NAMESPACE_MODES_KEY, READY_KEY, build_app, metrics
from gatekeeper.webhook.deviceclasses import ExtendedResourceMap
from gatekeeper.webhook.inventory.controller import Inventory
from gatekeeper.webhook.inventory.exposition import InventoryCollector, SnapshotStore
from gatekeeper.webhook.inventory.lease import LeaseElector
from gatekeeper.webhook.listen import LimitedSite, QuietClientErrors
from gatekeeper.webhook.namespace_modes import NamespaceModes
from gatekeeper.webhook.pod_refs import PodTemplateRefs
from gatekeeper.webhook.settings import ServerSettings, WebhookSettings
from gatekeeper.webhook.template_lifecycle import TemplateLifecycle
from gatekeeper.webhook.templates import TemplateKeeper
from gatekeeper.webhook.tls import ReloadingContext, load_server_context

log = logging.getLogger(__name__)


class StartupError(Exception):
    """The server cannot start as configured; the message names the setting (shown without a traceback)."""


def _cannot_listen(srv: ServerSettings, exc: OSError) -> StartupError:
    """The one-line error for a port the parent's reservation or a worker's listener cannot bind."""
    return StartupError(f"webhook.server: cannot listen on {srv.address}:{srv.port}: {exc.strerror or exc}")


def preflight(settings: WebhookSettings) -> None:
    """Check what would otherwise fail as a traceback inside a worker: the TLS pair and the kubeconfig path."""
    srv = settings.server
    try:
        load_server_context(srv.cert_file, srv.key_file)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise StartupError(f"webhook.server.certFile/keyFile ({srv.cert_file}, {srv.key_file}): "
                           f"cannot load the serving certificate and key: {exc}") from None
    if srv.client_ca_file:
        try:
            load_server_context(srv.cert_file, srv.key_file, srv.client_ca_file)
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise StartupError(f"webhook.server.clientCaFile ({srv.client_ca_file}): cannot load the "
                               f"client CA: {exc}") from None
    if settings.gpu.enabled and settings.kubeconfig and not os.path.isfile(settings.kubeconfig):
        raise StartupError(f"webhook.kubeconfig: {settings.kubeconfig} does not exist")


def _write_port_file(path: str, port: int) -> None:
    if not path:
        return
    p = Path(path)
    tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(p)


async def _kube_client(settings: WebhookSettings) -> Any:
    if not settings.gpu.enabled:
        return None
    if not settings.kubeconfig and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        log.warning("no webhook.kubeconfig and not in a cluster: DRA rewrites cannot create "
                    "ResourceClaimTemplates and will be refused")
        return None
    return await kube_api.api_client(settings.kubeconfig)


async def _runner_and_site(srv: ServerSettings, app: web.Application, tls: ReloadingContext,
                           ) -> tuple[web.AppRunner, LimitedSite]:
    """The set-up aiohttp runner of ``app`` and its bounded TLS site (not started yet)."""
    # keepalive_timeout: aiohttp closes a connection without a complete request head this long (idle or
    # slowloris); its own default is 3630 s.
    # max_headers/max_field_size/max_line_size: what one unfinished request head can hold (aiohttp's 128 fields of
    # 8 KiB were ~2.5 MiB of memory per connection); refusals are malformed HTTP, counted by QuietClientErrors.
    # What all connections hold together is maxBufferedRequestBytes (LimitedSite).
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=srv.idle_timeout_seconds,
                           logger=QuietClientErrors(metrics().bad_requests.labels("http").inc),
                           max_headers=srv.max_header_fields, max_field_size=srv.max_header_field_bytes,
                           max_line_size=srv.max_header_field_bytes)
    await runner.setup()
    refused = metrics().refused_connections.labels("connection-cap")
    evicted = metrics().refused_connections.labels("request-budget")
    handshake_timeouts = metrics().refused_connections.labels("handshake-timeout")
    site = LimitedSite(runner, srv.address, srv.port, ssl_context=tls.base, max_connections=srv.max_connections,
                       handshake_timeout=srv.tls_handshake_timeout_seconds, on_refused=refused.inc,
                       max_buffered_request_bytes=srv.max_buffered_request_bytes, on_evicted=evicted.inc,
                       on_handshake_timeout=handshake_timeouts.inc, on_handshake_late=metrics().handshakes_late.inc,
                       receive_buffer=srv.socket_receive_buffer_bytes, on_accepted=metrics().connections.inc)
    return runner, site


async def serve(settings: WebhookSettings, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set or SIGTERM/SIGINT arrives."""
    srv = settings.server
    tls = ReloadingContext(srv.cert_file, srv.key_file, srv.cert_check_interval_seconds,
                           client_ca_file=srv.client_ca_file)
    try:
        api_client = await _kube_client(settings)
    except Exception as exc:  # kubernetes_asyncio raises ConfigException, OSError, ... for a bad kubeconfig
        raise StartupError(f"webhook.kubeconfig ({settings.kubeconfig or 'in-cluster'}): cannot build a "
                           f"Kubernetes client: {exc}") from None
    keeper = None
    if api_client is not None:
        counter = metrics().templates
        keeper = TemplateKeeper(kube_api.template_creator(api_client), settings.gpu.template_cache_seconds,
                                on_result=lambda r: child(counter, r).inc())
    app = build_app(settings, keeper, ready=False)
    mapping_task = ns_task = None
    if api_client is not None and settings.gpu.kep5004 == "step-aside":  # rewrite never asks whether one maps
        mapping = ExtendedResourceMap(kube_api.device_class_lister(api_client), settings.gpu.device_class_check_seconds)
        await mapping.refresh()  # the first pods already see an existing mapping
        app[MAPPING_KEY] = mapping
        mapping_task = asyncio.create_task(mapping.run())
    if api_client is not None:
        ns_modes = NamespaceModes(*kube_api.namespace_source(api_client))
        app[NAMESPACE_MODES_KEY] = ns_modes
        ns_task = asyncio.create_task(ns_modes.run())
        with contextlib.suppress(TimeoutError):  # the first pods already see existing labels
            await asyncio.wait_for(ns_modes.synced.wait(), 10)
    inventory_task = _start_inventory(settings, api_client)
    lifecycle_task = refs_task = None
    if keeper is not None and settings.gpu.template_reconcile_seconds > 0:
        pod_refs = PodTemplateRefs(*kube_api.pod_source(api_client))
        refs_task = asyncio.create_task(pod_refs.run())
        counter = metrics().templates
        lifecycle = TemplateLifecycle(kube_api.template_ops(api_client), settings.gpu.template_reconcile_seconds,
                                      settings.gpu.template_gc_grace_seconds, pod_refs.referenced,
                                      forget=keeper.forget, on_result=lambda r: child(counter, r).inc(),
                                      seen=keeper.seen)
        keeper.on_ensured = lifecycle.ensured
        lifecycle_task = asyncio.create_task(lifecycle.run())
    runner, site = await _runner_and_site(srv, app, tls)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        if api_client is not None:
            await api_client.close()
        raise _cannot_listen(srv, exc) from None
    sockets = site.sockets
    port = sockets[0].getsockname()[1] if sockets else srv.port
    # Certificates are loaded (ReloadingContext) and the socket listens: only now is /readyz true.
    app[READY_KEY].update(ready=True, reason="")
    _write_port_file(srv.port_file, port)
    log.info("gatekeeper webhook (pid %d) serving https://%s:%d", os.getpid(), srv.address, port)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        # From SIGTERM on, /readyz is false (in-flight and late reviews are still answered while the
        # endpoint removal propagates; the pod's preStop sleep covers that before SIGTERM).
        app[READY_KEY].update(ready=False, reason="shutting down")
        if srv.shutdown_delay_seconds:
            await asyncio.sleep(srv.shutdown_delay_seconds)
        for task in (mapping_task, ns_task, lifecycle_task, refs_task, inventory_task):
            if task is not None:
                task.cancel()
        await runner.cleanup()
        if api_client is not None:
            await api_client.close()


SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _start_inventory(settings: WebhookSettings, api_client: Any) -> asyncio.Task[None] | None:
    """The GPU inventory of this process: it competes for the Lease, and leads or follows."""
    inv = settings.inventory
    if api_client is None or not inv.enabled:
        return None
    namespace = inv.lease_namespace or (SA_NAMESPACE.read_text().strip() if SA_NAMESPACE.is_file() else "default")
    store = SnapshotStore(os.environ.get(MULTIPROC_ENV), inv.lease_seconds)
    register_page_collector(InventoryCollector(store))
    ops = kube_api.lease_ops(api_client, inv.lease_name, namespace)
    identity = f"{socket.gethostname()}-{os.getpid()}"

    def elector(on_change: Any) -> LeaseElector:
        return LeaseElector(ops, inv.lease_name, namespace, identity, inv.lease_seconds, inv.renew_seconds, on_change)

    inventory = Inventory(elector, kube_api.dra_source(api_client, "resourceslices"),
                          kube_api.dra_source(api_client, "resourceclaims"), store, inv.publish_seconds)
    return asyncio.create_task(inventory.run())


def _run_one(settings: WebhookSettings) -> None:
    uvloop.run(serve(settings))


def _run_worker(settings: WebhookSettings) -> None:
    """A worker process: a startup error is one line on stderr and exit code 2, like the CLI's."""
    try:
        _run_one(settings)
    except StartupError as exc:
        print(f"gatekeeper webhook: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def run(settings: WebhookSettings, workers: int = 1) -> int:
    """Serve in this process, or fork ``workers`` processes; with workers the caller has already called
    ``gatekeeper.runtime.multiproc.enable_multiprocess`` (before this module's import fixed the metrics mode)."""
    if workers <= 1:
        _run_one(settings)
        return 0
    srv = settings.server
    try:
        # Bound (SO_REUSEPORT), not listening: port 0 resolves to one port all workers share, and a port that
        # cannot be bound is reported once, by the parent, instead of by every worker.
        reserved = bind_listeners(srv.address, srv.port, reuse_port=True)
    except OSError as exc:
        raise _cannot_listen(srv, exc) from None
    settings = replace(settings, server=replace(srv, port=reserved[0].getsockname()[1]))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_run_worker, args=(settings,), name=f"webhook-worker-{i}")
             for i in range(workers)]
    for p in procs:
        p.start()
    log.info("started %d webhook workers on port %d", workers, settings.server.port)

    def forward(signum: int, frame: object) -> None:
        for p in procs:
            if p.is_alive() and p.pid:
                os.kill(p.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        for p in procs:
            p.join()
    finally:
        for sock in reserved:
            sock.close()
    return max((p.exitcode or 0) for p in procs)
