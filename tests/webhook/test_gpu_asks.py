"""GPU asks as people write them: shares, first-available fallbacks, model choice, HAMi's resource names (pure)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from review_fixtures import apply, container, pod, request, review

from gatekeeper.kube.admission import response
from gatekeeper.webhook.gpu import policy as gpu
from gatekeeper.webhook.gpu.models import GpuModel
from gatekeeper.webhook.settings import DECISION_ANNOTATION, REWRITTEN_ANNOTATION, GpuSettings

MEM = "gatekeeper.dev/gpu-memory"
MODE = "gatekeeper.dev/gpu-mode"
MODELS = "gatekeeper.dev/gpu-models"
FALLBACKS = "gatekeeper.dev/gpu-fallbacks"
SHAREABLE = "device.allowMultipleAllocations"
COUNTED = 'device.allowMultipleAllocations && "shares" in device.capacity["gpu.nvidia.com"]'
WHOLE = '!device.allowMultipleAllocations || !("shares" in device.capacity["gpu.nvidia.com"])'
H100 = 'device.attributes["gpu.nvidia.com"].productName in ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"]'
A100_40 = 'device.attributes["gpu.nvidia.com"].productName in ["NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"]'
FLEET = GpuSettings(gpu_models=[GpuModel("A100-40GB", ["NVIDIA A100-SXM4-40GB"], "40Gi"),
                                GpuModel("H100-80GB", ["NVIDIA H100 80GB HBM3"], "80Gi")])
"""The sandbox's mixed fleet as an operator would list it."""


DEFAULT = GpuSettings()


def run(obj: dict[str, Any], settings: GpuSettings = DEFAULT, namespace: str = "team-a") -> Any:
    req = request(review(obj, kind="Pod", namespace=namespace))
    d = gpu.review(req, settings)
    return d, apply(obj, response(req.uid, d))


def request_of(d: Any) -> dict[str, Any]:
    (tmpl,) = d.templates
    (req,) = tmpl["spec"]["spec"]["devices"]["requests"]
    return req


def cel(body: dict[str, Any]) -> list[str]:
    return [s["cel"]["expression"] for s in body.get("selectors", [])]


def hami(name: str, **limits: str | int) -> dict[str, Any]:
    return {"name": name, "image": "x", "resources": {"limits": {f"nvidia.com/{k.replace('_', '-')}": v
                                                                for k, v in limits.items()}}}


# --- shares ---------------------------------------------------------------------------------------------------

def test_shares_mode_asks_one_share_of_a_gpu_that_publishes_a_count() -> None:
    d, out = run(pod(container("srv", 1), annotations={MODE: "shares"}))
    body = request_of(d)["exactly"]
    assert body["capacity"] == {"requests": {"shares": "1"}} and cel(body) == [COUNTED]
    assert out["spec"]["resourceClaims"][0]["resourceClaimTemplateName"].startswith("gatekeeper-gpu-shares-1-")


def test_shares_per_pod_is_a_setting_and_memory_is_accounted_too() -> None:
    s = dataclasses.replace(GpuSettings(), shares_per_pod=2)
    d, _ = run(pod(container("srv", 1), annotations={MODE: "shares", MEM: "8Gi"}), s)
    assert request_of(d)["exactly"]["capacity"] == {"requests": {"shares": "2", "memory": "8192Mi"}}


# --- first-available --------------------------------------------------------------------------------------------

def test_fallbacks_become_prioritized_sub_requests_in_the_order_written() -> None:
    d, out = run(pod(container("srv", 1), annotations={FALLBACKS: "mig-dra,shared,dra", MEM: "9Gi"}))
    req = request_of(d)
    assert "exactly" not in req
    subs = req["firstAvailable"]
    assert [s["name"] for s in subs] == ["mig-dra", "shared", "dra"]
    assert subs[0]["deviceClassName"] == "mig.nvidia.com"
    assert cel(subs[0]) == ['device.attributes["gpu.nvidia.com"].profile == "1g.10gb"']
    assert subs[1]["capacity"] == {"requests": {"memory": "9216Mi"}} and cel(subs[1]) == [SHAREABLE]
    assert cel(subs[2]) == [WHOLE] and "capacity" not in subs[2]
    # the annotation alone chose the mode, and said so
    assert out["metadata"]["annotations"][DECISION_ANNOTATION] == "mode=first-available source=annotation"
    assert out["metadata"]["annotations"][REWRITTEN_ANNOTATION] == \
        "first-available srv:1->gpu-srv@{mig-dra,shared,dra}"


def test_fallbacks_setting_serves_first_available_pods_without_the_annotation() -> None:
    s = dataclasses.replace(GpuSettings(), fallbacks=["shares", "dra"])
    d, _ = run(pod(container("srv", 1), annotations={MODE: "first-available"}), s)
    assert [x["name"] for x in request_of(d)["firstAvailable"]] == ["shares", "dra"]


def test_mps_config_goes_to_its_sub_request_only() -> None:
    d, _ = run(pod(container("srv", 1), annotations={FALLBACKS: "shared,mps-dra", MEM: "4Gi"}))
    (config,) = d.templates[0]["spec"]["spec"]["devices"]["config"]
    assert config["requests"] == ["gpu/mps-dra"]
    assert config["opaque"]["parameters"]["sharing"] == {"strategy": "MPS"}


def test_a_way_that_cannot_serve_the_pod_is_left_out_with_a_warning() -> None:
    d, _ = run(pod(container("srv", 1), annotations={FALLBACKS: "shared,dra"}))  # no memory: no shared way
    assert request_of(d)["exactly"]["count"] == 1 and cel(request_of(d)["exactly"]) == [WHOLE]
    assert any("way shared left out" in w for w in d.warnings)


def test_when_no_way_can_serve_the_pod_it_is_denied_with_each_reason() -> None:
    d, _ = run(pod(container("srv", 1), annotations={FALLBACKS: "shared"}))
    assert not d.allowed and "no way of shared can serve it" in d.message
    assert "says no GPU memory" in d.message


@pytest.mark.parametrize("text", ["mig-dra,gpu-sharing", "shared,shared", "", "mig"])
def test_a_fallback_list_naming_an_unknown_way_is_denied_with_the_known_ones(text: str) -> None:
    d, _ = run(pod(container("srv", 1), annotations={FALLBACKS: text}))
    assert not d.allowed and d.code == 422
    assert "mig-dra, shared, shares, mps-dra, dra" in d.message
    assert d.audit["gpu-denied-reason"] == "unknown-fallback"


def test_a_multi_gpu_fallback_claim_keeps_its_alignment_for_every_way() -> None:
    d, _ = run(pod(container("srv", 2), annotations={FALLBACKS: "shared,dra", MEM: "10Gi"}))
    devices = d.templates[0]["spec"]["spec"]["devices"]
    assert devices["constraints"] == [{"requests": ["gpu"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}]
    assert [s["count"] for s in devices["requests"][0]["firstAvailable"]] == [2, 2]


# --- model choice ------------------------------------------------------------------------------------------------

def test_named_models_become_a_product_selector() -> None:
    d, out = run(pod(container("srv", 1), annotations={MODE: "dra", MODELS: "H100-80GB"}))
    assert cel(request_of(d)["exactly"]) == [WHOLE, H100]
    assert "models=H100-80GB" in out["metadata"]["annotations"][REWRITTEN_ANNOTATION]


def test_a_minimum_memory_chooses_every_model_with_at_least_that_much() -> None:
    d, _ = run(pod(container("srv", 1), annotations={MODE: "dra", MODELS: ">=80Gi"}), FLEET)
    assert cel(request_of(d)["exactly"])[1] == 'device.attributes["gpu.nvidia.com"].productName in ' \
                                               '["NVIDIA H100 80GB HBM3"]'


def test_the_namespace_default_applies_and_the_annotation_overrides_it() -> None:
    s = dataclasses.replace(FLEET, namespace_gpu_models={"team-a": "A100-40GB"})
    d, _ = run(pod(container("srv", 1), annotations={MODE: "shared", MEM: "8Gi"}), s)
    assert cel(request_of(d)["exactly"]) == [SHAREABLE, 'device.attributes["gpu.nvidia.com"].productName in '
                                                        '["NVIDIA A100-SXM4-40GB"]']
    d, _ = run(pod(container("srv", 1), annotations={MODE: "shared", MEM: "8Gi", MODELS: "H100-80GB"}), s)
    assert "NVIDIA H100 80GB HBM3" in cel(request_of(d)["exactly"])[1]


@pytest.mark.parametrize("text", ["H100", "h100-80gb", "H100-80GB,"])
def test_an_unknown_model_is_denied_with_the_known_list(text: str) -> None:
    d, _ = run(pod(container("srv", 1), annotations={MODE: "dra", MODELS: text}), FLEET)
    assert not d.allowed and d.audit["gpu-denied-reason"] == "unknown-model"
    assert "A100-40GB, H100-80GB" in d.message


def test_a_minimum_no_model_reaches_is_denied_with_the_largest() -> None:
    d, _ = run(pod(container("srv", 1), annotations={MODE: "dra", MODELS: ">=1Ti"}), FLEET)
    assert not d.allowed and d.audit["gpu-denied-reason"] == "unknown-model"
    assert "the largest is H100-80GB, 80Gi" in d.message


def test_mig_dra_with_models_picks_each_models_own_smallest_profile() -> None:
    d, _ = run(pod(container("srv", 1), annotations={MODE: "mig-dra", MEM: "15Gi", MODELS: "A100-40GB,H100-80GB"}))
    (expr,) = cel(request_of(d)["exactly"])
    # 15Gi = 16.1 GB: an A100-40GB's 2g.10gb is too small, its 3g.20gb fits; an H100's 1g.20gb fits
    assert expr == (f'({A100_40} && device.attributes["gpu.nvidia.com"].profile == "3g.20gb") || '
                    f'({H100} && device.attributes["gpu.nvidia.com"].profile == "1g.20gb")')


def test_model_choice_in_a_device_plugin_mode_is_denied() -> None:
    d, _ = run(pod(container("srv", 1), annotations={MODE: "time-slicing", MODELS: "H100-80GB"}))
    assert not d.allowed and d.audit["gpu-denied-reason"] == "contradictory-ask"


# --- memory larger than any GPU ------------------------------------------------------------------------------------

def test_a_shared_ask_larger_than_any_known_gpu_is_denied_with_the_largest() -> None:
    d, _ = run(pod(container("srv", 1), annotations={MODE: "shared", MEM: "96Gi"}), FLEET)
    assert not d.allowed and d.audit["gpu-denied-reason"] == "memory-too-large"
    assert "the largest is H100-80GB, 80Gi" in d.message and "ask for less" in d.message


def test_a_shared_ask_larger_than_the_chosen_models_is_denied() -> None:
    d, _ = run(pod(container("srv", 1), annotations={MODE: "shared", MEM: "60Gi", MODELS: "A100-40GB"}), FLEET)
    assert not d.allowed and "the models it may use (A100-40GB)" in d.message


# --- HAMi resource names ------------------------------------------------------------------------------------------

def test_gpumem_becomes_a_shared_claim_of_that_many_mib_and_leaves_the_container() -> None:
    c = hami("srv", gpu=1, gpumem=3000)
    c["resources"]["limits"]["cpu"] = "1"
    d, out = run(pod(c), GpuSettings(default_mode="off"))
    assert d.outcome == "mutated"
    body = request_of(d)["exactly"]
    assert body["capacity"] == {"requests": {"memory": "3000Mi"}} and cel(body) == [SHAREABLE]
    assert out["spec"]["containers"][0]["resources"] == {"limits": {"cpu": "1"}, "claims": [{"name": "gpu-srv"}]}
    assert out["metadata"]["annotations"][DECISION_ANNOTATION] == "mode=shared source=hami-alias"


def test_gpumem_alone_is_one_gpu_as_hami_counts_it() -> None:
    d, out = run(pod(hami("srv", gpumem=2048)))
    assert request_of(d)["exactly"]["count"] == 1
    assert "limits" not in out["spec"]["containers"][0]["resources"]


def test_gpumem_percentage_is_a_share_of_whichever_model_the_pod_lands_on() -> None:
    d, _ = run(pod(hami("srv", gpu=1, gpumem_percentage=25)), FLEET)
    subs = request_of(d)["firstAvailable"] if "firstAvailable" in request_of(d) else None
    assert subs is not None
    assert [(s["name"], s["capacity"]["requests"]["memory"]) for s in subs] == [
        ("shared-0", "10240Mi"), ("shared-1", "20480Mi")]
    assert [cel(s)[1] for s in subs] == ['device.attributes["gpu.nvidia.com"].productName in '
                                         '["NVIDIA A100-SXM4-40GB"]',
                                         'device.attributes["gpu.nvidia.com"].productName in '
                                         '["NVIDIA H100 80GB HBM3"]']


def test_a_percentage_over_more_models_than_a_claim_can_list_asks_to_name_them() -> None:
    d, _ = run(pod(hami("srv", gpu=1, gpumem_percentage=25)))  # the default catalog has 10 models
    assert not d.allowed and d.audit["gpu-denied-reason"] == "too-many-ways"
    assert "gatekeeper.dev/gpu-models" in d.message
    d, _ = run(pod(hami("srv", gpu=1, gpumem_percentage=25), annotations={MODELS: "H100-80GB"}))
    assert request_of(d)["exactly"]["capacity"] == {"requests": {"memory": "20480Mi"}}


def test_gpucores_is_recorded_with_a_warning_not_enforced() -> None:
    d, _ = run(pod(hami("srv", gpu=1, gpumem=1024, gpucores=30)))
    assert d.outcome == "mutated" and any("gpucores=30 is recorded, not enforced" in w for w in d.warnings)


@pytest.mark.parametrize(("c", "annotations", "needle"), [
    (hami("srv", gpumem=1000, gpumem_percentage=50), {}, "both nvidia.com/gpumem and nvidia.com/gpumem-percentage"),
    (hami("srv", gpumem=1000), {MEM: "2Gi"}, "remove one of them, or make them equal"),
    (hami("srv", gpumem_percentage=50), {MEM: "2Gi", MODELS: "H100-80GB"}, "remove one of them"),
    (hami("srv", gpumem=1000), {MODE: "dra"}, "cannot serve one: remove them, or use gpu-mode shared"),
    (hami("srv", gpumem=1000), {MODE: "mig"}, "gpu-mode mig (annotation) cannot serve one"),
    (hami("srv", gpumem_percentage=101), {}, "from 1 to 100"),
    (hami("srv", gpumem="1.5"), {}, "whole number"),
    (hami("srv", gpucores=-1), {}, "from 0 to 100"),
])
def test_contradictory_or_malformed_hami_asks_are_denied_with_the_fix(c: dict[str, Any], annotations: dict[str, str],
                                                                       needle: str) -> None:
    d, _ = run(pod(c, annotations=annotations))
    assert not d.allowed and needle in d.message
    assert d.audit["gpu-denied-reason"] in ("contradictory-ask", "invalid")


def test_equal_gpumem_and_gpu_memory_annotation_agree() -> None:
    d, _ = run(pod(hami("srv", gpumem=2048), annotations={MEM: "2Gi"}))
    assert request_of(d)["exactly"]["capacity"] == {"requests": {"memory": "2048Mi"}}


def test_a_hami_pod_is_shared_whatever_the_clusters_default_mode() -> None:
    d, out = run(pod(hami("srv", gpumem=2048)), GpuSettings(default_mode="dra"))
    assert request_of(d)["exactly"]["capacity"] == {"requests": {"memory": "2048Mi"}}
    assert out["metadata"]["annotations"][DECISION_ANNOTATION] == "mode=shared source=hami-alias"
    d, _ = run(pod(hami("srv", gpumem=2048)), GpuSettings(namespace_modes={"team-a": "dra"}))
    assert not d.allowed and "gpu-mode dra (namespace) cannot serve one" in d.message


def test_hami_aliases_off_leaves_such_pods_alone() -> None:
    s = dataclasses.replace(GpuSettings(), hami_aliases=False)
    d, _ = run(pod(hami("srv", gpumem=2048)), s)
    assert d.outcome == "skipped" and not d.templates


def test_an_explicit_off_still_leaves_a_hami_pod_alone() -> None:
    d, _ = run(pod(hami("srv", gpumem=2048), annotations={MODE: "off"}))
    assert d.outcome == "skipped"


def test_hami_memory_sizes_a_mig_dra_partition() -> None:
    d, _ = run(pod(hami("srv", gpu=1, gpumem=9000), annotations={MODE: "mig-dra"}))
    assert cel(request_of(d)["exactly"]) == ['device.attributes["gpu.nvidia.com"].profile == "1g.10gb"']


def test_rewriting_a_hami_pod_is_a_fixed_point() -> None:
    _, once = run(pod(hami("srv", gpu=1, gpumem=3000)))
    d2, twice = run(once)
    assert d2.outcome == "skipped" and twice == once
