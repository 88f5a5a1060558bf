"""KEP-5004 (DRAExtendedResource) against the real scheduler: ``sandbox up --gpu-extended-resource-mapping``.

A module sandbox of its own (1 apiserver, 1 KWOK node x 4 GPUs that does not advertise
``nvidia.com/gpu``, scheduler + controller manager, the webhook listing DeviceClasses every
second). The scheduler itself serves an unchanged 1-GPU pod through DRA; the webhook leaves it
alone, still aligns a multi-GPU pod, and notices the mapping going away and coming back.
The same sandbox runs the template lifecycle loop every second with a 4 s GC grace period.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_gpu_sharing_sandbox import allocated_claim, gpu_pod, packing, scratch_namespace, wait_for

from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def mapped_sandbox(tmp_path_factory: pytest.TempPathFactory, own_sandbox: Any) -> Iterator[SandboxState]:
    from gatekeeper.sandbox.testing import run_down

    state_dir = tmp_path_factory.mktemp("gpu-kep5004")
    config = state_dir.parent / f"{state_dir.name}-webhook.yaml"
    config.write_text("webhook:\n  gpu:\n    kep5004: step-aside\n    deviceClassCheckSeconds: 1\n"
                      "    templateReconcileSeconds: 1\n    templateGcGraceSeconds: 4\n")
    try:
        yield own_sandbox(state_dir, "--apiservers", "1", "--gpu-nodes", "1", "--gpus-per-node", "4",
                         "--with-scheduler", "--with-webhook", "--gpu-extended-resource-mapping",
                         "--webhook-config", str(config))
    finally:
        run_down(state_dir)


@pytest.fixture
def cluster(mapped_sandbox: SandboxState) -> Any:
    return packing.Cluster(mapped_sandbox)


@pytest.fixture
def ns(cluster: Any) -> Iterator[str]:
    yield from scratch_namespace(cluster, "k")


def rewritten_on_dry_run(cluster: Any, ns: str) -> bool:
    p = cluster.run("create", "--dry-run=server", "-o", "json", "-f", "-", input=gpu_pod("probe", ns, 1))
    return bool(json.loads(p.stdout)["spec"].get("resourceClaims"))


def test_unchanged_one_gpu_pod_is_allocated_through_dra_by_the_scheduler(cluster, ns, mapped_sandbox) -> None:
    dc = cluster.get("deviceclass", mapped_sandbox.extra["device_class"])
    assert dc["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    p = cluster.run("create", "-f", "-", input=gpu_pod("one", ns, 1))
    assert "KEP-5004" in p.stderr  # the webhook's warning, shown by kubectl
    pod = cluster.get("pod", "one", "-n", ns)
    assert not pod["spec"].get("resourceClaims")
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"

    def extended_claim() -> dict[str, Any] | None:
        st = cluster.get("pod", "one", "-n", ns).get("status", {}).get("extendedResourceClaimStatus") or {}
        name = st.get("resourceClaimName")
        if not name:
            return None
        c = cluster.get("resourceclaim", name, "-n", ns)
        return c if c.get("status", {}).get("allocation") else None

    claim = wait_for("scheduler's KEP-5004 claim allocated", extended_claim)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == mapped_sandbox.extra["dra_driver"]
    assert wait_for("bound", lambda: cluster.get("pod", "one", "-n", ns)["spec"].get("nodeName"))


def test_multi_gpu_pod_still_gets_the_aligned_claim(cluster, ns) -> None:
    cluster.run("create", "-f", "-", input=gpu_pod("pair", ns, 2))
    assert cluster.get("pod", "pair", "-n", ns)["spec"]["resourceClaims"]
    claim = wait_for("aligned claim allocated", lambda: allocated_claim(cluster, ns, "pair"))
    assert claim["spec"]["devices"]["constraints"][0]["matchAttribute"] == "resource.kubernetes.io/pcieRoot"
    assert len(claim["status"]["allocation"]["devices"]["results"]) == 2


def test_webhook_follows_the_mapping_being_removed_and_restored(cluster, ns, mapped_sandbox) -> None:
    name = mapped_sandbox.extra["device_class"]
    assert not rewritten_on_dry_run(cluster, ns)
    cluster.run("patch", "deviceclass", name, "--type=json",
                "-p", '[{"op": "remove", "path": "/spec/extendedResourceName"}]')
    try:
        wait_for("webhook rewrites without the mapping", lambda: rewritten_on_dry_run(cluster, ns), timeout=30)
    finally:
        cluster.run("patch", "deviceclass", name, "--type=merge",
                    "-p", '{"spec": {"extendedResourceName": "nvidia.com/gpu"}}')
    wait_for("webhook leaves pods alone again", lambda: not rewritten_on_dry_run(cluster, ns), timeout=30)


def template_of(cluster: Any, ns: str, pod: str) -> str:
    return str(cluster.get("pod", pod, "-n", ns)["spec"]["resourceClaims"][0]["resourceClaimTemplateName"])


def template_uid(cluster: Any, ns: str, name: str) -> str:
    p = cluster.run("get", "resourceclaimtemplate", name, "-n", ns, "-o", "jsonpath={.metadata.uid}", check=False)
    return str(p.stdout).strip() if p.returncode == 0 else ""


def test_deleted_template_a_pod_references_comes_back(cluster, ns) -> None:
    cluster.run("create", "-f", "-", input=gpu_pod("user", ns, 2))
    name = template_of(cluster, ns, "user")
    tmpl = cluster.get("resourceclaimtemplate", name, "-n", ns)
    assert tmpl["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "gatekeeper"}
    assert tmpl["metadata"]["annotations"]["gatekeeper.dev/spec-hash"]
    first = tmpl["metadata"]["uid"]
    cluster.run("delete", "resourceclaimtemplate", name, "-n", ns)
    second = wait_for("template re-created", lambda: template_uid(cluster, ns, name) not in ("", first)
                      and template_uid(cluster, ns, name), timeout=30)
    assert second != first
    assert cluster.get("resourceclaimtemplate", name, "-n", ns)["spec"] == tmpl["spec"]


def test_template_no_pod_references_is_collected_after_the_grace_period(cluster, ns) -> None:
    cluster.run("create", "-f", "-", input=gpu_pod("gone", ns, 2))
    name = template_of(cluster, ns, "gone")
    assert template_uid(cluster, ns, name)
    deleted = time.monotonic()
    cluster.run("delete", "pod", "gone", "-n", ns, "--grace-period=0", "--force")
    wait_for("unreferenced template collected", lambda: not template_uid(cluster, ns, name), timeout=40)
    assert time.monotonic() - deleted >= 4  # not before the (test-configured 4 s) grace period


def dry_run_mode(cluster: Any, ns: str) -> str:
    """What the webhook does to an unannotated 2-GPU pod in ``ns`` (server-side dry run)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": ns},
           "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                    "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}
    out = json.loads(cluster.run("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(pod)).stdout)
    return str(out["metadata"].get("annotations", {}).get("gatekeeper.dev/gpu-decision", "untouched"))


def test_namespace_gpu_mode_label_is_followed_through_the_watch(cluster, ns) -> None:
    assert dry_run_mode(cluster, ns) == "mode=dra source=default"
    cluster.run("label", "namespace", ns, "gatekeeper.dev/gpu-mode=time-slicing")
    wait_for("label seen", lambda: dry_run_mode(cluster, ns) == "mode=time-slicing source=namespace-label",
             timeout=30)
    cluster.run("label", "--overwrite", "namespace", ns, "gatekeeper.dev/gpu-mode=off")
    wait_for("label change seen", lambda: dry_run_mode(cluster, ns) == "untouched", timeout=30)
    cluster.run("label", "namespace", ns, "gatekeeper.dev/gpu-mode-")
    wait_for("label removal seen", lambda: dry_run_mode(cluster, ns) == "mode=dra source=default", timeout=30)


@pytest.mark.parametrize(("memory", "profile"), [("20Gi", "7g.40gb"), ("20G", "3g.20gb")])
def test_mig_reads_gpu_memory_in_exact_units_through_the_apiserver(cluster, ns, memory, profile) -> None:
    # A100-40GB (the default migGpuModel): 20Gi is 21.5 GB and does not fit a 20 GB profile.
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "m", "namespace": ns,
                        "annotations": {"gatekeeper.dev/gpu-mode": "mig", "gatekeeper.dev/gpu-memory": memory}},
           "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    out = json.loads(cluster.run("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(pod)).stdout)
    assert out["spec"]["containers"][0]["resources"]["limits"] == {f"nvidia.com/mig-{profile}": "1"}


def cluster_pod_lists(cluster: Any) -> float:
    """The apiserver's count of cluster-wide pod LISTs (informers of the scheduler and KCM only watch)."""
    text = cluster.run("get", "--raw", "/metrics").stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("apiserver_request_total{") and 'resource="pods"' in line
               and 'scope="cluster"' in line and 'verb="LIST"' in line)


def test_lifecycle_passes_follow_a_pod_watch_instead_of_listing_every_pod(cluster, ns) -> None:
    # The loop runs every second here; before the pod index each pass LISTed all pods (about 6 in 6 s).
    cluster.run("create", "-f", "-", input=gpu_pod("user", ns, 2))
    name = template_of(cluster, ns, "user")
    before = cluster_pod_lists(cluster)
    time.sleep(6)  # a window of passes to count over, not a wait for a condition
    assert cluster_pod_lists(cluster) - before <= 1  # at most a re-LIST after a broken watch
    # ...and the index still sees the pod: its deleted template comes back.
    first = template_uid(cluster, ns, name)
    cluster.run("delete", "resourceclaimtemplate", name, "-n", ns)
    wait_for("template re-created", lambda: template_uid(cluster, ns, name) not in ("", first), timeout=30)
