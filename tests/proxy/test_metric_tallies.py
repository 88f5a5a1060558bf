"""Per-request metrics go through tallies (gatekeeper.proxy.tally) and add up exactly, in one or many processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Histogram

from gatekeeper.proxy import metrics, tally
from gatekeeper.proxy.flowcontrol.edge import metrics as fc_metrics

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# On the bounds, between them, below the first and past the last: where bisect and observe() could disagree.
VALUES = [0.0, 0.005, 0.0050001, 0.01, 0.3, 1.0, 2.5, 59.99, 60.0, 61.0, 1e9, 0.049, 0.05, 0.0001]


def sample(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_the_flush_collector_runs_before_every_tallied_metric() -> None:
    order = list(REGISTRY._collector_to_names)  # collection order is registration order
    flush = next(i for i, c in enumerate(order) if isinstance(c, tally._Flush))
    tallied = (metrics.REQUESTS, metrics.REQUEST_DURATION, fc_metrics.DISPATCHED, fc_metrics.WAIT,
               fc_metrics.SEATS, fc_metrics.EXECUTION)
    assert all(flush < order.index(m) for m in tallied)


def test_n_responses_are_counted_exactly_with_the_buckets_observe_would_give() -> None:
    backend = "tally-exact"
    before_count = sample("gatekeeper_proxy_request_duration_seconds_count", {"verb": "get"})
    before_sum = sample("gatekeeper_proxy_request_duration_seconds_sum", {"verb": "get"})
    les = [*(str(float(b)) for b in BUCKETS), "+Inf"]
    before_buckets = {le: sample("gatekeeper_proxy_request_duration_seconds_bucket", {"verb": "get", "le": le})
                      for le in les}
    reference = Histogram("reference", "same buckets", buckets=BUCKETS, registry=CollectorRegistry())
    n = 0
    for _ in range(3):
        for v in VALUES:
            metrics.observe_response(backend, "get", "configmaps", 200, v)
            reference.observe(v)
            n += 1
    requests = sample("gatekeeper_proxy_requests_total",
                      {"backend": backend, "verb": "get", "resource": "configmaps", "code": "200"})
    assert requests == n
    assert sample("gatekeeper_proxy_request_duration_seconds_count", {"verb": "get"}) - before_count == n
    assert sample("gatekeeper_proxy_request_duration_seconds_sum", {"verb": "get"}) - before_sum == pytest.approx(
        sum(VALUES) * 3)
    ref = {s.labels["le"]: s.value for s in next(iter(reference.collect())).samples if s.name.endswith("_bucket")}
    for le, old in before_buckets.items():
        got = sample("gatekeeper_proxy_request_duration_seconds_bucket", {"verb": "get", "le": le}) - old
        assert got == ref[le], le


def test_a_resource_not_learned_yet_is_counted_under_its_name_once_learned() -> None:
    backend = "tally-learn"
    metrics.observe_response(backend, "get", "tallywidgets", 404, 0.001)
    metrics.observe_response(backend, "get", "tallywidgets", 200, 0.001)
    metrics.observe_response(backend, "get", "tallywidgets", 404, 0.001)
    base = {"backend": backend, "verb": "get"}
    assert sample("gatekeeper_proxy_requests_total", {**base, "resource": "<unknown>", "code": "404"}) == 1
    assert sample("gatekeeper_proxy_requests_total", {**base, "resource": "tallywidgets", "code": "404"}) == 1
    assert sample("gatekeeper_proxy_requests_total", {**base, "resource": "tallywidgets", "code": "200"}) == 1


def test_flow_control_pair_metrics_reach_the_page() -> None:
    m = fc_metrics.for_pair("tally-fs", "tally-pl")
    labels = {"flow_schema": "tally-fs", "priority_level": "tally-pl"}
    for _ in range(5):
        m.dispatched.inc()
        m.seats.observe(1)
        m.wait_executed.observe(0.0)
        m.exec_regular.observe(0.003)
    m.exec_watch.observe(2.0)
    assert sample("gatekeeper_flowcontrol_dispatched_requests_total", labels) == 5
    assert sample("gatekeeper_flowcontrol_work_estimated_seats_bucket", {**labels, "le": "1.0"}) == 5
    assert sample("gatekeeper_flowcontrol_request_wait_duration_seconds_bucket",
                  {**labels, "execute": "true", "le": "0.0"}) == 5
    assert sample("gatekeeper_flowcontrol_request_execution_seconds_count", {**labels, "type": "regular"}) == 5
    assert sample("gatekeeper_flowcontrol_request_execution_seconds_bucket",
                  {**labels, "type": "watch", "le": "2.0"}) == 1


async def test_updates_reach_prometheus_client_without_a_scrape_within_the_flush_interval() -> None:
    t = fc_metrics.for_pair("tally-timer", "tally-pl").dispatched
    before = t.child._value.get()
    t.inc()
    t.inc()
    assert t.child._value.get() == before  # pending, not yet handed over
    loop = asyncio.get_running_loop()
    deadline = loop.time() + tally.FLUSH_SECONDS + 5
    while t.child._value.get() != before + 2:
        assert loop.time() < deadline, "the timed flush never came"
        await asyncio.sleep(0.05)


WORKER = """
from prometheus_client import REGISTRY, generate_latest
from gatekeeper.proxy import metrics
for i in range({n}):
    metrics.observe_response("b1", "get", "pods", 200, 0.002)
if {scrape}:
    generate_latest(REGISTRY)  # the worker's /metrics/worker page, fetched by the parent before it reads the files
    import os; os._exit(0)     # no atexit flush: only the scrape can have moved the counts
"""


def python(code: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("scrape", [True, False], ids=["flushed-by-a-scrape", "flushed-at-exit"])
def test_tallies_of_two_worker_processes_add_up_in_the_multiprocess_page(tmp_path: Path, scrape: bool) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    python(WORKER.format(n=700, scrape=scrape), env)
    python(WORKER.format(n=300, scrape=scrape), env)
    page = python("from gatekeeper.proxy import metrics; print(metrics.render()[0].decode())", env)
    lines = dict(x.rsplit(" ", 1) for x in page.splitlines() if x and not x.startswith("#"))
    key = 'gatekeeper_proxy_requests_total{backend="b1",code="200",resource="pods",verb="get"}'
    assert float(lines[key]) == 1000
    assert float(lines['gatekeeper_proxy_request_duration_seconds_count{verb="get"}']) == 1000
    assert float(lines['gatekeeper_proxy_request_duration_seconds_bucket{le="0.005",verb="get"}']) == 1000


def test_a_metric_file_being_created_does_not_fail_the_scrape(tmp_path: Path) -> None:
    """A worker between creating its file and sizing it leaves an empty .db: the page still renders, whole."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    python(WORKER.format(n=5, scrape=False), env)
    (tmp_path / "counter_999999.db").touch()  # the moment between open() and truncate() in another worker
    page = python("from gatekeeper.proxy import metrics; print(metrics.render()[0].decode())", env)
    lines = dict(x.rsplit(" ", 1) for x in page.splitlines() if x and not x.startswith("#"))
    assert float(lines['gatekeeper_proxy_requests_total{backend="b1",code="200",resource="pods",verb="get"}']) == 5
    merged = python("from gatekeeper.proxy import worker_metrics as w; print(sorted(w.multiprocess_page()[1]))", env)
    assert "gatekeeper_proxy_requests" in merged
