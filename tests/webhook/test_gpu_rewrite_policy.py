"""GPU pod rewrite policy: AdmissionReview fixtures in, patched pod out (patch applied with jsonpatch)."""

from __future__ import annotations

import dataclasses

import pytest
from review_fixtures import apply, container, pod, request, review

from gatekeeper.kube.admission import response
from gatekeeper.webhook.gpu import policy as gpu
from gatekeeper.webhook.gpu.claims import spec_hash
from gatekeeper.webhook.settings import REWRITTEN_ANNOTATION, GpuSettings

DRA = GpuSettings(default_mode="dra")


def run(obj, settings: GpuSettings = DRA, **kw):  # type: ignore[no-untyped-def]
    doc = review(obj, kind="Pod", **kw)
    req = request(doc)
    assert gpu.handles(req, settings)
    d = gpu.review(req, settings)
    resp = response(req.uid, d)
    return d, resp, apply(obj, resp)


def claims_of(c):  # type: ignore[no-untyped-def]
    return [x["name"] for x in c.get("resources", {}).get("claims", [])]


def test_dra_single_gpu_container_becomes_claim_and_loses_nvidia_gpu() -> None:
    d, resp, out = run(pod(container("main", 1, extra={"cpu": "2"})))
    c = out["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"cpu": "2"}
    assert claims_of(c) == ["gpu-main"]
    (rc,) = out["spec"]["resourceClaims"]
    assert rc["name"] == "gpu-main" and rc["resourceClaimTemplateName"] == gpu.template_name(DRA, "dra", 1)
    (tmpl,) = d.templates
    assert tmpl["apiVersion"] == "resource.k8s.io/v1" and tmpl["kind"] == "ResourceClaimTemplate"
    assert tmpl["metadata"] == {"name": rc["resourceClaimTemplateName"], "namespace": "team-a",
                                "labels": {"app.kubernetes.io/managed-by": "gatekeeper"},
                                "annotations": {"gatekeeper.dev/spec-hash": spec_hash(tmpl["spec"])}}
    devices = tmpl["spec"]["spec"]["devices"]
    # A whole GPU: exclusive devices or memory-shared ones (whose default is all of it), never a share count.
    assert devices["requests"] == [{"name": "gpu", "exactly": {
        "deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1, "selectors": [{"cel": {
            "expression": '!device.allowMultipleAllocations || !("shares" in device.capacity["gpu.nvidia.com"])'}}]}}]
    assert "constraints" not in devices and "config" not in devices
    assert out["metadata"]["annotations"][REWRITTEN_ANNOTATION] == "dra main:1->gpu-main"
    r = resp["response"]
    assert r["auditAnnotations"]["gpu-mode"] == "dra"
    assert r["warnings"] and all(len(w) <= 120 for w in r["warnings"])


def test_multi_gpu_claim_gets_topology_match_attribute() -> None:
    d, _, out = run(pod(container("main", "4", where="both")))
    c = out["spec"]["containers"][0]
    assert "limits" not in c["resources"] and "requests" not in c["resources"]
    devices = d.templates[0]["spec"]["spec"]["devices"]
    assert devices["requests"][0]["exactly"]["count"] == 4
    assert devices["constraints"] == [
        {"requests": ["gpu"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}]


def test_patch_escapes_slash_in_resource_name() -> None:
    d, _, _ = run(pod(container("main", 1, extra={"cpu": "1"})))
    assert any(op["path"].endswith("/nvidia.com~1gpu") for op in d.patch)


def test_regular_init_shares_the_app_claim_and_sidecar_keeps_its_own() -> None:
    init = [container("fetch", 1), container("proxy", 1, restartPolicy="Always")]
    d, _, out = run(pod(container("main", 2), container("logger"), init=init))
    claims = {rc["name"]: rc["resourceClaimTemplateName"] for rc in out["spec"]["resourceClaims"]}
    assert set(claims) == {"gpu", "gpu-proxy"}
    assert claims_of(out["spec"]["initContainers"][0]) == ["gpu"]
    assert claims_of(out["spec"]["initContainers"][1]) == ["gpu-proxy"]
    assert out["spec"]["initContainers"][1]["restartPolicy"] == "Always"
    assert claims_of(out["spec"]["containers"][0]) == ["gpu"]
    assert "resources" not in out["spec"]["containers"][1]
    counts = {t["metadata"]["name"]: t["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"]
              for t in d.templates}
    assert counts[claims["gpu"]] == 2 and counts[claims["gpu-proxy"]] == 1  # max(1, 2), not 1 + 2


@pytest.mark.parametrize(("inits", "apps", "pooled"), [
    ([1], [1], 1), ([4], [1, 1], 4), ([1, 3], [2], 3), ([2], [1, 2, 1], 4), ([1], [], 1),
])
def test_pod_claim_is_max_of_largest_init_and_sum_of_app(inits: list[int], apps: list[int], pooled: int) -> None:
    obj = pod(*[container(f"app{i}", n) for i, n in enumerate(apps)] or [container("web")],
              init=[container(f"init{i}", n) for i, n in enumerate(inits)])
    d, _, out = run(obj)
    (tmpl,) = d.templates
    assert tmpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == pooled
    assert [rc["name"] for rc in out["spec"]["resourceClaims"]] == ["gpu"]


def test_requests_without_limits_are_counted_and_removed() -> None:
    _, _, out = run(pod(container("main", 2, where="requests", extra={"memory": "1Gi"})))
    res = out["spec"]["containers"][0]["resources"]
    assert res["requests"] == {"memory": "1Gi"} and claims_of(out["spec"]["containers"][0]) == ["gpu-main"]


def test_generate_name_pod_without_name_gets_deterministic_claim_names() -> None:
    obj = pod(container("worker", 1), name="", generate_name="job-")
    d1, _, out1 = run(obj)
    _d2, _, out2 = run(obj)
    assert out1["spec"]["resourceClaims"] == out2["spec"]["resourceClaims"] == [
        {"name": "gpu-worker", "resourceClaimTemplateName": gpu.template_name(DRA, "dra", 1)}]
    assert d1.warnings == ["gatekeeper (dra): container worker: nvidia.com/gpu=1 -> DRA claim gpu-worker "
                           f"({gpu.template_name(DRA, 'dra', 1)})"]


def test_long_container_name_yields_valid_claim_name() -> None:
    name = "c" * 63
    cn = gpu.claim_name(name)
    assert len(cn) <= 63 and cn.startswith("gpu-c") and cn != gpu.claim_name("c" * 62 + "d")


@pytest.mark.parametrize("mode", ["dra", "mps-dra", "time-slicing", "mps"])
def test_rewrite_is_idempotent_on_its_own_output(mode: str) -> None:
    s = dataclasses.replace(DRA, default_mode=mode)
    main = 1 if mode == "mps" else 2  # an MPS share is one GPU (denial tested below)
    _, _, once = run(pod(container("main", main, where="both"), init=[container("i", 1, where="requests")]), s)
    d, resp, twice = run(once, s)
    assert twice == once and "patch" not in resp["response"] and d.outcome == "skipped"


def test_already_dra_pod_is_left_alone() -> None:
    obj = pod(container("main", 1), resource_claims=[{"name": "nic", "resourceClaimName": "rdma"}])
    d, resp, out = run(obj)
    assert out == obj and "patch" not in resp["response"] and d.warnings


def test_shared_names_pod_is_left_alone() -> None:
    obj = pod(container("a", 1), container("b", extra={"nvidia.com/mig-1g.5gb": "1"}))
    _, resp, out = run(obj)
    assert out == obj and "patch" not in resp["response"]


def test_pod_without_gpu_is_untouched_and_mode_off_keeps_gpu() -> None:
    _, resp, _ = run(pod(container("web", extra={"cpu": "1"})))
    assert "patch" not in resp["response"]
    obj = pod(container("main", 1), annotations={"gatekeeper.dev/gpu-mode": "off"})
    _, resp, out = run(obj)
    assert out == obj and resp["response"]["allowed"]


def test_mode_resolution_annotation_then_namespace_then_default() -> None:
    s = GpuSettings(default_mode="off", namespace_modes={"team-a": "time-slicing"})
    _, _, out = run(pod(container("m", 1)), s)
    assert out["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu.shared": "1"}
    _, _, out = run(pod(container("m", 1)), s, namespace="other")
    assert out["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    _, _, out = run(pod(container("m", 1), annotations={"gatekeeper.dev/gpu-mode": "dra"}), s)
    assert claims_of(out["spec"]["containers"][0]) == ["gpu-m"]


def test_unknown_mode_annotation_is_denied_clearly() -> None:
    d, resp, _ = run(pod(container("m", 1), annotations={"gatekeeper.dev/gpu-mode": "fast"}))
    assert not d.allowed and "gatekeeper.dev/gpu-mode must be one of" in resp["response"]["status"]["message"]


def test_fractional_gpu_count_is_denied() -> None:
    d, _, _ = run(pod(container("m", "500m")))
    assert not d.allowed and "whole number" in d.message


def test_time_slicing_renames_in_limits_and_requests_and_adds_limits_when_missing() -> None:
    s = GpuSettings(default_mode="time-slicing")
    obj = pod(container("a", 2, where="both", extra={"cpu": "1"}), container("b", 1, where="requests"))
    _, _, out = run(obj, s)
    a, b = (c["resources"] for c in out["spec"]["containers"])
    assert a["limits"] == {"cpu": "1", "nvidia.com/gpu.shared": "2"}
    assert a["requests"] == {"cpu": "1", "nvidia.com/gpu.shared": "2"}
    assert b == {"requests": {"nvidia.com/gpu.shared": "1"}, "limits": {"nvidia.com/gpu.shared": "1"}}


def test_mps_uses_configured_resource_name() -> None:
    s = GpuSettings(default_mode="mps", mps_resource="nvidia.com/gpu.mps")
    _, _, out = run(pod(container("a", 1)), s)
    assert out["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu.mps": "1"}


def test_time_slicing_and_mps_default_to_different_resource_names() -> None:
    _, _, ts = run(pod(container("a", 1)), GpuSettings(default_mode="time-slicing"))
    _, _, mps = run(pod(container("a", 1)), GpuSettings(default_mode="mps"))
    assert ts["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu.shared": "1"}
    assert mps["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu.mps": "1"}
    with pytest.raises(ValueError, match="scheduler can tell them apart"):
        GpuSettings(mps_resource="nvidia.com/gpu.shared").validate()


def test_mps_count_above_one_is_denied_with_what_to_do() -> None:
    d, _, _ = run(pod(container("a", 2)), GpuSettings(default_mode="mps"))
    assert not d.allowed and d.code == 422
    assert d.message == ("pod team-a/trainer: container a asks for nvidia.com/gpu=2 in gpu-mode mps, but an MPS "
                         "share is one GPU (the device plugin refuses more): ask for 1, or use gpu-mode dra or mps-dra "
                         "for 2 GPUs")


def test_mps_dra_template_carries_nvidia_gpuconfig() -> None:
    d, _, _out = run(pod(container("a", 1)), GpuSettings(default_mode="mps-dra"))
    (cfg,) = d.templates[0]["spec"]["spec"]["devices"]["config"]
    assert cfg == {"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}}}
    assert d.templates[0]["metadata"]["name"] != gpu.template_name(DRA, "dra", 1)


@pytest.mark.parametrize(("model", "memory", "profile"), [
    ("A100-40GB", "4Gi", "1g.5gb"),
    ("A100-40GB", "8gb", "1g.10gb"),
    ("A100-40GB", "10", "1g.10gb"),
    ("A100-40GB", "15G", "3g.20gb"),
    ("A100-40GB", "40G", "7g.40gb"),
    # 20Gi is 21.5 GB: more than a 1g.20gb holds (it was read as 20 GB before, ~7% short)
    ("A100-80GB", "20Gi", "3g.40gb"),
    ("A100-80GB", "20G", "1g.20gb"),
    ("A100-80GB", "20gb", "1g.20gb"),
    ("A100-80GB", "20", "1g.20gb"),
    ("A100-80GB", "19073Mi", "1g.20gb"),  # 19073 MiB < 20e9 bytes < 19074 MiB
    ("A100-80GB", "19074Mi", "3g.40gb"),
    ("A100-80GB", "20e9", "1g.20gb"),
    ("A100-80GB", "2000000001e1", "3g.40gb"),
    ("H100-80GB", "30Gi", "3g.40gb"),
    ("H100-94GB", "47Gi", "7g.94gb"),
    ("H100-94GB", "47G", "3g.47gb"),
    ("H100-96GB", "48Gi", "7g.96gb"),
    ("H200-141GB", "512Mi", "1g.18gb"),
    ("H200-141GB", "100Gi", "7g.141gb"),
    ("A30-24GB", "7Gi", "2g.12gb"),
    ("B200-180GB", "30Gi", "1g.45gb"),
])
def test_mig_picks_smallest_profile_that_fits(model: str, memory: str, profile: str) -> None:
    s = GpuSettings(default_mode="mig", mig_gpu_model=model)
    _, _, out = run(pod(container("m", 1), annotations={"gatekeeper.dev/gpu-memory": memory}), s)
    assert out["spec"]["containers"][0]["resources"]["limits"] == {f"nvidia.com/mig-{profile}": "1"}


def test_mig_denies_when_nothing_fits_or_memory_missing() -> None:
    s = GpuSettings(default_mode="mig", mig_gpu_model="A100-40GB")
    d, _, _ = run(pod(container("m", 1), annotations={"gatekeeper.dev/gpu-memory": "60Gi"}), s)
    assert not d.allowed and "7g.40gb" in d.message and "A100-40GB" in d.message
    d, _, _ = run(pod(container("m", 1), annotations={"gatekeeper.dev/gpu-memory": "40Gi"}), s)
    assert not d.allowed  # 42.9 GB: never rounded down into the 40 GB profile
    d, _, _ = run(pod(container("m", 1), annotations={"gatekeeper.dev/gpu-memory": "lots"}), s)
    assert not d.allowed and "like '20Gi'" in d.message
    d, _, _ = run(pod(container("m", 1)), s)
    assert not d.allowed and "gatekeeper.dev/gpu-memory" in d.message
    d, _, _ = run(pod(container("m", 1)), dataclasses.replace(s, mig_default_profile="2g.10gb"))
    assert d.allowed


def test_catalog_profile_names_match_their_memory() -> None:
    for model, profiles in gpu.MIG_CATALOG.items():
        assert profiles[-1].slices == (4 if model.startswith("A30") else 7)
        assert str(profiles[-1].memory_gb) in model
        for p in profiles:
            assert p.name == f"{p.slices}g.{p.memory_gb}gb"


def test_template_name_is_deterministic_and_depends_on_shape() -> None:
    a = gpu.template_name(DRA, "dra", 2)
    assert a == gpu.template_name(GpuSettings(default_mode="dra"), "dra", 2)
    assert a != gpu.template_name(dataclasses.replace(DRA, match_attribute="x/numa"), "dra", 2)
    assert a != gpu.template_name(DRA, "dra", 3)
    assert len(a) <= 63


def test_only_pod_create_is_handled() -> None:
    obj = pod(container("m", 1))
    assert not gpu.handles(request(review(obj, kind="Pod", operation="UPDATE", old=obj)), DRA)
    assert not gpu.handles(request(review(obj, kind="Pod")), GpuSettings(enabled=False))


MODES_AND_SETTINGS = [
    ("dra", DRA),
    ("mps-dra", GpuSettings(default_mode="mps-dra")),
    ("time-slicing", GpuSettings(default_mode="time-slicing")),
    ("mps", GpuSettings(default_mode="mps", mps_resource="nvidia.com/gpu.mps")),
    ("mig", GpuSettings(default_mode="mig", mig_gpu_model="H100-80GB")),
]
FIXTURE_PODS = {
    "limits-only": lambda: pod(container("main", 1)),
    "requests-only": lambda: pod(container("main", 2, where="requests", extra={"memory": "1Gi"})),
    "both-with-cpu": lambda: pod(container("main", 4, where="both", extra={"cpu": "2"})),
    "init-sidecar-multi": lambda: pod(container("a", 1), container("web"), container("b", 2, where="both"),
                                      init=[container("fetch", 1),
                                            container("side", 1, where="requests", restartPolicy="Always")]),
    "generate-name": lambda: pod(container("w", 1), name="", generate_name="job-"),
    "empty-claims-list": lambda: pod(container("main", 1), resource_claims=[]),
    "no-annotations": lambda: pod(container("main", 1)),
}


@pytest.mark.parametrize("fixture", sorted(FIXTURE_PODS))
@pytest.mark.parametrize(("mode", "settings"), MODES_AND_SETTINGS, ids=[m for m, _ in MODES_AND_SETTINGS])
def test_every_mode_on_every_fixture_is_a_fixed_point(mode: str, settings: GpuSettings, fixture: str) -> None:
    obj = FIXTURE_PODS[fixture]()
    obj["metadata"].setdefault("annotations", {})[gpu.MEMORY_ANNOTATION] = "9Gi"
    if mode == "mps" and any(c.count > 1 for c in gpu.gpu_containers(obj["spec"], "pod")):
        d, _, _ = run(obj, settings)
        assert not d.allowed and "an MPS share is one GPU" in d.message
        return
    d, _, once = run(obj, settings)
    assert d.outcome == "mutated", d
    containers = once["spec"]["containers"] + once["spec"].get("initContainers", [])
    assert not [c["name"] for c in containers for m in c.get("resources", {}).values()
                if isinstance(m, dict) and "nvidia.com/gpu" in m]
    assert once["metadata"]["annotations"][REWRITTEN_ANNOTATION].startswith(mode + " ")
    d2, resp2, twice = run(once, settings)
    assert "patch" not in resp2["response"] and twice == once and d2.outcome == "skipped"


def test_rewritten_pod_gets_an_injected_gpu_container_rewritten_on_reinvocation() -> None:
    _, _, once = run(pod(container("main", 2)))
    # A later mutating webhook adds a GPU sidecar; reinvocationPolicy IfNeeded calls us again.
    once["spec"]["containers"].append(container("injected", 1, extra={"cpu": "1"}))
    d, _, twice = run(once)
    assert d.outcome == "mutated"
    assert [rc["name"] for rc in twice["spec"]["resourceClaims"]] == ["gpu-main", "gpu-injected"]
    main, injected = twice["spec"]["containers"]
    assert main == once["spec"]["containers"][0]
    assert injected["resources"] == {"limits": {"cpu": "1"}, "claims": [{"name": "gpu-injected"}]}
    assert twice["metadata"]["annotations"][REWRITTEN_ANNOTATION] == (
        "dra main:2->gpu-main; dra injected:1->gpu-injected")
    _, resp, thrice = run(twice)
    assert "patch" not in resp["response"] and thrice == twice


def test_pod_with_its_own_claims_and_no_rewrite_annotation_is_still_left_alone() -> None:
    obj = pod(container("main", 1), resource_claims=[{"name": "gpu-main", "resourceClaimName": "mine"}])
    d, resp, out = run(obj)
    assert out == obj and "patch" not in resp["response"] and d.outcome == "skipped"


def test_claim_name_clash_on_reinvocation_is_denied_not_duplicated() -> None:
    obj = pod(container("main", 1), annotations={REWRITTEN_ANNOTATION: "dra x:1->gpu-x"},
              resource_claims=[{"name": "gpu-main", "resourceClaimName": "someone-elses"}])
    d, _, _ = run(obj)
    assert not d.allowed and "already has a resourceClaims entry of that name" in d.message


def test_generate_name_pod_is_named_by_its_prefix_in_denials() -> None:
    s = GpuSettings(default_mode="mig")
    d, _, _ = run(pod(container("w", 1), name="", generate_name="job-"), s)
    assert not d.allowed and d.message.startswith("pod team-a/job-* uses gpu-mode mig")


def test_mig_catalog_is_nvidias_published_profile_table() -> None:
    # NVIDIA MIG User Guide, "Supported MIG Profiles" (without the +me media-extension variants).
    published = {
        "A100-40GB": "1g.5gb 1g.10gb 2g.10gb 3g.20gb 4g.20gb 7g.40gb",
        "A100-80GB": "1g.10gb 1g.20gb 2g.20gb 3g.40gb 4g.40gb 7g.80gb",
        "H100-80GB": "1g.10gb 1g.20gb 2g.20gb 3g.40gb 4g.40gb 7g.80gb",
        "H100-94GB": "1g.12gb 1g.24gb 2g.24gb 3g.47gb 4g.47gb 7g.94gb",
        "H100-96GB": "1g.12gb 1g.24gb 2g.24gb 3g.48gb 4g.48gb 7g.96gb",
        "H200-141GB": "1g.18gb 1g.35gb 2g.35gb 3g.71gb 4g.71gb 7g.141gb",
        "A30-24GB": "1g.6gb 2g.12gb 4g.24gb",
        "B200-180GB": "1g.23gb 1g.45gb 2g.45gb 3g.90gb 4g.90gb 7g.180gb",
        # NVIDIA/mig-parted deployments/systemd/config-default.yaml, "GB200 HGX" (the guide's page in the
        # search index stops before its GB200 table).
        "GB200-186GB": "1g.23gb 1g.47gb 2g.47gb 3g.93gb 4g.93gb 7g.186gb",
    }
    assert {m: " ".join(p.name for p in ps) for m, ps in gpu.MIG_CATALOG.items()} == published


@pytest.mark.parametrize(("quantity", "count"), [("1000m", 1), ("2e0", 2), ("+1", 1), ("01", 1), ("3", 3), (2, 2)])
def test_gpu_counts_are_read_as_the_apiserver_reads_quantities(quantity: str | int, count: int) -> None:
    d, _, out = run(pod(container("main", quantity)))
    counts = [t["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] for t in d.templates]
    assert d.allowed and counts == [count]
    assert "nvidia.com/gpu" not in str(out["spec"]["containers"][0].get("resources", {}))


@pytest.mark.parametrize("quantity", ["1e3", "1k", "1Ki"])
def test_a_large_valid_count_is_not_called_a_fraction_and_mode_off_leaves_it_alone(quantity: str) -> None:
    off = dataclasses.replace(DRA, default_mode="off")
    d, _, _ = run(pod(container("main", quantity)), off)
    assert d.allowed and d.outcome == "skipped"


@pytest.mark.parametrize("quantity", ["1_0", "\u0661", "1.5", "500m", "-1", "1e999999999", "", True, 1.0])
def test_gpu_counts_the_apiserver_would_refuse_are_denied(quantity: object) -> None:
    req = request(review(pod(container("main", quantity)), kind="Pod"))  # type: ignore[arg-type]
    d = gpu.review(req, DRA)
    assert not d.allowed and d.code == 422 and "nvidia.com/gpu must" in d.message
