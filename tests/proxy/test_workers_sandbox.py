"""``gatekeeper proxy --workers 2`` in front of the real apiservers: one port, one /metrics, clean drains."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess, WireH2

pytestmark = pytest.mark.sandbox

WORKERS = 2


def sample_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? ([0-9.e+-]+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def workers_of(p: ProxyProcess) -> list[dict]:
    return list(json.loads(get(f"{p.metrics_url}/workers")))


def per_worker(p: ProxyProcess, name: str, **labels: str) -> dict[int, float]:
    return {w["index"]: sample_sum(get(f"{w['metricsUrl']}/metrics/worker"), name, **labels)
            for w in workers_of(p) if w["metricsUrl"]}


def wait_for(cond, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def connect_to_every_worker(p: ProxyProcess, limit: int = 40) -> list[WireH2]:
    """Open h2 connections (one GET each) until every worker holds at least one (the kernel picks)."""
    conns: list[WireH2] = []
    while len(conns) < limit:
        c = WireH2(p.url, p.tls(cert=True))
        sid = c.request("/api/v1/namespaces/default")
        assert c.read_until(lambda c=c, sid=sid: sid in c.ended), "no answer"
        conns.append(c)
        if len(conns) >= WORKERS and all(v >= 1 for v in per_worker(
                p, "gatekeeper_proxy_client_connections", protocol="h2").values()):
            return conns
    pytest.fail(f"{limit} connections never reached all {WORKERS} workers")


@pytest.fixture
def proxy(sandbox: SandboxState, tmp_path: Path) -> Iterator[ProxyProcess]:
    p = ProxyProcess(sandbox, tmp_path, name="proxy-workers", workers=WORKERS)
    p.start()
    try:
        yield p
    finally:
        p.stop()


def test_metrics_add_up_across_workers(proxy: ProxyProcess) -> None:
    name, labels = "gatekeeper_proxy_requests_total", {"verb": "get", "resource": "namespaces"}
    before = sample_sum(proxy.metrics(), name, **labels)
    conns = connect_to_every_worker(proxy)
    try:
        watches = []
        for c in conns[:6]:
            sid = c.request("/api/v1/namespaces/default/configmaps?watch=1&allowWatchBookmarks=true")
            assert c.read_until(lambda c=c, sid=sid: sid in c.status)
            watches.append(sid)
        page = proxy.metrics()
        counted = sample_sum(page, name, **labels) - before
        by_worker = per_worker(proxy, name, **labels)
        assert counted == len(conns), f"{counted} GETs counted at the parent for {len(conns)} sent"
        assert sum(by_worker.values()) == counted and all(v >= 1 for v in by_worker.values()), by_worker
        # live gauges: the parent's figure is the sum of every worker's
        open_watches = sample_sum(page, "gatekeeper_proxy_backend_watches")
        assert open_watches == len(watches) == sum(per_worker(proxy, "gatekeeper_proxy_backend_watches").values())
        assert sample_sum(page, "gatekeeper_proxy_client_connections", protocol="h2") == len(conns)
        assert sample_sum(page, "gatekeeper_proxy_workers", state="serving") == WORKERS
        # the admin-only /metrics on the TLS port, answered by whichever worker, shows the whole proxy too
        for _ in range(3):  # new connections: the kernel picks the worker
            tls_page = httpx.get(f"{proxy.url}/metrics", verify=proxy.tls(cert=True)).text
            assert sample_sum(tls_page, name, **labels) - before == counted
        # the skew over the summed per-backend watches: 6 watches over 3 backends, whatever the split
        flights = [sample_sum(page, "gatekeeper_proxy_backend_in_flight", backend=f"apiserver-{i}") for i in (1, 2, 3)]
        skew = sample_sum(page, "gatekeeper_proxy_skew_in_flight_ratio")
        assert sum(flights) == len(watches)
        assert skew == pytest.approx((max(flights) + 1) / (min(flights) + 1))
        print(f"\n{len(conns)} connections over {WORKERS} workers: GETs per worker {by_worker}, "
              f"in flight per backend {flights}, skew {skew:.2f}")
    finally:
        for c in conns:
            c.close()


def test_sigterm_drains_every_worker_with_goaway_and_exits_0(proxy: ProxyProcess) -> None:
    conns = connect_to_every_worker(proxy)
    pids = [w["pid"] for w in workers_of(proxy)]
    assert proxy.proc is not None
    proxy.proc.send_signal(signal.SIGTERM)
    try:
        for c in conns:
            assert c.read_until(lambda c=c: c.goaway is not None, timeout=20), "a connection got no GOAWAY"
            assert c.goaway is not None and c.goaway[0] == 0  # NO_ERROR: graceful
        assert proxy.proc.wait(40) == 0
    finally:
        for c in conns:
            c.close()
    log = proxy.log.read_text()
    assert log.count("signal received: draining") == WORKERS, log[-2000:]
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_sighup_reaches_every_worker_and_none_dies(proxy: ProxyProcess) -> None:
    before = workers_of(proxy)
    assert proxy.proc is not None
    proxy.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: proxy.log.read_text().count("policy reloaded (SIGHUP)") == WORKERS, timeout=15,
             what="every worker to reload its flow-control policy")
    after = workers_of(proxy)
    assert [w["pid"] for w in after] == [w["pid"] for w in before] and all(w["restarts"] == 0 for w in after)
