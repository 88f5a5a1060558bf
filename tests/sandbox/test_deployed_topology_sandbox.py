"""``sandbox up --with-proxy --proxies 3``: the deployed topology, where the fleet owns the kubernetes Service.

The apiservers run with ``--endpoint-reconciler-type=none``; one proxy at a time (the writer Lease's holder)
writes the ``default/kubernetes`` EndpointSlices and Endpoints to the live proxies' advertised addresses. An
in-cluster caller (a ServiceAccount token, TLS verified for the Service's ClusterIP as client-go in a pod does)
resolved through the Service lands on a proxy, which counts it. The scheduler, controller manager and webhook call
through the proxies too. A SIGKILLed writer leaves the endpoints within the lease duration and another proxy takes
over; no tenant may write the endpoints.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from http.client import HTTPSConnection
from pathlib import Path
from typing import Any

import pytest
import yaml

from gatekeeper.certs.pki import PKI
from gatekeeper.sandbox import processes
from gatekeeper.sandbox.pki import KUBERNETES_SERVICE_IP, SandboxPKI, kubeconfig
from gatekeeper.sandbox.service_network import Target, kubernetes_service_targets
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import kubectl_binary, metric_sum, run_down
from gatekeeper.sandbox.with_proxy import node_address

pytestmark = pytest.mark.sandbox

PROXIES = 3
LEASE_SECONDS, RENEW_SECONDS = 15.0, 5.0
"""FleetSettings' defaults, which the sandbox's proxies run with."""


@pytest.fixture(scope="module")
def deployed(own_sandbox: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxState]:
    directory = tmp_path_factory.mktemp("deployed") / "sb"
    try:
        yield own_sandbox(directory, "--apiservers", "2", "--gpu-nodes", "0", "--with-scheduler", "--with-webhook",
                          "--with-proxy", "--proxies", str(PROXIES), "--timeout", "300")
    finally:
        run_down(directory)


def kubectl(state: SandboxState, *args: str, config: str | None = None, input: str | None = None) -> Any:
    return subprocess.run([kubectl_binary(state), "--kubeconfig", config or state.kubeconfig, *args],
                          capture_output=True, text=True, timeout=60, input=input)


def proxies(state: SandboxState) -> list[dict[str, Any]]:
    return list(state.extra["proxies"])


def metric(proxy: dict[str, Any], name: str, **labels: str) -> float:
    with urllib.request.urlopen(proxy["metricsUrl"], timeout=10) as r:
        return metric_sum(r.read().decode(), name, **labels)


def until(predicate: Any, limit: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < limit, f"{what}: not within {limit}s"
        time.sleep(0.25)
    return time.monotonic() - started


def expected(state: SandboxState, alive: list[dict[str, Any]]) -> list[tuple[str, str]]:
    index = {p["url"]: i for i, p in enumerate(proxies(state), 1)}
    return sorted((node_address(index[p["url"]]), p["url"]) for p in alive)


def published(state: SandboxState) -> list[tuple[str, str | None]]:
    return sorted((t.address, t.url) for t in kubernetes_service_targets(state))


def test_the_kubernetes_service_lists_exactly_the_proxies(deployed: SandboxState) -> None:
    until(lambda: published(deployed) == expected(deployed, proxies(deployed)), 4 * LEASE_SECONDS,
          "the three proxies in the kubernetes EndpointSlices")
    endpoints = json.loads(kubectl(deployed, "get", "endpoints", "kubernetes", "-n", "default", "-o", "json").stdout)
    assert endpoints["metadata"]["labels"]["endpointslice.kubernetes.io/skip-mirror"] == "true"
    listed = sorted(f"{a['ip']}:{p['port']}" for s in endpoints["subsets"] for a in s["addresses"] for p in s["ports"])
    assert listed == sorted(f"{a}:{u.rsplit(':', 1)[1]}" for a, u in expected(deployed, proxies(deployed)))
    assert sum(metric(p, "gatekeeper_fleet_endpoints_writer") for p in proxies(deployed)) == 1


def in_cluster_request(state: SandboxState, target: Target, token: str) -> tuple[int, dict[str, Any]]:
    """What a pod's client-go does: connect to the Service (here: where kube-proxy would send it), verify the
    certificate for the ClusterIP, present its ServiceAccount token."""
    assert target.host is not None
    ctx = ssl.create_default_context(cafile=str(SandboxPKI(Path(state.certs_dir)).ca))
    conn = HTTPSConnection(KUBERNETES_SERVICE_IP, 443, context=ctx, timeout=30)
    conn.sock = ctx.wrap_socket(socket.create_connection((target.host, target.port), timeout=30),
                                server_hostname=KUBERNETES_SERVICE_IP)
    body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    conn.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", body=body,
                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    answer = conn.getresponse()
    return answer.status, json.loads(answer.read() or b"{}")


def test_an_in_cluster_caller_reaches_a_proxy_and_not_an_apiserver(deployed: SandboxState) -> None:
    token = kubectl(deployed, "create", "token", "default", "-n", "default").stdout.strip()
    assert token
    by_url = {p["url"]: p for p in proxies(deployed)}
    targets = kubernetes_service_targets(deployed)
    assert targets and all(t.url in by_url and t.url not in deployed.apiserver_urls for t in targets)
    for target in targets:
        proxy = by_url[str(target.url)]
        before = metric(proxy, "gatekeeper_proxy_requests_total", resource="selfsubjectreviews")
        status, review = in_cluster_request(deployed, target, token)
        assert status == 201, review
        assert review["status"]["userInfo"]["username"] == "system:serviceaccount:default:default"
        assert metric(proxy, "gatekeeper_proxy_requests_total", resource="selfsubjectreviews") == before + 1


def kubeconfig_server(path: str) -> str:
    (cluster,) = yaml.safe_load(Path(path).read_text())["clusters"]
    return str(cluster["cluster"]["server"])


def test_the_control_plane_components_and_the_webhook_call_through_the_proxies(deployed: SandboxState) -> None:
    front = deployed.extra["cluster_url"]
    assert front in {p["url"] for p in proxies(deployed)}
    calling = {}
    for rec in deployed.processes:
        for arg in rec.cmd:
            if arg.startswith("--kubeconfig="):
                calling[rec.name] = kubeconfig_server(arg.split("=", 1)[1])
        if rec.name == "webhook":
            config = yaml.safe_load(Path(rec.cmd[rec.cmd.index("--config") + 1]).read_text())
            calling[rec.name] = kubeconfig_server(config["webhook"]["kubeconfig"])
    assert {"kube-scheduler", "kube-controller-manager", "webhook"} <= calling.keys()
    assert calling == dict.fromkeys(calling, front)


def tenant_kubeconfig(state: SandboxState, directory: Path) -> str:
    issued = PKI(state.certs_dir).issue_client("endpoints-tenant", user="tenant-a", groups=["tenants"])
    path = directory / "tenant.kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig(state.apiserver_urls[0], SandboxPKI(Path(state.certs_dir)).ca,
                                              issued.cert, issued.key)))
    return str(path)


def test_a_tenant_cannot_write_the_kubernetes_endpoints(deployed: SandboxState, tmp_path: Path) -> None:
    config = tenant_kubeconfig(deployed, tmp_path)
    hijack = json.dumps({  # a slice of the Service's own, sending in-cluster callers somewhere else
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": "kubernetes-tenant", "labels": {"kubernetes.io/service-name": "kubernetes"}},
        "endpoints": [{"addresses": ["192.0.2.200"]}], "ports": [{"name": "https", "port": 443}]})
    for args, body in ((("delete", "endpointslice", "kubernetes", "-n", "default"), None),
                       (("label", "endpointslice", "kubernetes", "-n", "default", "x=y"), None),
                       (("delete", "endpoints", "kubernetes", "-n", "default"), None),
                       (("create", "-n", "default", "-f", "-"), hijack)):
        p = kubectl(deployed, *args, config=config, input=body)
        assert p.returncode != 0 and "forbidden" in p.stderr.lower(), (args, p.stderr)
    assert published(deployed) == expected(deployed, proxies(deployed))


def test_a_killed_writer_leaves_within_the_lease_duration_and_another_takes_over(deployed: SandboxState) -> None:
    (writer,) = [p for p in proxies(deployed) if metric(p, "gatekeeper_fleet_endpoints_writer") == 1]
    survivors = [p for p in proxies(deployed) if p is not writer]
    os.killpg(writer["pid"], signal.SIGKILL)  # no goodbye: its Leases just stop being renewed
    # Its member Lease expires a lease duration after its last renewal (up to one interval before the kill); the
    # new writer notices at its next listing (one interval), as the fleet's shares do.
    took = until(lambda: published(deployed) == expected(deployed, survivors), LEASE_SECONDS + 2 * RENEW_SECONDS,
                 "the killed writer out of the kubernetes EndpointSlices")
    assert took >= LEASE_SECONDS - RENEW_SECONDS - 1, f"gone after {took:.1f}s: before its Lease could expire"
    assert not processes.is_alive(writer["pid"])
    print(f"killed writer gone from the endpoints {took:.1f}s after SIGKILL")
    until(lambda: sum(metric(p, "gatekeeper_fleet_endpoints_writer") for p in survivors) == 1, 2 * RENEW_SECONDS,
          "one survivor writing")


def test_a_draining_proxy_takes_itself_out_at_once(deployed: SandboxState) -> None:
    """SIGTERM (a static pod's update or removal): its advert comes off its Lease when the drain starts, so the
    writer drops it at its next listing instead of a lease duration later."""
    alive = [p for p in proxies(deployed) if processes.is_alive(p["pid"])]
    leaving = next((p for p in alive if p["url"] != deployed.extra["cluster_url"]), alive[-1])
    stays = [p for p in alive if p is not leaving]
    os.kill(leaving["pid"], signal.SIGTERM)
    took = until(lambda: published(deployed) == expected(deployed, stays), 2 * RENEW_SECONDS + 2,
                 "the draining proxy out of the kubernetes EndpointSlices")
    print(f"draining proxy gone from the endpoints {took:.1f}s after SIGTERM")
