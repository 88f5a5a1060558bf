"""MIG per node pool: sizing only from the profiles a pool's layout creates, and the pod kept on those pools."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from review_fixtures import apply, container, pod, request, review

from gatekeeper.base.config import ConfigError, load_config
from gatekeeper.kube.admission import response
from gatekeeper.webhook.gpu import policy as gpu
from gatekeeper.webhook.gpu.sizing import layout_profiles
from gatekeeper.webhook.settings import GpuSettings, MigPool

LABEL = "nvidia.com/gpu.product"
A100_40 = MigPool(name="a100-40", label_value="NVIDIA-A100-SXM4-40GB", gpu_model="A100-40GB", layout="all-balanced")
H100_80 = MigPool(name="h100-80", label_value="NVIDIA-H100-80GB-HBM3", gpu_model="H100-80GB", layout="all-balanced")
A100_80_SMALL = MigPool(name="a100-80-1g", label_value="NVIDIA-A100-SXM4-80GB", gpu_model="A100-80GB",
                        profiles=["1g.10gb", "1g.20gb"])
POOLS = GpuSettings(default_mode="mig", mig_pools=[A100_40, H100_80])


def run(obj: dict[str, Any], settings: GpuSettings = POOLS) -> tuple[Any, dict[str, Any]]:
    req = request(review(obj, kind="Pod"))
    d = gpu.review(req, settings)
    return d, apply(obj, response(req.uid, d))


def mig_pod(memory: str | None, count: int = 1, **spec: Any) -> dict[str, Any]:
    obj = pod(container("m", count), annotations={"gatekeeper.dev/gpu-memory": memory} if memory else {})
    obj["spec"].update(spec)
    return obj


def limits(out: dict[str, Any]) -> dict[str, str]:
    return out["spec"]["containers"][0]["resources"]["limits"]


def test_all_balanced_layouts_are_mig_parteds() -> None:
    assert layout_profiles("A100-40GB", "all-balanced") == ("1g.5gb", "2g.10gb", "3g.20gb")
    assert layout_profiles("GB200-186GB", "all-balanced") == ("1g.23gb", "2g.47gb", "3g.93gb")
    assert layout_profiles("H100-80GB", "all-1g.10gb") == ("1g.10gb",)
    with pytest.raises(ValueError, match="all-balanced or all-<profile>"):
        layout_profiles("H100-80GB", "all-2g.10gb")  # a 40 GB card's profile


@pytest.mark.parametrize(("memory", "profile", "pool"), [
    ("15Gi", "2g.20gb", H100_80),       # 16.1 GB: A100-40 offers 3g.20gb, H100 2g.20gb (fewer slices)
    ("4Gi", "1g.5gb", A100_40),         # 4.3 GB
    ("5G", "1g.5gb", A100_40),          # exactly 5 GB fits 5 GB
    ("5Gi", "1g.10gb", H100_80),        # 5.37 GB: never rounded down into 1g.5gb
    ("10Gi", "2g.20gb", H100_80),       # 10.7 GB > 2g.10gb's 10 GB; A100-40's all-balanced has no 1g.10gb
    ("30Gi", "3g.40gb", H100_80),
])
def test_one_pool_offers_the_smallest_fitting_profile_and_gets_a_node_selector(memory, profile, pool) -> None:  # type: ignore[no-untyped-def]
    d, out = run(mig_pod(memory))
    assert d.allowed, d.message
    assert limits(out) == {f"nvidia.com/mig-{profile}": "1"}
    assert out["spec"]["nodeSelector"] == {LABEL: pool.label_value}
    assert "affinity" not in out["spec"]
    assert f"pools={pool.name}" in out["metadata"]["annotations"]["gatekeeper.dev/gpu-rewritten"]


def test_layout_not_the_catalog_decides() -> None:
    # A100-40GB has 1g.10gb in the catalog, but all-balanced does not create it: 6Gi gets 2g.10gb.
    _, out = run(mig_pod("6Gi"), dataclasses.replace(POOLS, mig_pools=[A100_40]))
    assert limits(out) == {"nvidia.com/mig-2g.10gb": "1"}


def test_pools_offering_the_same_profile_share_one_node_affinity_term() -> None:
    s = dataclasses.replace(POOLS, mig_pools=[A100_40, H100_80, A100_80_SMALL])
    _, out = run(mig_pod("8Gi"), s)  # 8.6 GB: 1g.10gb, on H100 (all-balanced) and on the A100-80 1g pool
    assert limits(out) == {"nvidia.com/mig-1g.10gb": "1"}
    assert "nodeSelector" not in out["spec"]
    term = out["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term == {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": LABEL, "operator": "In", "values": sorted([H100_80.label_value, A100_80_SMALL.label_value])}]}]}


def test_reinvocation_does_not_repeat_the_affinity_expression() -> None:
    s = dataclasses.replace(POOLS, mig_pools=[H100_80, A100_80_SMALL])
    _, out = run(mig_pod("8Gi"), s)
    out["spec"]["containers"].append(container("injected", 1))  # a later webhook adds a GPU container
    d, again = run(out, s)
    assert d.outcome == "mutated"
    assert again["spec"]["containers"][1]["resources"]["limits"] == {"nvidia.com/mig-1g.10gb": "1"}
    assert again["spec"]["affinity"] == out["spec"]["affinity"]


def test_existing_required_affinity_terms_are_narrowed_not_widened() -> None:
    s = dataclasses.replace(POOLS, mig_pools=[H100_80, A100_80_SMALL])
    zone = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [zone]}, {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}]}}}
    _, out = run(mig_pod("8Gi", affinity=affinity), s)
    terms = out["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert len(terms) == 2
    assert terms[0]["matchExpressions"][0] == zone and terms[0]["matchExpressions"][1]["key"] == LABEL
    assert terms[1]["matchExpressions"][0]["key"] == LABEL and terms[1]["matchFields"]


def test_a_pinned_product_is_sized_for_its_pool_only() -> None:
    # 15Gi would go to H100 (2g.20gb); pinned to the A100-40 pool it gets that pool's 3g.20gb.
    _, out = run(mig_pod("15Gi", nodeSelector={LABEL: A100_40.label_value, "zone": "a"}))
    assert limits(out) == {"nvidia.com/mig-3g.20gb": "1"}
    assert out["spec"]["nodeSelector"] == {LABEL: A100_40.label_value, "zone": "a"}
    d, _ = run(mig_pod("25Gi", nodeSelector={LABEL: A100_40.label_value}))
    assert not d.allowed and "pool a100-40" in d.message and "3g.20gb" in d.message
    d, _ = run(mig_pod("1Gi", nodeSelector={LABEL: "NVIDIA-L4"}))
    assert not d.allowed and "no MIG pool has that value" in d.message and "a100-40=NVIDIA-A100-SXM4-40GB" in d.message


def test_a_request_no_pool_fits_is_denied_with_what_the_pools_offer() -> None:
    d, _ = run(mig_pod("41G"))  # more than H100 all-balanced's 3g.40gb and A100-40's 3g.20gb
    assert not d.allowed and d.code == 422
    assert "41G (41.0 GB)" in d.message and "any MIG pool" in d.message
    assert "h100-80 (H100-80GB): 1g.10gb, 2g.20gb, 3g.40gb" in d.message and "gpu-mode dra" in d.message


def test_all_gpu_containers_get_one_profile_and_the_count_is_kept() -> None:
    obj = pod(container("a", 2), container("b", 1), annotations={"gatekeeper.dev/gpu-memory": "15Gi"})
    _, out = run(obj)
    assert [c["resources"]["limits"] for c in out["spec"]["containers"]] == [
        {"nvidia.com/mig-2g.20gb": "2"}, {"nvidia.com/mig-2g.20gb": "1"}]


def test_default_profile_goes_to_the_pools_that_offer_it() -> None:
    s = dataclasses.replace(POOLS, mig_default_profile="3g.20gb")
    _, out = run(mig_pod(None), s)
    assert limits(out) == {"nvidia.com/mig-3g.20gb": "1"}
    assert out["spec"]["nodeSelector"] == {LABEL: A100_40.label_value}


def test_without_pools_nothing_is_pinned() -> None:
    _, out = run(mig_pod("15Gi"), GpuSettings(default_mode="mig"))
    assert limits(out) == {"nvidia.com/mig-3g.20gb": "1"} and "nodeSelector" not in out["spec"]


def test_rewrite_is_a_fixed_point() -> None:
    _, out = run(mig_pod("15Gi"))
    d, again = run(out)
    assert d.outcome == "skipped" and again == out


@pytest.mark.parametrize(("pools", "error"), [
    ("[{name: a, labelValue: X, gpuModel: A100-40GB}]", "exactly one of layout"),
    ("[{name: a, labelValue: X, gpuModel: A100-40GB, profiles: [1g.10gb, 3g.40gb]}]", "3g.40gb is not a A100-40GB"),
    ("[{name: a, labelValue: X, gpuModel: T4, layout: all-balanced}]", "gpuModel 'T4' is unknown"),
    ("[{name: a, gpuModel: A100-40GB, layout: all-balanced}]", "labelValue are required"),
    ("[{name: a, labelValue: X, gpuModel: A100-40GB, layout: all-balanced},"
     " {name: b, labelValue: X, gpuModel: H100-80GB, layout: all-balanced}]", "its own name and labelValue"),
])
def test_bad_pool_config_is_refused_with_the_key(tmp_path: Path, pools: str, error: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(f"webhook:\n  gpu:\n    migPools: {pools}\n")
    with pytest.raises(ConfigError, match=error):
        load_config(f, need="webhook")


def test_pool_config_loads_from_yaml(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("webhook:\n  gpu:\n    migPoolLabel: example.com/gpu\n    migDefaultProfile: 1g.23gb\n"
                 "    migPools:\n"
                 "    - {name: gb, labelValue: NVIDIA-GB200, gpuModel: GB200-186GB, layout: all-balanced}\n")
    s = load_config(f, need="webhook").webhook.gpu
    assert s.mig_pool_label == "example.com/gpu"
    assert s.mig_pools[0].allowed() == ("1g.23gb", "2g.47gb", "3g.93gb")


MIG_DRA = GpuSettings(default_mode="mig-dra", mig_gpu_model="H100-80GB")


@pytest.mark.parametrize(("memory", "profile"), [("15Gi", "1g.20gb"), ("10G", "1g.10gb"), ("25Gi", "3g.40gb")])
def test_mig_dra_claims_a_partition_of_the_smallest_fitting_profile_by_cel(memory: str, profile: str) -> None:
    d, out = run(mig_pod(memory, count=2), MIG_DRA)
    assert d.allowed, d.message
    c = out["spec"]["containers"][0]
    assert "limits" not in c["resources"] and c["resources"]["claims"] == [{"name": "gpu-m"}]
    (tmpl,) = d.templates
    exactly = tmpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    cel = f'device.attributes["gpu.nvidia.com"].profile == "{profile}"'
    assert exactly == {"deviceClassName": "mig.nvidia.com", "allocationMode": "ExactCount", "count": 2,
                       "selectors": [{"cel": {"expression": cel}}]}
    assert "constraints" not in tmpl["spec"]["spec"]["devices"]
    assert "nodeSelector" not in out["spec"]  # the scheduler finds partitions by attribute, on any node


def test_mig_dra_templates_differ_by_profile_and_deny_what_no_profile_holds() -> None:
    a, _ = run(mig_pod("15Gi"), MIG_DRA)
    b, _ = run(mig_pod("25Gi"), MIG_DRA)
    assert a.templates[0]["metadata"]["name"] != b.templates[0]["metadata"]["name"]
    d, _ = run(mig_pod("81G"), MIG_DRA)
    assert not d.allowed and "7g.80gb" in d.message
    d, _ = run(mig_pod(None), MIG_DRA)
    assert not d.allowed and "gpu-mode mig-dra" in d.message and "H100-80GB MIG profile" in d.message
