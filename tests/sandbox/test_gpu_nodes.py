"""KWOK GPU nodes: extended-resource pods and DRA claims are really scheduled and run."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import Kubectl

pytestmark = pytest.mark.sandbox

OFF = {"gatekeeper.dev/gpu-mode": "off"}
"""Keeps the webhook add-on (if running) from rewriting these pods: they test the sandbox itself."""


def wait_json(kubectl: Kubectl, args: list[str], ready: Callable[[Any], bool], timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        p = kubectl("get", *args, "-o", "json")
        if p.returncode == 0:
            last = json.loads(p.stdout)
            if ready(last):
                return last
        time.sleep(0.5)
    pytest.fail(f"`kubectl get {' '.join(args)}` not ready after {timeout}s; last seen:\n"
                f"{json.dumps(last, indent=1)[:3000]}")


def running(pod: Any) -> bool:
    return bool(pod["spec"].get("nodeName")) and pod["status"].get("phase") == "Running"


def test_gpu_nodes_are_ready_with_gpu_capacity_and_one_resource_slice_each(
    sandbox: SandboxState, kubectl: Kubectl,
) -> None:
    names = sandbox.extra["gpu_nodes"]
    assert len(names) == 2
    nodes = json.loads(kubectl("get", "nodes", "-o", "json", check=True).stdout)["items"]
    by_name = {n["metadata"]["name"]: n for n in nodes}
    for name in names:
        node = by_name[name]
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
        assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
    slices = json.loads(kubectl("get", "resourceslices", "-o", "json", check=True).stdout)["items"]
    per_node = {s["spec"]["nodeName"]: s for s in slices if s["spec"]["driver"] == "gpu.nvidia.com"}
    assert sorted(per_node) == sorted(names)
    assert all(len(s["spec"]["devices"]) == 8 for s in per_node.values())


def test_node_leases_are_renewed_by_kwok(sandbox: SandboxState, kubectl: Kubectl) -> None:
    name = sandbox.extra["gpu_nodes"][0]
    p = kubectl("get", "lease", name, "-n", "kube-node-lease", "-o", "json", check=True)
    lease = json.loads(p.stdout)
    first = lease["spec"]["renewTime"]
    later = wait_json(kubectl, ["lease", name, "-n", "kube-node-lease"],
                      lambda lease: lease["spec"]["renewTime"] != first, timeout=60)
    assert later["spec"]["renewTime"] > first


def test_pod_requesting_one_gpu_is_bound_to_a_fake_node_and_runs(
    sandbox: SandboxState, kubectl: Kubectl, namespace: str,
) -> None:
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "one-gpu", "namespace": namespace, "annotations": OFF},
        "spec": {"containers": [{"name": "cuda", "image": "nvcr.io/nvidia/cuda:12.4.0-base-ubuntu22.04",
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    }
    kubectl("create", "-f", "-", input=json.dumps(pod), check=True)
    got = wait_json(kubectl, ["pod", "one-gpu", "-n", namespace], running)
    assert got["spec"]["nodeName"] in sandbox.extra["gpu_nodes"]
    assert got["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}


def test_pod_with_a_claim_template_gets_an_allocated_claim_and_is_bound(
    sandbox: SandboxState, kubectl: Kubectl, namespace: str,
) -> None:
    template = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "two-gpus-one-root", "namespace": namespace},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 2}}],
            "constraints": [{"requests": ["gpus"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}],
        }}},
    }
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "dra", "namespace": namespace, "annotations": OFF},
        "spec": {
            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "two-gpus-one-root"}],
            "containers": [{"name": "cuda", "image": "nvcr.io/nvidia/cuda:12.4.0-base-ubuntu22.04",
                            "resources": {"claims": [{"name": "gpus"}]}}],
        },
    }
    objects = {"apiVersion": "v1", "kind": "List", "items": [template, pod]}
    kubectl("create", "-f", "-", input=json.dumps(objects), check=True)
    got = wait_json(kubectl, ["pod", "dra", "-n", namespace], running)
    node = got["spec"]["nodeName"]
    assert node in sandbox.extra["gpu_nodes"]
    [status] = got["status"]["resourceClaimStatuses"]
    claim = json.loads(kubectl("get", "resourceclaim", status["resourceClaimName"], "-n", namespace,
                               "-o", "json", check=True).stdout)
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 2
    assert {r["driver"] for r in results} == {"gpu.nvidia.com"}
    assert {r["pool"] for r in results} == {node}
    assert any(r.get("uid") == got["metadata"]["uid"] for r in claim["status"]["reservedFor"])
    # The matchAttribute constraint held: both devices sit on one PCIe root of that node's slice.
    slices = json.loads(kubectl("get", "resourceslices", "-o", "json", check=True).stdout)["items"]
    [node_slice] = [s for s in slices if s["spec"]["nodeName"] == node]
    roots = {d["name"]: d["attributes"]["resource.kubernetes.io/pcieRoot"]["string"]
             for d in node_slice["spec"]["devices"]}
    assert len({roots[r["device"]] for r in results}) == 1


def test_kwok_runs_with_its_default_stages() -> None:
    import yaml

    from gatekeeper.sandbox.build import installed

    stages = installed().kwok_stages
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(stages.read_text()) if d}
    assert {"node-initialize", "node-heartbeat-with-lease", "pod-ready", "pod-delete"} <= names
