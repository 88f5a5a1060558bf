"""One ``/metrics`` page for all proxy workers: the multiprocess files plus every worker's live gauges, merged.

Live gauges exist only in each worker, so pages are fetched and summed (skew recomputed from the sums); a page that
does not come in time is shown missing, never summed as zeros. Rendering runs off the loop (docs/proxy/workers.md)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from aiohttp import ClientSession, ClientTimeout, web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gatekeeper.proxy.flowcontrol.edge.ledger import SeatLedger
from gatekeeper.runtime.metrics import multiprocess_registry
from gatekeeper.runtime.ops import SharedRender, add_ops_routes, off_loop


class WorkerSlot(Protocol):
    """What the pages say of one worker slot."""

    index: int
    restarts: int
    hung_kills: int


class SupervisorView(Protocol):
    """What the parent's pages read of the supervisor (``proxy/workers.py``), which imports this module."""

    @property
    def slots(self) -> Sequence[WorkerSlot]: ...

    @property
    def ledger(self) -> SeatLedger: ...

    def worker_urls(self) -> dict[int, str]: ...

    def describe(self) -> list[dict[str, Any]]: ...

SKEW_INPUT = "gatekeeper_proxy_worker_skew_input"
"""Hidden per-worker family: in-flight and recent requests per backend, divided by weight (kind label)."""
_MAX = {
    "gatekeeper_proxy_backend_up",
    "gatekeeper_proxy_backend_state",
    "gatekeeper_flowcontrol_nominal_limit_seats",
    "gatekeeper_flowcontrol_expensive_lists_cap",
}
_PEAK = "gatekeeper_flowcontrol_peak_executing_requests"
_SKEW = {"in_flight": "gatekeeper_proxy_skew_in_flight_ratio", "rate": "gatekeeper_proxy_skew_request_rate_ratio"}
FETCH_TIMEOUT = 5.0
"""Seconds the parent waits for the workers' pages (``/metrics``, ``/readyz``), all fetched at once."""
SIBLING_TIMEOUT = 2.0
"""Seconds a worker rendering the whole proxy's page waits for the other workers' pages, all fetched at once."""
MISSING = "gatekeeper_proxy_worker_page_missing"
Labels = tuple[tuple[str, str], ...]


def register_recent_requests(pipeline: Any) -> None:
    """In a worker: expose the per-backend inputs of the skew ratios, for the parent to sum."""

    balancer = pipeline.balancer

    class SkewInputs(Collector):
        def collect(self) -> Iterator[Metric]:
            fam = GaugeMetricFamily(SKEW_INPUT, "Per-worker skew inputs (merged by the supervisor).",
                                    labels=["backend", "kind", "eligible"])
            now = balancer.clock()
            for b in balancer.backends:
                eligible = "1" if b.eligible(now) else "0"
                fam.add_metric([b.name, "in_flight", eligible], b.in_flight / b.weight)
                fam.add_metric([b.name, "rate", eligible], (b.rate.count() if b.rate else 0) / b.weight)
            yield fam

    REGISTRY.register(SkewInputs())


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(name: str, labels: Labels, value: float) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return f"{name}{{{inner}}} {value!r}" if inner else f"{name} {value!r}"


def _text(families: Iterable[tuple[str, str, str, Iterable[tuple[str, Labels, float]]]]) -> str:
    """Families (name, type, help, samples) in the text format: the one writer of the merged, missing and parent's
    pages."""
    out: list[str] = []
    for name, typ, doc, samples in families:
        out += (f"# HELP {name} {doc}", f"# TYPE {name} {typ}", *(_fmt(*s) for s in samples))
    return "\n".join(out) + "\n" if out else ""


def merge_pages(pages: list[str], skip: set[str], peaks: dict[str, int]) -> str:
    """Merge the workers' live families (those not in ``skip``) into one text page."""

    families: dict[str, tuple[str, str, dict[tuple[str, Labels], float]]] = {}
    for page in pages:
        for fam in text_string_to_metric_families(page):
            if fam.name in skip:
                continue
            _, _, samples = families.setdefault(fam.name, (fam.type, fam.documentation, {}))
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                old = samples.get(key)
                if old is None:
                    samples[key] = s.value
                elif fam.name in _MAX or fam.name == _PEAK or s.name.endswith("_created"):
                    samples[key] = max(old, s.value)
                else:
                    samples[key] = old + s.value
    inputs = families.pop(SKEW_INPUT, None)
    if inputs is not None:
        for kind, name in _SKEW.items():
            per_backend: dict[str, float] = {}
            eligible: set[str] = set()
            for (_, labels), value in inputs[2].items():
                lab = dict(labels)
                if lab.get("kind") == kind:
                    per_backend[lab["backend"]] = per_backend.get(lab["backend"], 0.0) + value
                    if lab.get("eligible") == "1":
                        eligible.add(lab["backend"])
            pool = [v for b, v in per_backend.items() if b in eligible] or list(per_backend.values())
            if pool and name in families:
                families[name] = (families[name][0], families[name][1],
                                  {(name, ()): (max(pool) + 1) / (min(pool) + 1)})
    if _PEAK in families:
        samples = families[_PEAK][2]
        for sname, labels in list(samples):
            level = dict(labels).get("priority_level", "")
            if level in peaks:
                samples[(sname, labels)] = max(peaks[level], 0)
    return _text((name, typ, doc, ((sname, labels, value) for (sname, labels), value in samples.items()))
                 for name, (typ, doc, samples) in families.items())


def multiprocess_page() -> tuple[bytes, set[str]]:
    """The multiprocess files' page and its family names, read once. Blocking: call it off the loop."""

    families = list(multiprocess_registry().collect())

    class Collected(Collector):
        def collect(self) -> Iterator[Metric]:
            return iter(families)

    registry = CollectorRegistry()
    registry.register(Collected())
    return generate_latest(registry), {m.name for m in families}


def files_and_live_page(pages: list[str], peaks: dict[str, int]) -> bytes:
    """The multiprocess files' page, then the workers' live ``pages`` merged (see :func:`merge_pages`). Blocking: runs
    on the metrics thread, else it would hold a worker's clients or the parent's probes."""
    mpc, names = multiprocess_page()
    return mpc + merge_pages(pages, names, peaks).encode()


async def _fetch(session: ClientSession, url: str) -> str:
    async with session.get(url) as resp:
        resp.raise_for_status()
        return await resp.text()


async def _fetch_all(urls: dict[int, str], path: str, seconds: float) -> tuple[list[str], list[int]]:
    """Each worker's ``path``, fetched at once within ``seconds`` in all; returns (pages, missing)."""
    async with ClientSession(timeout=ClientTimeout(total=seconds)) as session:
        got = await asyncio.gather(*(_fetch(session, f"{u}{path}") for u in urls.values()), return_exceptions=True)
    pages = [p for p in got if isinstance(p, str)]
    missing = [i for i, p in zip(urls, got, strict=True) if not isinstance(p, str)]
    return pages, missing


def missing_page(considered: list[int], missing: list[int]) -> str:
    """Which serving workers' live gauges this page lacks, so they do not pass for zeros."""
    return _text([(MISSING, "gauge", "1: this worker serves, but its live gauges are missing from this page's sums "
                   "(its page did not come in time: stopped, hung or exiting).",
                   [(MISSING, (("worker", str(i)),), 1.0 if i in missing else 0.0) for i in sorted(considered)])])


async def render(sup: SupervisorView) -> tuple[bytes, str]:
    """The whole proxy's page; a worker whose page misses ``FETCH_TIMEOUT`` is shown in ``MISSING``."""
    urls = sup.worker_urls()
    pages, missing = await _fetch_all(urls, "/metrics/worker", FETCH_TIMEOUT)
    view = sup.ledger.view()
    peaks = {name: v["peak"] for name, v in view.items()}
    merged = await off_loop(files_and_live_page, pages, peaks)
    page = merged + supervisor_page(sup, len(urls), view).encode() + missing_page(list(urls), missing).encode()
    return page, CONTENT_TYPE_LATEST


async def render_in_worker(runtime: Path, ledger: SeatLedger, index: int) -> tuple[bytes, str]:
    """A worker's ``/metrics``: the whole proxy's page, siblings' pages awaited (``SIBLING_TIMEOUT``). Awaited, not
    fetched blocking: a stopped sibling froze every connection of the scraped worker."""

    pages = [generate_latest(REGISTRY).decode()]
    urls = _siblings(runtime, index)
    fetched, missing = await _fetch_all(urls, "/metrics/worker", SIBLING_TIMEOUT)
    pages += fetched
    peaks = {name: v["peak"] for name, v in ledger.view().items()}
    page = await off_loop(files_and_live_page, pages, peaks) + missing_page([index, *urls], missing).encode()
    return page, CONTENT_TYPE_LATEST


def whole_proxy_page(runtime: Path, ledger: SeatLedger, index: int) -> SharedRender[tuple[bytes, str]]:
    """What a worker's ``/metrics`` answers: :func:`render_in_worker`, shared by concurrent scrapes."""
    return SharedRender(functools.partial(render_in_worker, runtime, ledger, index))


def _siblings(runtime: Path, index: int) -> dict[int, str]:
    """The other serving workers' private metrics URLs, by index (their ``worker-N.json``)."""
    urls: dict[int, str] = {}
    for path in sorted(runtime.glob("worker-*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            other = int(path.stem.rpartition("-")[2])
            info = json.loads(path.read_text())
            if other != index and info.get("pid") != os.getpid():
                urls[other] = str(info["metricsUrl"])
    return urls


def supervisor_page(sup: SupervisorView, serving: int, view: dict[str, dict[str, int]]) -> str:
    """The parent's own figures: workers serving, restarts, and the seat ledger (proxy-wide seats)."""
    workers, restarts, hung, seats = ("gatekeeper_proxy_workers", "gatekeeper_proxy_worker_restarts",
                                      "gatekeeper_proxy_worker_hung_kills", "gatekeeper_flowcontrol_ledger_seats")
    return _text([
        (workers, "gauge", "Worker processes configured and serving.",
         [(workers, (("state", "configured"),), float(len(sup.slots))),
          (workers, (("state", "serving"),), float(serving))]),
        (restarts, "counter", "Workers restarted after they died.",
         [(f"{restarts}_total", (("worker", str(s.index)),), float(s.restarts)) for s in sup.slots]),
        (hung, "counter", "Workers killed because their /healthz stopped answering (proxy.workerHangSeconds).",
         [(f"{hung}_total", (("worker", str(s.index)),), float(s.hung_kills)) for s in sup.slots]),
        (seats, "gauge", "Seats in use and requests queued per level, all workers.",
         [(seats, (("priority_level", name), ("what", what)), float(v[what]))
          for name, v in sorted(view.items()) for what in ("seats", "waiting")]),
    ])


async def not_ready(sup: SupervisorView) -> str | None:
    """Ready (None) when every worker serves and answers its own ``/readyz``; else how many do."""
    urls = sup.worker_urls()
    if len(urls) < len(sup.slots):
        return f"{len(urls)} of {len(sup.slots)} workers serving"
    _, missing = await _fetch_all(urls, "/readyz", FETCH_TIMEOUT)
    return f"{len(urls) - len(missing)} of {len(sup.slots)} workers ready" if missing else None


async def start_parent_listener(sup: SupervisorView, address: str, port: int) -> tuple[web.AppRunner, int]:
    """The parent's listener: every server's ops endpoints (concurrent scrapes share one render), and ``/workers``."""

    async def workers(request: web.Request) -> web.Response:
        return web.json_response(sup.describe())

    app = web.Application()
    app.router.add_get("/workers", workers)
    add_ops_routes(app, functools.partial(not_ready, sup), SharedRender(functools.partial(render, sup)))
    return await serve_app(app, address, port)


async def serve_app(app: web.Application, address: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve a metrics ``app`` on ``address:port``; returns the runner and the port bound (``port`` 0 resolves)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, address, port)
    await site.start()
    bound = port
    with contextlib.suppress(Exception):
        bound = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    return runner, bound
