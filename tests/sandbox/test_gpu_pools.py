"""GPU node pools (``--gpu-pool``, ``--mixed-fleet``): each pool publishes its GPUs as the NVIDIA DRA driver does."""

from __future__ import annotations

import pytest

from gatekeeper.sandbox import fleet, gpu


def _device(sharing: str, memory: str = "40Gi") -> dict:
    return gpu.gpu_device("n", 0, 4, sharing, "NVIDIA A100-SXM4-40GB", memory)


def test_exclusive_gpu_publishes_no_multiple_allocations() -> None:
    d = _device("none")
    assert "allowMultipleAllocations" not in d
    assert d["capacity"] == {"memory": {"value": "40Gi"}}


def test_memory_shares_default_to_the_whole_gpu_as_the_driver_publishes_them() -> None:
    d = _device("memory")
    assert d["allowMultipleAllocations"] is True
    assert d["capacity"]["memory"]["requestPolicy"] == {
        "default": "40Gi", "validRange": {"min": "1Mi", "max": "40Gi", "step": "1Mi"}}
    assert "shares" not in d["capacity"]


def test_a_share_count_adds_a_shares_capacity_and_memory_defaults_to_nothing() -> None:
    d = _device("4")
    assert d["capacity"]["shares"] == {"value": "4", "requestPolicy": {
        "default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}}}
    assert d["capacity"]["memory"]["requestPolicy"]["default"] == "0"


def test_unlimited_shares_memory_without_a_count() -> None:
    d = _device("unlimited")
    assert d["allowMultipleAllocations"] is True and "shares" not in d["capacity"]


@pytest.mark.parametrize("bad", ["0", "-1", "many", "1025", ""])
def test_bad_sharing_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="none, memory, unlimited or a share count"):
        gpu.check_sharing(bad)


def test_pool_spec_parses_every_key() -> None:
    pool = fleet.parse_pool("name=a100,nodes=2,gpus=8,model=A100-40GB,sharing=4")
    assert pool == fleet.GpuPool("a100", 2, 8, "A100-40GB", "4")
    assert pool.node_names() == ["gpu-a100-0", "gpu-a100-1"]
    nodes, slices = fleet.manifests(pool, {"gpu-a100-0": "uid-0"})
    assert nodes[0]["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB"
    dev = slices[0]["spec"]["devices"][0]
    assert dev["attributes"]["productName"] == {"string": "NVIDIA A100-SXM4-40GB"}
    assert dev["capacity"]["memory"]["value"] == "40Gi"
    assert slices[0]["metadata"]["ownerReferences"][0]["uid"] == "uid-0"
    assert "ownerReferences" not in slices[1]["metadata"]


@pytest.mark.parametrize(("spec", "message"), [
    ("nodes=1", "name= is required"),
    ("name=Big", "name= is required"),
    ("name=a,model=Z100", "unknown GPU model 'Z100'"),
    ("name=a,colour=red", "expected comma-separated"),
    ("name=a,nodes=1,nodes=2", "expected comma-separated"),
    ("name=a,sharing=lots", "share count"),
    ("name=a,gpus=0", "gpus 1..16"),
    ("name=a,nodes=x", "invalid literal"),
])
def test_bad_pool_specs_name_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fleet.parse_pool(spec)


def test_mixed_fleet_has_two_models_and_every_sharing_kind() -> None:
    assert {p.model for p in fleet.MIXED_FLEET} == {"H100-80GB", "A100-40GB"}
    assert {p.sharing for p in fleet.MIXED_FLEET} == {"memory", "4", "none"}
    assert len({n for p in fleet.MIXED_FLEET for n in p.node_names()}) == 4
