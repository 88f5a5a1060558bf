"""GPU asks on a fleet that mixes GPU kinds, through the real webhook and the real kube-scheduler.

A module sandbox of its own: ``sandbox up --mixed-fleet`` (H100s shared by memory, whole H100s, A100s shared
4 ways by a share count, whole A100s, one dynamic-MIG node of 3 H100s), scheduler and controller manager,
and the webhook (its gpuModels are the fleet's two models). Each test frees what it took.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_gpu_sharing_sandbox import allocated_claim, packing, scheduling_failure, scratch_namespace, wait_for

from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import metric_sum
from gatekeeper.webhook.gpu.sizing import parse_quantity_bytes
from gatekeeper.webhook.inventory.committed import gpu_rows

pytestmark = pytest.mark.sandbox

GIB = 1024**3
CONFIG = "webhook:\n  gpu:\n    namespaceGpuModels: {a100-only: A100-40GB}\n"


@pytest.fixture(scope="module")
def fleet_sandbox(tmp_path_factory: pytest.TempPathFactory, own_sandbox: Any) -> Iterator[SandboxState]:
    from gatekeeper.sandbox.testing import webhook_sandbox

    with webhook_sandbox(tmp_path_factory.mktemp("gpu-fleet"), CONFIG, own_sandbox, "--apiservers", "1",
                         "--mixed-fleet", "--with-scheduler") as state:
        yield state


@pytest.fixture
def cluster(fleet_sandbox: SandboxState) -> Any:
    return packing.Cluster(fleet_sandbox)


@pytest.fixture
def ns(cluster: Any) -> Iterator[str]:
    yield from scratch_namespace(cluster, "f")


def pod(name: str, ns: str, annotations: dict[str, str], limits: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "annotations": annotations},
            "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                     "resources": {"limits": limits or {"nvidia.com/gpu": "1"}}}]}}


def create(cluster: Any, *pods: dict[str, Any]) -> None:
    cluster.run("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(pods)}))


def devices(cluster: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(s["spec"]["pool"]["name"], d["name"]): d
            for s in cluster.get("resourceslices")["items"] for d in s["spec"].get("devices", [])}


def settle(cluster: Any, ns: str, names: list[str]) -> dict[str, dict[str, Any] | str]:
    """Each pod's allocated claim, or the scheduler's reason it cannot place it."""
    def done() -> dict[str, Any] | None:
        out: dict[str, Any] = {}
        for n in names:
            out[n] = allocated_claim(cluster, ns, n) or scheduling_failure(cluster, ns, n)
            if not out[n]:
                return None
        return out

    return wait_for(f"{len(names)} pods placed or refused", done, timeout=180)


def result_of(claim: dict[str, Any]) -> dict[str, Any]:
    (r,) = claim["status"]["allocation"]["devices"]["results"]
    return r


def test_shared_pods_fill_only_shareable_gpus_and_the_rest_wait(cluster, ns) -> None:
    # 30Gi each: 2 per shared H100 (4 GPUs), 1 per A100 of the counted pool (40Gi each, 4 GPUs) = 12 places.
    # Before, 5 of 16 shared pods took whole exclusive GPUs (loadtest/reports/2026-12-06-mixed-fleet-before.md).
    names = [f"s{i}" for i in range(14)]
    create(cluster, *(pod(n, ns, {"gatekeeper.dev/gpu-mode": "shared", "gatekeeper.dev/gpu-memory": "30Gi"})
                      for n in names))
    got = settle(cluster, ns, names)
    devs = devices(cluster)
    placed = {n: result_of(c) for n, c in got.items() if isinstance(c, dict)}
    assert len(placed) == 12, {n: v for n, v in got.items() if not isinstance(v, dict)}
    for r in placed.values():
        assert devs[(r["pool"], r["device"])].get("allowMultipleAllocations") is True, r
        assert parse_quantity_bytes(r["consumedCapacity"]["memory"]) == 30 * GIB
    waiting = [v for v in got.values() if isinstance(v, str)]
    assert len(waiting) == 2 and all("cannot allocate all claims" in w for w in waiting)


def test_whole_gpu_pods_never_get_a_share_of_a_counted_gpu(cluster, ns) -> None:
    # Before, 13 of 20 whole-GPU pods got one of 4 shares of an A100 (memory 0, shares 1).
    names = [f"w{i}" for i in range(10)]
    create(cluster, *(pod(n, ns, {"gatekeeper.dev/gpu-mode": "dra"}) for n in names))
    got = settle(cluster, ns, names)
    for claim in got.values():
        assert isinstance(claim, dict)
        r = result_of(claim)
        assert r["pool"] != "gpu-a100-shares-0"
        assert "shares" not in (r.get("consumedCapacity") or {})


def test_first_available_takes_the_first_way_with_room_then_the_next(cluster, ns) -> None:
    # 35Gi: a 3g.40gb MIG partition (2 per H100, 6 on the MIG node), else a shared 35Gi slot, else a whole GPU.
    ann = {"gatekeeper.dev/gpu-fallbacks": "mig-dra,shared,dra", "gatekeeper.dev/gpu-memory": "35Gi"}
    first = [f"m{i}" for i in range(6)]
    create(cluster, *(pod(n, ns, ann) for n in first))
    got = settle(cluster, ns, first)
    assert {result_of(c)["request"] for c in got.values()} == {"gpu/mig-dra"}, got  # type: ignore[union-attr]
    more = ["n0", "n1"]
    create(cluster, *(pod(n, ns, ann) for n in more))
    got = settle(cluster, ns, more)
    for c in got.values():
        assert isinstance(c, dict)
        r = result_of(c)
        assert r["request"] == "gpu/shared" and parse_quantity_bytes(r["consumedCapacity"]["memory"]) == 35 * GIB


def test_mps_config_follows_the_way_that_was_allocated(cluster, ns) -> None:
    create(cluster, pod("mps", ns, {"gatekeeper.dev/gpu-fallbacks": "mps-dra,dra", "gatekeeper.dev/gpu-models":
                                    "A100-40GB"}))
    claim = settle(cluster, ns, ["mps"])["mps"]
    assert isinstance(claim, dict)
    assert result_of(claim)["request"] == "gpu/mps-dra"
    assert claim["spec"]["devices"]["config"][0]["requests"] == ["gpu/mps-dra"]
    assert result_of(claim)["pool"] == "gpu-a100-whole-0"


def test_model_choice_keeps_pods_on_the_models_they_name(cluster, ns) -> None:
    create(cluster, pod("a", ns, {"gatekeeper.dev/gpu-mode": "dra", "gatekeeper.dev/gpu-models": "A100-40GB"}),
           pod("h", ns, {"gatekeeper.dev/gpu-mode": "shared", "gatekeeper.dev/gpu-memory": "10Gi",
                         "gatekeeper.dev/gpu-models": "H100-80GB"}),
           pod("big", ns, {"gatekeeper.dev/gpu-mode": "dra", "gatekeeper.dev/gpu-models": ">=80Gi"}),
           pod("mig", ns, {"gatekeeper.dev/gpu-mode": "mig-dra", "gatekeeper.dev/gpu-memory": "25Gi",
                           "gatekeeper.dev/gpu-models": "A100-40GB,H100-80GB"}))
    got = settle(cluster, ns, ["a", "h", "big", "mig"])
    devs = devices(cluster)
    product = {n: devs[(result_of(c)["pool"], result_of(c)["device"])]["attributes"]["productName"]["string"]
               for n, c in got.items() if isinstance(c, dict)}
    assert product == {"a": "NVIDIA A100-SXM4-40GB", "h": "NVIDIA H100 80GB HBM3", "big": "NVIDIA H100 80GB HBM3",
                       "mig": "NVIDIA H100 80GB HBM3"}
    # 25Gi (26.8 GB): an A100-40GB would need its 7g.40gb, an H100 its 3g.40gb. Only the MIG node (H100s) has
    # partitions, so the H100 half of the selector is what the scheduler could use.
    mig = devs[(result_of(got["mig"])["pool"], result_of(got["mig"])["device"])]  # type: ignore[arg-type]
    assert mig["attributes"]["profile"]["string"] == "3g.40gb"


def test_a_namespace_default_model_applies_to_its_pods(cluster) -> None:
    name = "a100-only"  # the module's config gives it namespaceGpuModels A100-40GB
    cluster.run("create", "namespace", name)
    try:
        wait_for("default ServiceAccount",
                 lambda: cluster.run("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0)
        create(cluster, pod("p", name, {"gatekeeper.dev/gpu-mode": "dra"}))
        claim = settle(cluster, name, ["p"])["p"]
        assert isinstance(claim, dict) and result_of(claim)["pool"] == "gpu-a100-whole-0"
    finally:
        cluster.run("delete", "namespace", name, "--wait=false", check=False)
        packing.wait_claims_gone(cluster, name)


def test_shares_mode_puts_four_pods_on_each_counted_gpu(cluster, ns) -> None:
    names = [f"t{i}" for i in range(5)]
    create(cluster, *(pod(n, ns, {"gatekeeper.dev/gpu-mode": "shares"}) for n in names))
    got = settle(cluster, ns, names)
    per_gpu: dict[str, int] = {}
    for c in got.values():
        assert isinstance(c, dict)
        r = result_of(c)
        assert r["pool"] == "gpu-a100-shares-0" and r["consumedCapacity"]["shares"] == "1"
        per_gpu[r["device"]] = per_gpu.get(r["device"], 0) + 1
    assert max(per_gpu.values()) <= 4


def test_hami_resources_become_shared_claims(cluster, ns) -> None:
    create(cluster, pod("mem", ns, {}, {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "10000"}),
           pod("pct", ns, {"gatekeeper.dev/gpu-models": "A100-40GB"}, {"nvidia.com/gpumem-percentage": "50"}))
    got = settle(cluster, ns, ["mem", "pct"])
    devs = devices(cluster)
    mem, pct = result_of(got["mem"]), result_of(got["pct"])  # type: ignore[arg-type]
    assert parse_quantity_bytes(mem["consumedCapacity"]["memory"]) == 10000 * 1024**2
    assert parse_quantity_bytes(pct["consumedCapacity"]["memory"]) == 20 * GIB  # half an A100-40GB
    assert all(devs[(r["pool"], r["device"])].get("allowMultipleAllocations") for r in (mem, pct))
    p = cluster.get("pod", "mem", "-n", ns)
    assert p["metadata"]["annotations"]["gatekeeper.dev/gpu-decision"] == "mode=shared source=hami-alias"
    assert "nvidia.com/gpumem" not in json.dumps(p["spec"]["containers"][0]["resources"])


def _metrics(state: SandboxState) -> str:
    ctx = ssl.create_default_context(cafile=str(Path(state.certs_dir) / "ca.crt"))
    with urllib.request.urlopen(state.extra["webhook"]["url"] + "/metrics", context=ctx, timeout=10) as r:
        return str(r.read().decode())


@pytest.mark.parametrize(("annotations", "limits", "needle", "reason"), [
    ({"gatekeeper.dev/gpu-mode": "dra", "gatekeeper.dev/gpu-models": "V100"}, None,
     "unknown GPU model 'V100'; known models: H100-80GB, A100-40GB", "unknown-model"),
    ({"gatekeeper.dev/gpu-fallbacks": "mig-dra,timeslice"}, None, "unknown way 'timeslice'", "unknown-fallback"),
    ({"gatekeeper.dev/gpu-mode": "shared", "gatekeeper.dev/gpu-memory": "96Gi"}, None,
     "more than any known GPU model has (the largest is H100-80GB, 80Gi)", "memory-too-large"),
    ({}, {"nvidia.com/gpumem": "1000", "nvidia.com/gpumem-percentage": "50"},
     "both nvidia.com/gpumem and nvidia.com/gpumem-percentage", "contradictory-ask"),
])
def test_bad_asks_are_denied_with_the_reason_and_counted(cluster, ns, fleet_sandbox, annotations, limits, needle,
                                                         reason) -> None:
    before = metric_sum(_metrics(fleet_sandbox), "gatekeeper_webhook_gpu_denials_total", reason=reason)
    p = cluster.run("create", "-f", "-", input=json.dumps(pod("bad", ns, annotations, limits)), check=False)
    assert p.returncode != 0 and 'admission webhook "gpu.gatekeeper.dev" denied the request' in p.stderr
    assert needle in p.stderr, p.stderr
    after = metric_sum(_metrics(fleet_sandbox), "gatekeeper_webhook_gpu_denials_total", reason=reason)
    assert after == before + 1


def test_committed_capacity_metrics_match_the_claims_counted(cluster, ns, fleet_sandbox) -> None:
    create(cluster, *(pod(f"s{i}", ns, {"gatekeeper.dev/gpu-mode": "shared", "gatekeeper.dev/gpu-memory": "12Gi"})
                      for i in range(5)),
           *(pod(f"t{i}", ns, {"gatekeeper.dev/gpu-mode": "shares"}) for i in range(3)),
           *(pod(f"w{i}", ns, {"gatekeeper.dev/gpu-mode": "dra"}) for i in range(2)),
           pod("m", ns, {"gatekeeper.dev/gpu-mode": "mig-dra", "gatekeeper.dev/gpu-memory": "9Gi"}))
    names = [*(f"s{i}" for i in range(5)), *(f"t{i}" for i in range(3)), "w0", "w1", "m"]
    got = settle(cluster, ns, names)
    assert all(isinstance(c, dict) for c in got.values())
    # What the test counts from the claims it made, per GPU: claims, and committed memory and shares.
    want: dict[tuple[str, str], dict[str, float]] = {}
    rows = {(r.node, r.gpu): r for r in gpu_rows(cluster.get("resourceslices")["items"], [])}
    parents, devs = _mig_parents(cluster), devices(cluster)
    for c in got.values():
        r = result_of(c)  # type: ignore[arg-type]
        key = (r["pool"], parents.get((r["pool"], r["device"]), r["device"]))
        w = want.setdefault(key, {"claims": 0, "memory": 0, "shares": 0})
        w["claims"] += 1
        consumed = r.get("consumedCapacity")
        if consumed:
            w["memory"] += parse_quantity_bytes(consumed["memory"]) if consumed["memory"] != "0" else 0
            w["shares"] += float(consumed.get("shares", 0))
        else:  # an exclusive device: a whole GPU or a MIG partition, all of its memory
            w["memory"] += parse_quantity_bytes(devs[(r["pool"], r["device"])]["capacity"]["memory"]["value"])

    def exported() -> dict[tuple[str, str], dict[str, float]] | None:
        page = _metrics(fleet_sandbox)
        out = {}
        for node, gpu_name in want:
            labels = {"node": node, "gpu": gpu_name}
            out[(node, gpu_name)] = {
                "claims": metric_sum(page, "gatekeeper_gpu_claims", **labels),
                "memory": metric_sum(page, "gatekeeper_gpu_memory_committed_bytes", **labels),
                "shares": metric_sum(page, "gatekeeper_gpu_shares_committed", **labels)}
        return out if out == want else None

    assert wait_for("inventory metrics equal the claims counted", exported, timeout=30) == want
    page = _metrics(fleet_sandbox)
    assert metric_sum(page, "gatekeeper_gpu_inventory_leader") == 1
    assert metric_sum(page, "gatekeeper_gpu_claims") == len(names)
    idle = sum(1 for key in rows if key not in want)
    assert metric_sum(page, "gatekeeper_gpu_idle") == idle


def _mig_parents(cluster: Any) -> dict[tuple[str, str], str]:
    """(pool, MIG partition) -> its GPU's device name, from the slices' uuid/parentUUID attributes."""
    devs = devices(cluster)
    by_uuid = {(pool, d["attributes"]["uuid"]["string"]): name for (pool, name), d in devs.items()
               if d["attributes"].get("type", {}).get("string") == "gpu"}
    return {(pool, name): by_uuid[(pool, d["attributes"]["parentUUID"]["string"])]
            for (pool, name), d in devs.items() if d["attributes"].get("type", {}).get("string") == "mig"}


def test_one_inventory_leader_holds_the_lease_and_a_second_process_follows(fleet_sandbox) -> None:
    from gatekeeper.webhook import kube_api
    from gatekeeper.webhook.inventory.lease import LeaseElector

    cluster = packing.Cluster(fleet_sandbox)
    lease = cluster.get("lease", "gatekeeper-gpu-inventory", "-n", "default")
    holder = lease["spec"]["holderIdentity"]
    assert holder.endswith(f"-{fleet_sandbox.extra['webhook']['pid']}")

    async def second() -> bool:
        api = await kube_api.api_client(fleet_sandbox.kubeconfig)
        try:
            other = LeaseElector(kube_api.lease_ops(api, "gatekeeper-gpu-inventory", "default"),
                                 "gatekeeper-gpu-inventory", "default", "test-follower", 15, 5)
            for _ in range(3):
                await other.step()
                await asyncio.sleep(2)
            return other.leading
        finally:
            await api.close()

    assert asyncio.run(second()) is False
    assert cluster.get("lease", "gatekeeper-gpu-inventory", "-n", "default")["spec"]["holderIdentity"] == holder
