"""GPU sharing and claims that schedule, against the real kube-scheduler.

A module sandbox of its own (1 apiserver, 2 KWOK nodes x 8 H100 80 GiB on two
PCIe roots, scheduler + controller manager, the webhook) with its GPUs published
as the NVIDIA DRA driver does with ``--consumable-shares=memory``
(``sandbox up --gpu-sharing memory``). Each test frees what it took (namespace
deleted, claims gone) so the next one starts with all 16 GPUs.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_webhook_sandbox import wait_for as webhook_wait_for

from gatekeeper.sandbox.state import SandboxState
from gatekeeper.webhook.gpu.sizing import parse_quantity_bytes

pytestmark = pytest.mark.sandbox

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024**3


def _load_packing() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_packing", ROOT / "loadtest" / "gpu_packing.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


packing = _load_packing()


@pytest.fixture(scope="module")
def sharing_sandbox(tmp_path_factory: pytest.TempPathFactory, own_sandbox: Any) -> Iterator[SandboxState]:
    from gatekeeper.sandbox.testing import webhook_sandbox

    config = ("webhook:\n  gpu:\n    namespaceGpuMemory: {shared-default: 6Gi, enforced: 4Gi}\n"
              "    namespaceModes: {enforced: shared}\n    enforcedNamespaces: [enforced]\n")
    with webhook_sandbox(tmp_path_factory.mktemp("gpu-sharing"), config, own_sandbox, "--apiservers", "1",
                         "--gpu-nodes", "2", "--gpus-per-node", "8", "--with-scheduler",
                         "--gpu-sharing", "memory") as state:
        yield state


@pytest.fixture
def cluster(sharing_sandbox: SandboxState) -> Any:
    return packing.Cluster(sharing_sandbox)


def scratch_namespace(cluster: Any, prefix: str) -> Iterator[str]:
    """A fresh namespace (its default ServiceAccount ready) for one test; gone, claims included, after it."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    cluster.run("create", "namespace", name)
    wait_for("default ServiceAccount",
             lambda: cluster.run("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0)
    yield name
    cluster.run("delete", "namespace", name, "--wait=false", check=False)
    packing.wait_claims_gone(cluster, name)


@pytest.fixture
def ns(cluster: Any) -> Iterator[str]:
    yield from scratch_namespace(cluster, "g")


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 120) -> Any:
    """test_webhook_sandbox's poll, with the longer default scheduling and claim allocation need here."""
    return webhook_wait_for(what, fn, timeout)


def gpu_pod(name: str, ns: str, gpus: int, *, mode: str = "dra", memory: str = "", node: str = "") -> str:
    ann = {"gatekeeper.dev/gpu-mode": mode}
    if memory:
        ann["gatekeeper.dev/gpu-memory"] = memory
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return json.dumps({"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": name, "namespace": ns, "annotations": ann}, "spec": spec})


def allocated_claim(cluster: Any, ns: str, pod: str) -> dict[str, Any] | None:
    p = cluster.get("pod", pod, "-n", ns)
    for st in p.get("status", {}).get("resourceClaimStatuses") or []:
        if st.get("resourceClaimName"):
            c = cluster.get("resourceclaim", st["resourceClaimName"], "-n", ns)
            return c if c.get("status", {}).get("allocation") else None
    return None


def scheduling_failure(cluster: Any, ns: str, pod: str) -> str:
    conds = cluster.get("pod", pod, "-n", ns).get("status", {}).get("conditions") or []
    for c in conds:
        if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
            return str(c.get("message", ""))
    return ""


def test_whole_node_8_gpu_pod_schedules_across_pcie_roots(cluster, ns, sharing_sandbox) -> None:
    # Before alignUpTo every count > 1 got matchAttribute pcieRoot, and this pod stayed Pending with
    # "0/2 nodes are available: 2 cannot allocate all claims" (8 GPUs sit on 2 roots of 4).
    cluster.run("create", "-f", "-", input=gpu_pod("whole-node", ns, 8))
    claim = wait_for("8-GPU claim allocated", lambda: allocated_claim(cluster, ns, "whole-node"))
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 8 and len({r["device"] for r in results}) == 8
    (node,) = {r["pool"] for r in results}
    assert "constraints" not in claim["spec"]["devices"]
    slices = cluster.get("resourceslices")["items"]
    roots = {d["attributes"]["resource.kubernetes.io/pcieRoot"]["string"]
             for s in slices if s["spec"]["pool"]["name"] == node for d in s["spec"]["devices"]}
    assert len(roots) == 2
    bound = wait_for("bound", lambda: cluster.get("pod", "whole-node", "-n", ns)["spec"].get("nodeName"))
    assert bound == node


def test_four_gpu_pod_still_gets_one_pcie_root(cluster, ns) -> None:
    cluster.run("create", "-f", "-", input=gpu_pod("quad", ns, 4))
    claim = wait_for("4-GPU claim allocated", lambda: allocated_claim(cluster, ns, "quad"))
    assert claim["spec"]["devices"]["constraints"] == [
        {"requests": ["gpu"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}]
    results = claim["status"]["allocation"]["devices"]["results"]
    slices = cluster.get("resourceslices")["items"]
    attrs = {(s["spec"]["pool"]["name"], d["name"]): d["attributes"] for s in slices for d in s["spec"]["devices"]}
    assert len({attrs[(r["pool"], r["device"])]["resource.kubernetes.io/pcieRoot"]["string"]
                for r in results}) == 1


def test_shared_pods_pack_onto_as_few_gpus_as_memory_allows(cluster, ns, sharing_sandbox) -> None:
    node = sharing_sandbox.extra["gpu_nodes"][0]
    sizes = {"a": "20Gi", "b": "20Gi", "c": "20Gi", "d": "20Gi", "e": "15Gi", "f": "12Gi"}
    for name, mem in sizes.items():
        cluster.run("create", "-f", "-", input=gpu_pod(name, ns, 1, mode="shared", memory=mem, node=node))
    per_gpu: dict[str, int] = {}
    for name, mem in sizes.items():
        claim = wait_for(f"shared claim of {name} allocated", lambda n=name: allocated_claim(cluster, ns, n))
        asked = claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"]
        assert parse_quantity_bytes(asked) == parse_quantity_bytes(mem)  # the apiserver canonicalizes the unit
        (r,) = claim["status"]["allocation"]["devices"]["results"]
        assert r["pool"] == node and r.get("shareID")
        consumed = parse_quantity_bytes(r["consumedCapacity"]["memory"])
        assert consumed == parse_quantity_bytes(mem)
        per_gpu[r["device"]] = per_gpu.get(r["device"], 0) + consumed
    total = sum(parse_quantity_bytes(m) for m in sizes.values())
    assert len(per_gpu) == math.ceil(total / (80 * GIB)) == 2, per_gpu  # 107 GiB: two 80 GiB GPUs, not six
    assert all(used <= 80 * GIB for used in per_gpu.values())
    for name in sizes:
        wait_for(f"{name} bound", lambda n=name: cluster.get("pod", n, "-n", ns)["spec"].get("nodeName"))


def test_shared_pod_that_fits_no_gpu_stays_pending_with_the_schedulers_reason(cluster, ns) -> None:
    cluster.run("create", "-f", "-", input=gpu_pod("too-big", ns, 1, mode="shared", memory="96Gi"))
    reason = wait_for("scheduler gives up", lambda: scheduling_failure(cluster, ns, "too-big"))
    assert "cannot allocate all claims" in reason
    assert not cluster.get("pod", "too-big", "-n", ns)["spec"].get("nodeName")
    # The same pod at 64Gi fits: the refusal was about memory, not about the pod.
    cluster.run("create", "-f", "-", input=gpu_pod("fits", ns, 1, mode="shared", memory="64Gi"))
    claim = wait_for("64Gi claim allocated", lambda: allocated_claim(cluster, ns, "fits"))
    (r,) = claim["status"]["allocation"]["devices"]["results"]
    assert parse_quantity_bytes(r["consumedCapacity"]["memory"]) == 64 * GIB


def test_packing_report_shared_uses_fewer_gpus_than_whole(sharing_sandbox) -> None:
    whole, shared = packing.run(sharing_sandbox, pods=8)
    assert (whole.arm, shared.arm) == ("whole", "shared")
    assert whole.placed == shared.placed == 8
    assert whole.gpus_used == 8
    assert shared.gpus_used < whole.gpus_used
    assert shared.utilization > whole.utilization
    assert "| shared | 8/8 |" in packing.table([whole, shared])


def _pod_with_init(name: str, ns: str, *, sidecar: bool) -> str:
    init: dict[str, Any] = {"name": "warmup", "image": "registry.k8s.io/pause:3.10",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    if sidecar:
        init["restartPolicy"] = "Always"
    doc = json.loads(gpu_pod(name, ns, 1))
    doc["spec"]["initContainers"] = [init]
    return json.dumps(doc)


def _devices_held(cluster: Any, ns: str, pod: str) -> int:
    def all_allocated() -> list[dict[str, Any]] | None:
        p = cluster.get("pod", pod, "-n", ns)
        names = [st.get("resourceClaimName") for st in p.get("status", {}).get("resourceClaimStatuses") or []]
        if not names or not all(names):
            return None
        claims = [cluster.get("resourceclaim", n, "-n", ns) for n in names]
        return claims if all(c.get("status", {}).get("allocation") for c in claims) else None

    claims = wait_for(f"claims of {pod} allocated", all_allocated)
    return sum(len(c["status"]["allocation"]["devices"]["results"]) for c in claims)


def test_regular_init_container_reuses_the_app_gpu_and_a_sidecar_keeps_its_own(cluster, ns) -> None:
    # Before: a 1-GPU init + a 1-GPU main container held 2 GPUs for the pod's whole life.
    cluster.run("create", "-f", "-", input=_pod_with_init("init-then-main", ns, sidecar=False))
    cluster.run("create", "-f", "-", input=_pod_with_init("sidecar-and-main", ns, sidecar=True))
    assert _devices_held(cluster, ns, "init-then-main") == 1
    assert _devices_held(cluster, ns, "sidecar-and-main") == 2


def test_webhook_config_flag_sets_a_namespace_memory_default(cluster) -> None:
    # `--webhook-config` gave namespace shared-default 6Gi: a shared pod there needs no annotation.
    ns = "shared-default"
    cluster.run("create", "namespace", ns)
    try:
        wait_for("default ServiceAccount",
                 lambda: cluster.run("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0)
        cluster.run("create", "-f", "-", input=gpu_pod("plain", ns, 1, mode="shared"))
        claim = wait_for("claim allocated", lambda: allocated_claim(cluster, ns, "plain"))
        (r,) = claim["status"]["allocation"]["devices"]["results"]
        assert parse_quantity_bytes(r["consumedCapacity"]["memory"]) == 6 * GIB
        p = cluster.run("create", "-f", "-", input=gpu_pod("elsewhere", "default", 1, mode="shared"), check=False)
        assert p.returncode != 0 and "gpu-mode shared but says no GPU memory" in p.stderr
    finally:
        cluster.run("delete", "namespace", ns, "--wait=false", check=False)
        packing.wait_claims_gone(cluster, ns)


def test_enforced_namespace_denies_an_opt_out_annotation_through_kubectl(cluster, sharing_sandbox) -> None:
    ns = "enforced"
    cluster.run("create", "namespace", ns)
    try:
        wait_for("default ServiceAccount",
                 lambda: cluster.run("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0)
        p = cluster.run("create", "-f", "-", input=gpu_pod("escape", ns, 1, mode="off"), check=False)
        assert p.returncode != 0
        assert 'admission webhook "gpu.gatekeeper.dev" denied the request' in p.stderr
        assert "namespace enforced enforces gpu-mode shared" in p.stderr
        assert cluster.run("get", "pod", "escape", "-n", ns, check=False).returncode != 0
        doc = json.loads(gpu_pod("kept", ns, 1))
        del doc["metadata"]["annotations"]
        cluster.run("create", "-f", "-", input=json.dumps(doc))
        pod = cluster.get("pod", "kept", "-n", ns)
        assert pod["metadata"]["annotations"]["gatekeeper.dev/gpu-decision"] == "mode=shared source=enforced"
        claim = wait_for("claim allocated", lambda: allocated_claim(cluster, ns, "kept"))
        (r,) = claim["status"]["allocation"]["devices"]["results"]
        assert parse_quantity_bytes(r["consumedCapacity"]["memory"]) == 4 * GIB
        metrics = _metrics(sharing_sandbox)
        assert 'gatekeeper_webhook_gpu_mode_decisions_total{mode="denied",source="enforced"}' in metrics
        assert 'gatekeeper_webhook_gpu_mode_decisions_total{mode="shared",source="enforced"}' in metrics
    finally:
        cluster.run("delete", "namespace", ns, "--wait=false", check=False)
        packing.wait_claims_gone(cluster, ns)


def _metrics(state: SandboxState) -> str:
    import ssl
    import urllib.request

    ctx = ssl.create_default_context(cafile=str(Path(state.certs_dir) / "ca.crt"))
    with urllib.request.urlopen(state.extra["webhook"]["url"] + "/metrics", context=ctx, timeout=10) as r:
        return str(r.read().decode())
