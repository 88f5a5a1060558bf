"""A /metrics scrape reads every worker's multiprocess files off the event loop, one render at a time.

Merging the files is pure Python and took 90-220 ms per scrape with 4 workers' files (up to 900 ms with the
machine busy), all of it on the loop that also proxies requests (a worker), answers admission reviews (the
webhook) or probes and hands off connections (the proxy's parent). Here the file reader is slowed on purpose
(a blocking 3 s sleep) and a ``/healthz`` is sent while it runs, from another thread: the test server and the
client must not share the loop being measured. Blocking shows as a ``/healthz`` that waits for the scrape; the
bound (1.5 s against 3 s) fails only then, not on a slow machine.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from gatekeeper.proxy.flowcontrol.edge.ledger import SeatLedger
from gatekeeper.runtime import metrics, ops
from gatekeeper.runtime.multiproc import MULTIPROC_ENV

SLOW = 3.0
BOUND = 1.5
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no http_proxy from the environment


class SlowFiles:
    """``WrittenFilesCollector.collect`` slowed by a blocking sleep; counts the reads and says when one began."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = threading.Event()
        self.reads = 0
        real = metrics.WrittenFilesCollector.collect

        def collect(collector: metrics.WrittenFilesCollector) -> Any:
            self.reads += 1
            self.started.set()
            time.sleep(SLOW)
            return real(collector)

        monkeypatch.setattr(metrics.WrittenFilesCollector, "collect", collect)


@pytest.fixture
def slow_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SlowFiles:
    (tmp_path / "mp").mkdir()
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path / "mp"))
    return SlowFiles(monkeypatch)


def get(url: str) -> bytes:
    with _OPENER.open(url, timeout=60) as resp:
        return bytes(resp.read())


def healthz_during_scrapes(base: str, slow: SlowFiles, scrapers: int = 1) -> tuple[float, list[bytes]]:
    """In client threads: ``scrapers`` concurrent GET /metrics, and once the files are being read a GET
    /healthz; returns how long /healthz took and the pages."""
    with ThreadPoolExecutor(scrapers) as pool:
        scrapes = [pool.submit(get, f"{base}/metrics") for _ in range(scrapers)]
        assert slow.started.wait(30), "no scrape reached the file reader"
        time.sleep(0.2)  # every scraper's request has arrived
        began = time.monotonic()
        assert get(f"{base}/healthz") == b"ok"
        took = time.monotonic() - began
        return took, [s.result(60) for s in scrapes]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[web.Application], Any]]:
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_the_webhooks_healthz_answers_while_a_slow_scrape_reads_the_files(slow_files: SlowFiles,
                                                                               serve: Any) -> None:
    """The webhook's /metrics (``gatekeeper.runtime.ops``, default page), on the port that answers admission reviews;
    three scrapes at once read the files once."""
    app = web.Application()
    ops.add_ops_routes(app, lambda: None)
    base = await serve(app)
    took, pages = await asyncio.to_thread(healthz_during_scrapes, base, slow_files, 3)
    assert took < BOUND, f"/healthz waited {took:.2f} s for the scrape: the event loop read the files"
    assert slow_files.reads == 1, "concurrent scrapes each read every worker's files"
    assert len(set(pages)) == 1


async def test_a_proxy_workers_healthz_answers_while_its_whole_proxy_page_reads_the_files(
        slow_files: SlowFiles, serve: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's private listener (``proxy.process.metrics_app``) with the page ``--workers N`` installs."""
    from gatekeeper.proxy import metrics as proxy_metrics
    from gatekeeper.proxy.process import metrics_app
    from gatekeeper.proxy.worker_metrics import whole_proxy_page

    ledger = SeatLedger.create(tmp_path / "ledger", 2)
    monkeypatch.setattr(proxy_metrics, "render_page", whole_proxy_page(tmp_path, ledger, 0))
    base = await serve(metrics_app(lambda: True))
    took, pages = await asyncio.to_thread(healthz_during_scrapes, base, slow_files, 3)
    assert took < BOUND, f"/healthz waited {took:.2f} s for the scrape: the event loop read the files"
    assert slow_files.reads == 1, "concurrent scrapes each read every worker's files"
    assert b'gatekeeper_proxy_worker_page_missing{worker="0"} 0.0' in pages[0]


async def test_the_proxy_parents_healthz_answers_while_a_slow_scrape_reads_the_files(
        slow_files: SlowFiles, tmp_path: Path) -> None:
    """The parent's listener (``listener.metricsPort``): its loop also supervises and hands off connections."""
    from gatekeeper.proxy.worker_metrics import start_parent_listener

    sup: Any = SimpleNamespace(worker_urls=lambda: {}, ledger=SeatLedger.create(tmp_path / "ledger", 2), slots=[])
    runner, port = await start_parent_listener(sup, "127.0.0.1", 0)
    try:
        took, pages = await asyncio.to_thread(healthz_during_scrapes, f"http://127.0.0.1:{port}", slow_files, 3)
    finally:
        await runner.cleanup()
    assert took < BOUND, f"/healthz waited {took:.2f} s for the scrape: the event loop read the files"
    assert slow_files.reads == 1, "concurrent scrapes each read every worker's files"
    assert b"gatekeeper_proxy_workers" in pages[0]


async def test_a_scraper_that_goes_away_does_not_cancel_the_render_the_others_wait_for() -> None:
    release = asyncio.Event()

    async def render() -> str:
        await release.wait()
        return "page"

    shared = ops.SharedRender(render)
    first = asyncio.ensure_future(shared())
    second = asyncio.ensure_future(shared())
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.sleep(0)
    release.set()
    assert await second == "page" and shared.renders == 1
    assert await shared() == "page" and shared.renders == 2  # a scrape after the render renders afresh
