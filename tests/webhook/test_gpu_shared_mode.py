"""``shared`` mode (DRA consumable capacity), memory quantities, and alignment only where it can hold."""

from __future__ import annotations

import dataclasses

import pytest
from review_fixtures import apply, container, pod, request, review

from gatekeeper.kube.admission import response
from gatekeeper.webhook.gpu import policy as gpu
from gatekeeper.webhook.gpu.sizing import mib_quantity, parse_quantity_bytes
from gatekeeper.webhook.settings import REWRITTEN_ANNOTATION, GpuSettings

SHARED = GpuSettings(default_mode="shared")
MEM = "gatekeeper.dev/gpu-memory"


def run(obj, settings: GpuSettings = SHARED, **kw):  # type: ignore[no-untyped-def]
    req = request(review(obj, kind="Pod", **kw))
    d = gpu.review(req, settings)
    return d, apply(obj, response(req.uid, d))


def test_shared_pod_becomes_claim_asking_for_its_memory_as_consumable_capacity() -> None:
    d, out = run(pod(container("server", 1), annotations={MEM: "20Gi"}))
    assert d.outcome == "mutated"
    (rc,) = out["spec"]["resourceClaims"]
    (tmpl,) = d.templates
    assert rc == {"name": "gpu-server", "resourceClaimTemplateName": tmpl["metadata"]["name"]}
    assert tmpl["metadata"]["name"].startswith("gatekeeper-gpu-shared-1-")
    (req,) = tmpl["spec"]["spec"]["devices"]["requests"]
    # Only devices that can be shared: the allocator gives a memory ask an exclusive GPU whole otherwise.
    assert req["exactly"] == {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1,
                              "capacity": {"requests": {"memory": "20480Mi"}},
                              "selectors": [{"cel": {"expression": "device.allowMultipleAllocations"}}]}
    assert out["metadata"]["annotations"][REWRITTEN_ANNOTATION] == "shared server:1->gpu-server@20480Mi"


def test_shared_pods_of_different_memory_get_different_templates_and_equal_ones_share() -> None:
    a, _ = run(pod(container("s", 1), annotations={MEM: "10Gi"}))
    b, _ = run(pod(container("s", 1), annotations={MEM: "16Gi"}))
    c, _ = run(pod(container("t", 1), annotations={MEM: "10240Mi"}))
    names = [x.templates[0]["metadata"]["name"] for x in (a, b, c)]
    assert names[0] != names[1] and names[0] == names[2]


def test_shared_memory_falls_back_to_namespace_then_configured_default() -> None:
    s = dataclasses.replace(SHARED, namespace_gpu_memory={"team-a": "12Gi"}, shared_default_memory="4Gi")
    d, _ = run(pod(container("s", 1)), s)
    assert d.templates[0]["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"] == {
        "requests": {"memory": "12288Mi"}}
    d, _ = run(pod(container("s", 1)), s, namespace="other")
    assert d.templates[0]["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"] == {
        "requests": {"memory": "4096Mi"}}
    d, _ = run(pod(container("s", 1), annotations={MEM: "1Gi"}), s)
    assert d.templates[0]["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"] == {
        "requests": {"memory": "1024Mi"}}


def test_shared_pod_without_any_memory_is_denied_with_the_fix() -> None:
    d, _ = run(pod(container("s", 1)))
    assert not d.allowed and d.code == 422
    assert "gpu-mode shared but says no GPU memory" in d.message and "gatekeeper.dev/gpu-memory" in d.message


@pytest.mark.parametrize("bad", ["lots", "-4Gi", "0", "20GB", "1.2.3Gi"])
def test_shared_pod_with_bad_memory_is_denied_naming_the_annotation(bad: str) -> None:
    d, _ = run(pod(container("s", 1), annotations={MEM: bad}))
    assert not d.allowed and "annotation gatekeeper.dev/gpu-memory" in d.message


@pytest.mark.parametrize(("text", "nbytes"), [
    ("20Gi", 20 * 2**30), ("20G", 20 * 10**9), ("512Mi", 512 * 2**20), ("1e9", 10**9),
    ("1500m", 2), ("0.5Gi", 2**29), ("16000M", 16 * 10**9), ("3k", 3000), ("1Ti", 2**40),
])
def test_quantities_read_binary_decimal_and_milli_units_exactly(text: str, nbytes: int) -> None:
    assert parse_quantity_bytes(text) == nbytes


def test_memory_requests_round_up_to_whole_mib_never_down() -> None:
    assert mib_quantity(20 * 10**9) == "19074Mi"  # 19073.49 MiB: one MiB more, not less
    assert mib_quantity(2**30) == "1024Mi"
    assert mib_quantity(1) == "1Mi"


def test_shared_rewrite_is_a_fixed_point() -> None:
    d, once = run(pod(container("s", 1), init=[container("side", 1, restartPolicy="Always")],
                      annotations={MEM: "8Gi"}))
    assert d.outcome == "mutated"
    d2, twice = run(once)
    assert d2.outcome == "skipped" and twice == once


@pytest.mark.parametrize(("count", "constrained"), [(1, False), (2, True), (4, True), (5, False), (8, False)])
def test_alignment_constraint_only_up_to_align_up_to(count: int, constrained: bool) -> None:
    d, _ = run(pod(container("m", count)), GpuSettings(default_mode="dra"))
    devices = d.templates[0]["spec"]["spec"]["devices"]
    assert ("constraints" in devices) is constrained
    assert devices["requests"][0]["exactly"]["count"] == count


def test_align_up_to_is_configurable_and_changes_the_template_name() -> None:
    wide = GpuSettings(default_mode="dra", align_up_to=8)
    d, _ = run(pod(container("m", 8)), wide)
    assert d.templates[0]["spec"]["spec"]["devices"]["constraints"] == [
        {"requests": ["gpu"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}]
    assert gpu.template_name(wide, "dra", 8) != gpu.template_name(GpuSettings(), "dra", 8)


def test_settings_reject_bad_shared_defaults_and_align_up_to() -> None:
    with pytest.raises(ValueError, match=r"namespaceGpuMemory\.ml"):
        GpuSettings(namespace_gpu_memory={"ml": "big"}).validate()
    with pytest.raises(ValueError, match="sharedDefaultMemory"):
        GpuSettings(shared_default_memory="-1Gi").validate()
    with pytest.raises(ValueError, match="alignUpTo"):
        GpuSettings(align_up_to=0).validate()


ENFORCED = GpuSettings(default_mode="dra", namespace_modes={"team-a": "shared"}, enforced_namespaces=["team-a"],
                       opt_out_groups=["gpu-admins"], shared_default_memory="8Gi")


def _as(obj, groups):  # type: ignore[no-untyped-def]
    doc = review(obj, kind="Pod")
    doc["request"]["userInfo"]["groups"] = groups
    req = request(doc)
    d = gpu.review(req, ENFORCED)
    return d, apply(obj, response(req.uid, d)) if d.allowed else None


def test_enforced_namespace_denies_a_conflicting_mode_annotation_clearly() -> None:
    d, _ = _as(pod(container("m", 1), annotations={"gatekeeper.dev/gpu-mode": "off"}), ["system:authenticated"])
    assert not d.allowed and d.code == 403
    assert d.message == ("namespace team-a enforces gpu-mode shared; the pod's annotation gatekeeper.dev/gpu-mode: "
                         "off is not allowed here (only members of gpu-admins may opt out): remove the annotation "
                         "or set it to shared")


def test_enforced_namespace_applies_its_mode_and_records_the_decision() -> None:
    for ann in ({}, {"gatekeeper.dev/gpu-mode": "shared"}):
        d, out = _as(pod(container("m", 1), annotations=dict(ann)), ["dev"])
        assert d.allowed and out is not None
        assert out["metadata"]["annotations"]["gatekeeper.dev/gpu-decision"] == "mode=shared source=enforced"
        assert d.audit["gpu-mode-source"] == "enforced"


def test_a_decision_annotation_the_pod_brought_is_replaced_by_the_real_decision() -> None:
    """The pod's creator writes its annotations: one that came with "mode=shared source=enforced" kept it while
    the pod was rewritten by opt-out to dra, so the record said the opposite of what happened."""
    forged = {"gatekeeper.dev/gpu-mode": "dra", "gatekeeper.dev/gpu-decision": "mode=shared source=enforced"}
    d, out = _as(pod(container("m", 1), annotations=forged), ["gpu-admins"])
    assert d.allowed and out is not None
    assert out["metadata"]["annotations"]["gatekeeper.dev/gpu-decision"] == "mode=dra source=opt-out"


def test_opt_out_group_may_choose_another_mode_and_it_is_recorded() -> None:
    d, out = _as(pod(container("m", 1), annotations={"gatekeeper.dev/gpu-mode": "dra"}), ["gpu-admins"])
    assert d.allowed and out is not None
    assert out["metadata"]["annotations"]["gatekeeper.dev/gpu-decision"] == "mode=dra source=opt-out"
    d, _ = _as(pod(container("m", 1), annotations={"gatekeeper.dev/gpu-mode": "off"}), ["gpu-admins"])
    assert d.allowed and d.audit == {"gpu-mode": "off", "gpu-mode-source": "opt-out"}


def test_without_enforcement_the_annotation_still_wins_and_says_so() -> None:
    s = dataclasses.replace(ENFORCED, enforced_namespaces=[])
    req = request(review(pod(container("m", 1), annotations={"gatekeeper.dev/gpu-mode": "dra"}), kind="Pod"))
    d = gpu.review(req, s)
    assert d.allowed and d.audit["gpu-mode-source"] == "annotation"


@pytest.mark.parametrize("own", ["claim", "container claim", "shared resource"])
def test_enforced_namespace_denies_whole_gpus_beside_the_pods_own_claims_or_shares(own: str) -> None:
    """One claim or shared GPU of the pod's own made the webhook skip it and keep nvidia.com/gpu: 8 whole GPUs."""
    gpus = container("m", 8)
    other = container("side")
    claims = None
    if own == "claim":
        claims = [{"name": "nic", "resourceClaimTemplateName": "rdma-nic"}]
    elif own == "container claim":
        other["resources"] = {"claims": [{"name": "nic"}]}
        claims = [{"name": "nic", "resourceClaimTemplateName": "rdma-nic"}]
    else:
        other["resources"] = {"limits": {"nvidia.com/gpu.shared": "1"}}
    d, _ = _as(pod(gpus, other, resource_claims=claims), ["dev"])
    assert not d.allowed and d.code == 403 and d.audit["gpu-mode-source"] == "enforced"
    assert "enforces gpu-mode shared" in d.message and "nvidia.com/gpu" in d.message
    # Outside enforcement such a pod is still left as it is, with a warning (the pod chose its own way).
    s = dataclasses.replace(ENFORCED, enforced_namespaces=[])
    req = request(review(pod(gpus, other, resource_claims=claims), kind="Pod"))
    d = gpu.review(req, s)
    assert d.allowed and d.outcome == "skipped" and d.warnings
    # An opt-out member may still bring their own.
    d, _ = _as(pod(gpus, other, resource_claims=claims, annotations={"gatekeeper.dev/gpu-mode": "dra"}),
               ["gpu-admins"])
    assert d.allowed and d.outcome == "skipped"


@pytest.mark.parametrize("memory", ["1e999", "1e19", "1e9999999", "99999999999999999999999999999999999999Ei"])
def test_absurd_gpu_memory_is_denied_with_a_message_not_an_error(memory: str) -> None:
    """An annotation is any string the user likes; 1e999 overflowed the MiB rounding and became a 500."""
    req = request(review(pod(container("m", 1), annotations={"gatekeeper.dev/gpu-memory": memory}), kind="Pod"))
    d = gpu.review(req, GpuSettings(default_mode="shared"))
    assert not d.allowed and d.code == 422 and "gpu-memory" in d.message
