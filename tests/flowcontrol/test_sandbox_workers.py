"""Flow control through ``gatekeeper proxy --workers 4`` against the real apiservers.

The seeds' policy allows 2 concurrent LISTs of Secrets; with 4 worker processes it
must still be 2 for the whole proxy (the seat ledger), checked inside the proxy
and against the apiservers' own APF gauges; a worker killed with SIGKILL is
replaced and the seats it held are freed for the others at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import storm_kit as kit

from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import WireH2

pytestmark = pytest.mark.sandbox

WORKERS = 4
SECRETS = 100
SIZE = 200 * 1024
CLIENTS = 20
LEVEL = "secrets-list"


@pytest.fixture(scope="module")
def storm4(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    ns = f"fc-workers-{uuid.uuid4().hex[:6]}"
    work = tmp_path_factory.mktemp("fc-workers")
    names = asyncio.run(kit.create_secrets(sandbox, ns, SECRETS, SIZE))
    applied = kit.kubectl(sandbox, "apply", "-f", "-", input=kit.storm_rbac_and_observer())
    assert applied.returncode == 0, applied.stderr
    # No read ahead: the kill test needs LISTs that hold their seats while their clients take nothing (with it, a
    # 20 MB LIST gives its seats back once the apiserver has sent it, which test_sandbox_slow_readers.py covers).
    flow = {"files": [str(kit.SEEDS)], "queueWaitSeconds": 60, "readAheadBytesPerConnection": 0}
    try:
        with kit.run_proxy(sandbox, work, flow, workers=WORKERS) as proxy:
            yield {"ns": ns, "names": set(names), "proxy": proxy, "dir": work}
    finally:
        kit.kubectl(sandbox, "delete", "namespace", ns, "--wait=false")


def workers_of(proxy: kit.ProxyProcess) -> list[dict]:
    with urllib.request.urlopen(f"{proxy.metrics_url}/workers", timeout=10) as r:
        return list(json.loads(r.read()))


def worker_metric(worker: dict, name: str, **labels: str) -> float:
    if not worker.get("metricsUrl"):
        return 0.0
    with urllib.request.urlopen(f"{worker['metricsUrl']}/metrics/worker", timeout=10) as r:
        return kit.metric_sum(r.read().decode(), name, **labels)


def ledger(proxy: kit.ProxyProcess, what: str) -> float:
    return kit.metric_sum(proxy.metrics(), "gatekeeper_flowcontrol_ledger_seats", priority_level=LEVEL, what=what)


def wait_for(cond, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_twenty_tenant_lists_through_four_workers_never_run_more_than_two_upstream(
    sandbox: SandboxState, storm4: dict
) -> None:
    proxy = storm4["proxy"]
    configs = [kit.storm_kubeconfig(sandbox, storm4["dir"], f"wk-{i}", proxy.url) for i in range(CLIENTS)]
    before = {w["index"]: worker_metric(w, "gatekeeper_flowcontrol_dispatched_requests_total", priority_level=LEVEL)
              for w in workers_of(proxy)}

    async def run() -> tuple[list, kit.ApiserverSampler]:
        sampler = kit.ApiserverSampler(sandbox, interval=0.1)
        sampling = asyncio.create_task(sampler.run())
        results = await asyncio.gather(*(kit.kubectl_list(sandbox, kc, storm4["ns"], limit_s=300) for kc in configs))
        sampler.stop()
        await sampling
        return results, sampler

    results, sampler = asyncio.run(run())
    for rc, names, _secs, err in results:
        assert rc == 0, err
        assert names == storm4["names"]
    served = {w["index"]: worker_metric(w, "gatekeeper_flowcontrol_dispatched_requests_total", priority_level=LEVEL)
              - before.get(w["index"], 0.0) for w in workers_of(proxy)}
    peak = kit.metric_sum(proxy.metrics(), "gatekeeper_flowcontrol_peak_executing_requests", priority_level=LEVEL)
    print(f"\n{CLIENTS} secret LISTs through {WORKERS} workers: dispatched per worker {served}; proxy-wide peak "
          f"{peak:.0f}; apiserver APF max total {sampler.max_executing_total:.0f} over {sampler.samples} samples")
    assert sum(1 for v in served.values() if v > 0) >= 2, "the LISTs must have been spread over several workers"
    assert 1 <= peak <= 2
    # the apiservers' own APF gauges saw the storm's LISTs, never more than 2 at once
    assert sampler.max_executing_total >= 1 and sampler.within_budget(2), sampler.totals


def _tenant_ctx(state: SandboxState, directory: Path, user: str) -> ssl.SSLContext:
    kit.storm_kubeconfig(state, directory, user, "https://127.0.0.1")  # issues the certificate fc-<user>
    certs = SandboxPKI(Path(state.certs_dir))
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    ctx.load_cert_chain(str(certs.crt(f"fc-{user}")), str(certs.key(f"fc-{user}")))
    return ctx


def _holding(proxy: kit.ProxyProcess) -> dict[int, float]:
    return {w["index"]: worker_metric(w, "gatekeeper_flowcontrol_current_executing_seats", priority_level=LEVEL)
            for w in workers_of(proxy)}


def _queued_in(proxy: kit.ProxyProcess) -> list[int]:
    return [w["index"] for w in workers_of(proxy)
            if worker_metric(w, "gatekeeper_flowcontrol_current_inqueue_requests", priority_level=LEVEL) > 0]


def test_a_killed_worker_is_replaced_and_its_seats_are_released(sandbox: SandboxState, storm4: dict) -> None:
    proxy = storm4["proxy"]
    path = f"/api/v1/namespaces/{storm4['ns']}/secrets"
    stalled: list[WireH2] = []
    waiter: WireH2 | None = None
    try:
        # Two LISTs whose clients never open their flow-control window: they hold both seats.
        for i in range(2):
            c = WireH2(proxy.url, _tenant_ctx(sandbox, storm4["dir"], f"wk-hold-{i}"))
            sid = c.request(path)
            assert c.read_until(lambda c=c, sid=sid: sid in c.status), "no response head for a held LIST"
            stalled.append(c)
        wait_for(lambda: ledger(proxy, "seats") == 2, what="both seats taken")
        holding = {i for i, v in _holding(proxy).items() if v > 0}
        # A third LIST queues; it must sit in a worker other than one we kill.
        for _attempt in range(12):
            waiter = WireH2(proxy.url, _tenant_ctx(sandbox, storm4["dir"], "wk-wait"))
            wsid = waiter.request(path)
            wait_for(lambda: bool(_queued_in(proxy)), what="the third LIST to queue")
            (queued_in,) = _queued_in(proxy)
            victims = sorted(holding - {queued_in})
            if victims:
                break
            waiter.close()
            wait_for(lambda: not _queued_in(proxy), what="the abandoned LIST to leave its queue")
        else:
            pytest.fail("could not place the waiting LIST away from the seat holders")
        assert waiter is not None
        victim = next(w for w in workers_of(proxy) if w["index"] == victims[0])
        assert waiter.status.get(wsid) is None, "the third LIST must wait while both seats are held"
        os.kill(victim["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        assert waiter.read_until(lambda: wsid in waiter.status, timeout=20), "the freed seat never reached the waiter"
        waited = time.monotonic() - t0
        assert waiter.status[wsid] == 200 and waited < 10, (waiter.status, waited)
        wait_for(lambda: any(w["index"] == victim["index"] and w["pid"] != victim["pid"] and w["metricsUrl"]
                             for w in workers_of(proxy)), what="the replacement worker")
        replaced = next(w for w in workers_of(proxy) if w["index"] == victim["index"])
        assert replaced["restarts"] == 1
        wait_for(lambda: urllib.request.urlopen(f"{proxy.metrics_url}/readyz", timeout=5).status == 200,
                 what="/readyz with every worker back")
        print(f"\nSIGKILL of worker {victim['index']} (pid {victim['pid']}): waiting LIST got its seat after "
              f"{waited:.2f}s; replacement pid {replaced['pid']}")
    finally:
        for c in stalled:
            c.close()
        if waiter is not None:
            waiter.close()
    wait_for(lambda: ledger(proxy, "seats") == 0 and ledger(proxy, "waiting") == 0, what="every seat back")
