"""The seeds' policy in front of 3 real apiservers: a LIST-secrets storm through a private gatekeeper proxy.

Fixtures: 200 Secrets of 200 KiB (type helm.sh/release.v1, which the sandbox
webhook allows up to 1.5 MiB) in a namespace of our own; storm users with
client certificates from the sandbox CA (group gatekeeper:storm, RBAC to list
Secrets); and, inside the apiservers, a FlowSchema that only *observes* the
storm's LISTs so ``apiserver_flowcontrol_current_executing_requests`` counts
exactly them per apiserver. The proxy runs as its own process with
``deploy/examples/flowcontrol-seeds.yaml``.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import storm_kit as kit

from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox

SECRETS = 200
SIZE = 200 * 1024
CLIENTS = 20


@pytest.fixture(scope="module")
def storm(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    ns = f"fc-storm-{uuid.uuid4().hex[:6]}"
    work = tmp_path_factory.mktemp("fc-storm")
    names = asyncio.run(kit.create_secrets(sandbox, ns, SECRETS, SIZE))
    applied = kit.kubectl(sandbox, "apply", "-f", "-", input=kit.storm_rbac_and_observer())
    assert applied.returncode == 0, applied.stderr
    kit.kubectl(sandbox, "create", "serviceaccount", "default", "-n", ns)  # in case no controller made it yet
    try:
        with kit.run_proxy(sandbox, work, {"files": [str(kit.SEEDS)]}) as proxy:
            yield {"ns": ns, "names": set(names), "proxy": proxy, "dir": work}
    finally:
        kit.kubectl(sandbox, "delete", "namespace", ns, "--wait=false")
        kit.kubectl(sandbox, "delete", "-f", "-", "--ignore-not-found", input=kit.storm_rbac_and_observer())


def proxy_metric(proxy: kit.ProxyProcess, name: str, **labels: str) -> float:
    return kit.metric_sum(proxy.metrics(), name, **labels)


async def apiserver_secret_lists(state: SandboxState) -> float:
    texts = await kit.apiserver_metrics(state)
    return sum(kit.metric_sum(t, "apiserver_request_total", verb="LIST", resource="secrets") for t in texts)


async def other_traffic(state: SandboxState, storm: dict, stop: asyncio.Event) -> dict[str, list[float]]:
    """GET a ConfigMap (httpx, h2, storm-other's certificate) and create pods (kubectl) during the storm."""
    kc = kit.storm_kubeconfig(state, storm["dir"], "storm-other", storm["proxy"].url)
    certs = kit.SandboxPKI(Path(state.certs_dir))
    ns = storm["ns"]
    created = kit.kubectl(state, "create", "configmap", "probe", "-n", ns, "--from-literal=a=b")
    assert created.returncode == 0, created.stderr
    out: dict[str, list[float]] = {"get_configmap": [], "get_configmap_done": [], "create_pod": [], "reconnects": []}
    import ssl

    ctx = ssl.create_default_context(cafile=str(certs.ca))
    ctx.load_cert_chain(str(certs.crt("fc-storm-other")), str(certs.key("fc-storm-other")))
    async with httpx.AsyncClient(base_url=storm["proxy"].url, verify=ctx, http2=True, timeout=60) as c:
        i = 0
        while not stop.is_set() and i < 40:
            t0 = time.monotonic()
            try:
                r = await c.get(f"/api/v1/namespaces/{ns}/configmaps/probe")
            except httpx.TransportError:
                # httpx drops a connection idle for 5 s (a slow `kubectl create` in between) and opens another,
                # whose TLS handshake can take more than the proxy's 10 s on 2 cores under the storm: the proxy
                # cuts it. client-go sends a GET again after such a connection error, and so does this client.
                out["reconnects"].append(time.monotonic() - t0)
                r = await c.get(f"/api/v1/namespaces/{ns}/configmaps/probe")
            assert r.status_code == 200, r.text
            out["get_configmap"].append(time.monotonic() - t0)
            out["get_configmap_done"].append(time.monotonic())
            if i % 5 == 0:
                pod = (
                    f'{{"apiVersion":"v1","kind":"Pod","metadata":{{"name":"probe-{i}"}},"spec":{{'
                    f'"containers":[{{"name":"c","image":"registry.k8s.io/pause:3.10"}}]}}}}'
                )
                t0 = time.monotonic()
                p = await asyncio.to_thread(
                    kit.kubectl, state, "create", "-n", ns, "-f", "-", kubeconfig_path=str(kc), input=pod
                )
                assert p.returncode == 0, p.stderr
                out["create_pod"].append(time.monotonic() - t0)
            i += 1
            await asyncio.sleep(0.3)
    return out


def test_storm_of_secret_lists_never_runs_more_than_two_upstream(sandbox: SandboxState, storm: dict) -> None:
    proxy = storm["proxy"]
    configs = [kit.storm_kubeconfig(sandbox, storm["dir"], f"storm-{i}", proxy.url) for i in range(CLIENTS)]

    storm_span: list[float] = []

    async def run() -> tuple[list, kit.ApiserverSampler, dict]:
        sampler = kit.ApiserverSampler(sandbox, interval=0.2)
        sampling = asyncio.create_task(sampler.run())
        stop = asyncio.Event()
        others = asyncio.create_task(other_traffic(sandbox, storm, stop))
        storm_span.append(time.monotonic())
        results = await asyncio.gather(*(kit.kubectl_list(sandbox, kc, storm["ns"], limit_s=600) for kc in configs))
        storm_span.append(time.monotonic())
        stop.set()
        sampler.stop()
        await sampling
        return results, sampler, await others

    rejected_before = proxy_metric(proxy, "gatekeeper_flowcontrol_rejected_requests_total", flow_schema="secrets-list")
    results, sampler, others = asyncio.run(run())
    for rc, names, _secs, err in results:
        assert rc == 0, err
        assert names == storm["names"], f"incomplete list: {len(names)} of {len(storm['names'])}"
    peak_proxy = proxy_metric(proxy, "gatekeeper_flowcontrol_peak_executing_requests", priority_level="secrets-list")
    rejected = (
        proxy_metric(proxy, "gatekeeper_flowcontrol_rejected_requests_total", flow_schema="secrets-list")
        - rejected_before
    )
    print(
        f"\nstorm: {CLIENTS} kubectl clients x {SECRETS} Secrets x {SIZE // 1024} KiB; "
        f"client seconds p50={statistics.median(r[2] for r in results):.1f} "
        f"max={max(r[2] for r in results):.1f}; "
        f"429s retried by kubectl: {rejected:.0f}"
    )
    print(
        f"storm: peak secret LISTs upstream (proxy) = {peak_proxy:.0f}; "
        f"apiserver APF samples={sampler.samples} "
        f"max per apiserver={sampler.max_executing_per_backend} max total={sampler.max_executing_total:.0f}"
    )
    for what, lat in others.items():
        if lat and not what.endswith("_done"):
            print(
                f"other traffic {what}: n={len(lat)} p50={statistics.median(lat) * 1000:.0f} ms "
                f"max={max(lat) * 1000:.0f} ms"
            )
    assert 1 <= peak_proxy <= 2
    assert sampler.within_budget(2), f"the apiservers ran more than 2 of the storm's LISTs: {sampler.totals}"
    # Other traffic keeps flowing through the storm: small GETs complete in every third of it, none waits
    # anywhere near the storm's length. Not an absolute latency bound: on 2 cores the 20 kubectl processes and
    # the apiservers' 40 MB LISTs hold the load average at 12-16, and a GET's worst case moved between 6 and
    # 14 s from run to run.
    start, end = storm_span
    thirds = [start + (end - start) * k / 3 for k in range(4)]
    done = others["get_configmap_done"]
    gaps = [(a - start, b - start) for a, b in itertools.pairwise(thirds)
            if not any(a <= t < b for t in done)]
    assert not gaps, f"no GET completed between {gaps} s of a {end - start:.0f} s storm: other traffic starved"
    assert others["get_configmap"] and max(others["get_configmap"]) < 30.0
    assert len(others["reconnects"]) <= 2, f"other traffic lost its connection {len(others['reconnects'])} times"
    assert others["create_pod"] and max(others["create_pod"]) < 30.0


def test_identical_queued_lists_are_served_by_fewer_upstream_calls(sandbox: SandboxState, storm: dict) -> None:
    proxy = storm["proxy"]
    kc = kit.storm_kubeconfig(sandbox, storm["dir"], "storm-same", proxy.url)
    n = 10

    async def run() -> tuple[list, float, float]:
        before = await apiserver_secret_lists(sandbox)
        results = await asyncio.gather(*(kit.kubectl_list(sandbox, kc, storm["ns"]) for _ in range(n)))
        return results, before, await apiserver_secret_lists(sandbox)

    labels = {"flow_schema": "secrets-list", "priority_level": "secrets-list"}
    dispatched0 = proxy_metric(proxy, "gatekeeper_flowcontrol_dispatched_requests_total", **labels)
    coalesced0 = proxy_metric(proxy, "gatekeeper_flowcontrol_coalesced_requests_total", **labels)
    rejected0 = proxy_metric(proxy, "gatekeeper_flowcontrol_rejected_requests_total", **labels)
    results, before, after = asyncio.run(run())
    for rc, names, _secs, err in results:
        assert rc == 0, err
        assert names == storm["names"]
    dispatched = proxy_metric(proxy, "gatekeeper_flowcontrol_dispatched_requests_total", **labels) - dispatched0
    coalesced = proxy_metric(proxy, "gatekeeper_flowcontrol_coalesced_requests_total", **labels) - coalesced0
    rejected = proxy_metric(proxy, "gatekeeper_flowcontrol_rejected_requests_total", **labels) - rejected0
    upstream = after - before
    client_requests = dispatched + coalesced + rejected
    print(
        f"\ncoalescing: {n} identical kubectl LISTs -> {client_requests:.0f} page requests at the proxy, "
        f"{dispatched:.0f} sent upstream, {coalesced:.0f} coalesced, {rejected:.0f} answered 429; "
        f"apiservers counted {upstream:.0f} secret LISTs"
    )
    assert coalesced > 0
    assert dispatched < client_requests
    # the apiservers saw no more LISTs than the proxy dispatched (allowing for a controller's own LIST)
    assert dispatched <= upstream <= dispatched + 2
