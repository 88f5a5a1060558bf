"""MIG per node pool and mig-dra, against the real kube-scheduler.

A module sandbox of its own (1 apiserver, scheduler + controller manager, the
webhook with three MIG pools): one device-plugin MIG node per pool (A100-40GB,
H100-80GB and A100-80GB, all-balanced, one GPU each: ``nvidia.com/mig-*`` capacity and GPU
feature discovery's product label) and one node whose single H100 is published as
dynamic-MIG partitionable devices (shared counters + one device per profile
placement). Kept apart from the sharing sandbox because the partitioned node's
full GPU is a ``type: gpu`` device too, and would change that module's packing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from test_gpu_sharing_sandbox import allocated_claim, packing, scheduling_failure, scratch_namespace, wait_for

from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox

A100_40 = "NVIDIA-A100-SXM4-40GB"
A100_80 = "NVIDIA-A100-SXM4-80GB"
H100_80 = "NVIDIA-H100-80GB-HBM3"
CONFIG = f"""webhook:
  gpu:
    migGpuModel: H100-80GB
    migPools:
    - {{name: a100-40, labelValue: {A100_40}, gpuModel: A100-40GB, layout: all-balanced}}
    - {{name: h100-80, labelValue: {H100_80}, gpuModel: H100-80GB, layout: all-balanced}}
    - {{name: a100-80, labelValue: {A100_80}, gpuModel: A100-80GB, layout: all-balanced}}
"""


@pytest.fixture(scope="module")
def mig_sandbox(tmp_path_factory: pytest.TempPathFactory, own_sandbox: Any) -> Iterator[SandboxState]:
    from gatekeeper.sandbox.testing import webhook_sandbox

    with webhook_sandbox(tmp_path_factory.mktemp("gpu-mig"), CONFIG, own_sandbox, "--apiservers", "1",
                         "--gpus-per-node", "1",
                         "--mig-node", "A100-40GB", "--mig-node", "H100-80GB", "--mig-node", "A100-80GB",
                         "--mig-dra-nodes", "1", "--with-scheduler") as state:
        yield state


@pytest.fixture
def cluster(mig_sandbox: SandboxState) -> Any:
    return packing.Cluster(mig_sandbox)


@pytest.fixture
def ns(cluster: Any) -> Iterator[str]:
    yield from scratch_namespace(cluster, "m")


def mig_pod(name: str, ns: str, memory: str, mode: str = "mig", product: str = "") -> str:
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    if product:
        spec["nodeSelector"] = {"nvidia.com/gpu.product": product}
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": ns,
        "annotations": {"gatekeeper.dev/gpu-mode": mode, "gatekeeper.dev/gpu-memory": memory}}, "spec": spec})


def bound_node(cluster: Any, ns: str, pod: str) -> str:
    return str(wait_for(f"{pod} bound", lambda: cluster.get("pod", pod, "-n", ns)["spec"].get("nodeName")))


def test_mig_pod_is_sized_from_the_pools_and_lands_on_a_pool_that_offers_its_profile(
        cluster, ns, mig_sandbox) -> None:
    a100_40_node, h100_node, a100_80_node = mig_sandbox.extra["mig_nodes"]
    # 15Gi = 16.1 GB: all-balanced H100 and A100-80 offer 2g.20gb, A100-40 3g.20gb; same memory, fewer
    # slices wins, and both pools offering 2g.20gb stay open to the scheduler (one nodeAffinity term).
    cluster.run("create", "-f", "-", input=mig_pod("free", ns, "15Gi"))
    pod = cluster.get("pod", "free", "-n", ns)
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-2g.20gb": "1"}
    (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": sorted([A100_80, H100_80])}]
    first = bound_node(cluster, ns, "free")
    assert first in (h100_node, a100_80_node)
    # Each node has one 2g.20gb: a second such pod must go to the other pool's node, never the A100-40.
    cluster.run("create", "-f", "-", input=mig_pod("second", ns, "15Gi"))
    assert {first, bound_node(cluster, ns, "second")} == {h100_node, a100_80_node}
    # The same ask pinned to the A100-40 pool is sized for that pool only, and the scheduler puts it there.
    cluster.run("create", "-f", "-", input=mig_pod("pinned", ns, "15Gi", product=A100_40))
    pod = cluster.get("pod", "pinned", "-n", ns)
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-3g.20gb": "1"}
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": A100_40}
    assert bound_node(cluster, ns, "pinned") == a100_40_node
    # A 4Gi pod fits only A100-40's 1g.5gb: a plain nodeSelector for that one pool.
    cluster.run("create", "-f", "-", input=mig_pod("small", ns, "4Gi"))
    pod = cluster.get("pod", "small", "-n", ns)
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": A100_40} and "affinity" not in pod["spec"]
    assert bound_node(cluster, ns, "small") == a100_40_node


def test_mig_pod_no_pool_fits_is_denied_with_what_the_pools_offer(cluster, ns) -> None:
    p = cluster.run("create", "-f", "-", input=mig_pod("huge", ns, "50Gi"), check=False)
    assert p.returncode != 0
    assert "more than the largest MIG profile of any MIG pool" in p.stderr
    assert "h100-80 (H100-80GB): 1g.10gb, 2g.20gb, 3g.40gb" in p.stderr
    assert cluster.run("get", "pod", "huge", "-n", ns, check=False).returncode != 0


def test_mig_dra_partitions_share_one_gpus_counters_until_they_run_out(cluster, ns, mig_sandbox) -> None:
    (node,) = mig_sandbox.extra["mig_dra_nodes"]
    # 25Gi -> 3g.40gb: 4 of the GPU's 8 memory slices and 3 of its 7 compute slices each.
    for name in ("p1", "p2"):
        cluster.run("create", "-f", "-", input=mig_pod(name, ns, "25Gi", mode="mig-dra"))
    devices = set()
    for name in ("p1", "p2"):
        claim = wait_for(f"{name} partition allocated", lambda n=name: allocated_claim(cluster, ns, n))
        (r,) = claim["status"]["allocation"]["devices"]["results"]
        assert r["pool"] == node and r["device"].startswith("gpu-0-mig-3g40gb-")
        devices.add(r["device"])
        assert bound_node(cluster, ns, name) == node
    assert devices == {"gpu-0-mig-3g40gb-0", "gpu-0-mig-3g40gb-4"}  # both halves of the same GPU
    # Seven 1g.10gb devices are still published and unallocated, but every memory slice is consumed.
    cluster.run("create", "-f", "-", input=mig_pod("p3", ns, "5G", mode="mig-dra"))
    reason = wait_for("scheduler gives up on p3", lambda: scheduling_failure(cluster, ns, "p3"))
    assert "cannot allocate all claims" in reason, reason
    assert not cluster.get("pod", "p3", "-n", ns)["spec"].get("nodeName")
    # Freeing one half makes room: the counters, not the device list, were the limit.
    cluster.run("delete", "pod", "p1", "-n", ns, "--wait=false")
    claim = wait_for("p3 allocated once p1's counters are back", lambda: allocated_claim(cluster, ns, "p3"),
                     timeout=180)
    (r,) = claim["status"]["allocation"]["devices"]["results"]
    assert r["device"].startswith("gpu-0-mig-1g10gb-")
