"""Fake MIG nodes: device-plugin capacity of all-balanced, and dynamic-MIG partitions that fit their counters."""

from __future__ import annotations

from collections import Counter

import pytest

from gatekeeper.sandbox import mig


def test_device_plugin_mig_node_advertises_all_balanced_per_gpu() -> None:
    node = mig.mig_node("mig-a100-40gb-0", "A100-40GB", 8)
    assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB"
    cap = node["status"]["capacity"]
    assert {k: v for k, v in cap.items() if k.startswith("nvidia.com/")} == {
        "nvidia.com/mig-1g.5gb": "16", "nvidia.com/mig-2g.10gb": "8", "nvidia.com/mig-3g.20gb": "8"}
    with pytest.raises(ValueError, match="no sandbox product"):
        mig.mig_node("x", "T4", 1)


def test_dynamic_mig_pool_has_a_counter_slice_and_a_device_slice() -> None:
    counters, devices = mig.mig_dra_slices("mig-dra-0", 2, "uid-1")
    assert "devices" not in counters["spec"] and "sharedCounters" not in devices["spec"]
    assert counters["spec"]["pool"] == devices["spec"]["pool"] == {
        "name": "mig-dra-0", "generation": 1, "resourceSliceCount": 2}
    sets = {s["name"]: s["counters"] for s in counters["spec"]["sharedCounters"]}
    assert set(sets) == {"gpu-0-counter-set", "gpu-1-counter-set"}
    assert len(devices["spec"]["devices"]) == 2 * 19
    assert len(mig.mig_dra_slices("n", mig.mig_dra_gpus(8))[1]["spec"]["devices"]) <= 64  # the API's limit
    by_profile = Counter(d["attributes"].get("profile", {}).get("string", "full")
                         for d in devices["spec"]["devices"] if d["name"].startswith("gpu-0"))
    assert by_profile == {"1g.10gb": 7, "1g.20gb": 4, "2g.20gb": 3, "3g.40gb": 2, "4g.40gb": 1, "7g.80gb": 1, "full": 1}


def test_every_partition_fits_its_gpus_counters_and_placements_of_one_profile_do_not_overlap() -> None:
    _, devices = mig.mig_dra_slices("mig-dra-0", 3)
    total = {k: int(v["value"]) for k, v in mig._counters(range(mig.MEMORY_SLICES), mig.COMPUTE_SLICES).items()}
    seen: dict[str, set[str]] = {}
    for d in devices["spec"]["devices"]:
        (use,) = d["consumesCounters"]
        assert all(int(v["value"]) <= total[k] for k, v in use["counters"].items())
        profile = d["attributes"].get("profile", {}).get("string")
        if profile and d["name"].startswith("gpu-0"):
            slices = {k for k in use["counters"] if k.startswith("memory-slice")}
            assert not slices & seen.get(profile, set()), d["name"]
            seen.setdefault(profile, set()).update(slices)
