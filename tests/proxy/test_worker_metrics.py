"""Merging the workers' live metric pages into one, rendering it in a worker, and how many workers a config asks
for."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import ClientSession, web

from gatekeeper.proxy import command, process
from gatekeeper.proxy.flowcontrol.edge.ledger import SeatLedger
from gatekeeper.proxy.settings import BackendSettings, ProxySettings
from gatekeeper.proxy.worker_metrics import (
    MISSING,
    SKEW_INPUT,
    merge_pages,
    render_in_worker,
    serve_app,
    start_parent_listener,
)


def page(in_flight: dict[str, float], rate: dict[str, float], up: float, peak: float, limit: float) -> str:
    lines = ["# HELP gatekeeper_proxy_backend_in_flight x", "# TYPE gatekeeper_proxy_backend_in_flight gauge"]
    lines += [f'gatekeeper_proxy_backend_in_flight{{backend="{b}"}} {v}' for b, v in in_flight.items()]
    lines += ["# HELP gatekeeper_proxy_backend_up x", "# TYPE gatekeeper_proxy_backend_up gauge"]
    lines += [f'gatekeeper_proxy_backend_up{{backend="{b}"}} {up}' for b in in_flight]
    lines += ["# HELP gatekeeper_proxy_skew_in_flight_ratio x", "# TYPE gatekeeper_proxy_skew_in_flight_ratio gauge",
              "gatekeeper_proxy_skew_in_flight_ratio 9.0"]
    lines += ["# HELP gatekeeper_flowcontrol_peak_executing_requests x",
              "# TYPE gatekeeper_flowcontrol_peak_executing_requests gauge",
              f'gatekeeper_flowcontrol_peak_executing_requests{{priority_level="secrets-list"}} {peak}',
              f'gatekeeper_flowcontrol_peak_executing_requests{{priority_level="exempt"}} {peak}']
    lines += ["# HELP gatekeeper_flowcontrol_nominal_limit_seats x",
              "# TYPE gatekeeper_flowcontrol_nominal_limit_seats gauge",
              f'gatekeeper_flowcontrol_nominal_limit_seats{{priority_level="secrets-list"}} {limit}']
    lines += [f"# HELP {SKEW_INPUT} x", f"# TYPE {SKEW_INPUT} gauge"]
    lines += [f'{SKEW_INPUT}{{backend="{b}",eligible="1",kind="in_flight"}} {v}' for b, v in in_flight.items()]
    lines += [f'{SKEW_INPUT}{{backend="{b}",eligible="1",kind="rate"}} {v}' for b, v in rate.items()]
    lines += ["# HELP gatekeeper_proxy_requests_total x", "# TYPE gatekeeper_proxy_requests_total counter",
              'gatekeeper_proxy_requests_total{backend="a"} 5.0']
    return "\n".join(lines) + "\n"


def value(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} missing from\n{text}")


def test_live_gauges_sum_skew_is_recomputed_and_flags_take_the_highest():
    one = page({"a": 3, "b": 0}, {"a": 10, "b": 0}, up=1, peak=2, limit=2)
    two = page({"a": 0, "b": 1}, {"a": 0, "b": 6}, up=1, peak=1, limit=2)
    merged = merge_pages([one, two], skip={"gatekeeper_proxy_requests"}, peaks={"secrets-list": 2})
    assert value(merged, 'gatekeeper_proxy_backend_in_flight{backend="a"}') == 3
    assert value(merged, 'gatekeeper_proxy_backend_in_flight{backend="b"}') == 1
    assert value(merged, 'gatekeeper_proxy_backend_up{backend="a"}') == 1  # not 2
    assert value(merged, 'gatekeeper_flowcontrol_nominal_limit_seats{priority_level="secrets-list"}') == 2
    # proxy-wide peak from the ledger, not 2 + 1; a level outside the ledger keeps the highest worker value
    assert value(merged, 'gatekeeper_flowcontrol_peak_executing_requests{priority_level="secrets-list"}') == 2
    assert value(merged, 'gatekeeper_flowcontrol_peak_executing_requests{priority_level="exempt"}') == 2
    # (max+1)/(min+1) over the summed per-backend in-flight: (3+1)/(1+1), not a sum of per-worker ratios
    assert value(merged, "gatekeeper_proxy_skew_in_flight_ratio") == pytest.approx(2.0)
    assert SKEW_INPUT not in merged
    assert "gatekeeper_proxy_requests_total" not in merged  # counters come from the multiprocess files


def test_label_values_are_escaped_back():
    text = ('# HELP m x\n# TYPE m gauge\nm{backend="we\\"ird\\\\name"} 1.0\n')
    merged = merge_pages([text, text], skip=set(), peaks={})
    assert 'm{backend="we\\"ird\\\\name"} 2.0' in merged


def test_worker_count_flag_then_config_then_cores(monkeypatch):
    settings = ProxySettings(backends=[BackendSettings(url="https://127.0.0.1:1")])
    monkeypatch.setattr(command, "usable_cores", lambda: 16)
    assert command.worker_count(settings, 3) == 3
    assert command.worker_count(replace(settings, workers=5), None) == 5
    assert command.worker_count(settings, None) == 8  # capped by maxWorkers
    assert command.worker_count(replace(settings, max_workers=2), 0) == 2
    with pytest.raises(ValueError, match="workers"):
        replace(settings, workers=-1).validate()


def test_worker_settings_report_the_parents_port_and_keep_metrics_private():
    settings = ProxySettings(backends=[BackendSettings(url="https://127.0.0.1:1")])
    w = process.worker_settings(settings, 4443)
    assert (w.listener.port, w.listener.metrics_port) == (4443, 0)
    assert w.listener.metrics_address == "127.0.0.1"


async def test_a_worker_rendering_the_whole_page_serves_on_while_a_sibling_does_not_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's /metrics fetched its siblings' pages with a blocking call, one after the other, 2 s each: a
    stopped sibling froze every client of the scraped worker for 2 s (a /healthz sent 0.2 s into a scrape took
    1.86 s, 3 workers, one SIGSTOPped), and that sibling's gauges were left out of the sums unsaid."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "mp"))
    (tmp_path / "mp").mkdir()
    stopped = socket.create_server(("127.0.0.1", 0))  # the kernel accepts, nobody answers: a SIGSTOPped worker

    async def worker_page(request: web.Request) -> web.Response:
        return web.Response(text="# HELP gatekeeper_proxy_backend_watches x\n"
                                 "# TYPE gatekeeper_proxy_backend_watches gauge\n"
                                 'gatekeeper_proxy_backend_watches{backend="a"} 3.0\n')

    app = web.Application()
    app.router.add_get("/metrics/worker", worker_page)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    answering = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    for i, port in ((1, stopped.getsockname()[1]), (2, answering)):
        (tmp_path / f"worker-{i}.json").write_text(json.dumps({"pid": 10_000 + i,
                                                               "metricsUrl": f"http://127.0.0.1:{port}"}))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticking = asyncio.get_running_loop().create_task(ticker())
    try:
        body, _ = await render_in_worker(tmp_path, SeatLedger.create(tmp_path / "ledger", 3), 0)
        assert ticks > 0, "the event loop stood still while the page waited for the stopped sibling"
    finally:
        ticking.cancel()
        stopped.close()
        await runner.cleanup()
    page = body.decode()
    assert value(page, 'gatekeeper_proxy_backend_watches{backend="a"}') == 3.0  # the answering sibling's
    assert value(page, f'{MISSING}{{worker="1"}}') == 1.0
    assert value(page, f'{MISSING}{{worker="0"}}') == value(page, f'{MISSING}{{worker="2"}}') == 0.0


async def test_the_parents_readyz_says_how_many_workers_serve_and_answers_ok_once_all_are_ready(tmp_path: Path):
    async def readyz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/readyz", readyz)
    worker, wport = await serve_app(app, "127.0.0.1", 0)
    urls: dict[int, str] = {}
    sup: Any = SimpleNamespace(worker_urls=lambda: urls, slots=[object()],
                               ledger=SeatLedger.create(tmp_path / "ledger", 2), describe=lambda: [])
    runner, port = await start_parent_listener(sup, "127.0.0.1", 0)
    try:
        async with ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/readyz") as resp:
                assert (resp.status, await resp.text()) == (503, "0 of 1 workers serving")
            urls[0] = f"http://127.0.0.1:{wport}"
            async with session.get(f"http://127.0.0.1:{port}/readyz") as resp:
                assert (resp.status, await resp.text()) == (200, "ok")
            async with session.get(f"http://127.0.0.1:{port}/healthz") as resp:
                assert (resp.status, await resp.text()) == (200, "ok")
    finally:
        await runner.cleanup()
        await worker.cleanup()
