"""Fake MIG nodes, both ways a cluster can offer MIG (pure manifests; ``up`` applies them).

* ``--mig-node MODEL``: a node as the device plugin's *mixed* strategy shows it
  after NVIDIA's mig-manager applied ``all-balanced``: labelled with GPU feature
  discovery's ``nvidia.com/gpu.product`` and ``nvidia.com/mig.config``, and
  advertising ``nvidia.com/mig-<profile>`` extended resources (per GPU: two of
  the 1g profile, one 2g, one 3g; NVIDIA/mig-parted's config-default.yaml).
  The webhook's ``mig`` mode with ``migPools`` is tested against these.
* ``--mig-dra-nodes N``: a node whose GPUs are published as the NVIDIA DRA
  driver's dynamic-MIG mode does (KEP-4815 partitionable devices, read from
  kubernetes-sigs/dra-driver-nvidia-gpu ``cmd/gpu-kubelet-plugin/partitions.go``):
  one counter set per GPU (``gpu-<i>-counter-set``) holding one counter per
  memory slice (``memory-slice-<n>``, value 1) and the compute slices; one device
  per (profile, placement) that consumes its memory slices and compute slices;
  and the full GPU, consuming everything. In v1.37 a slice holds either
  ``sharedCounters`` or ``devices`` ("Only one of Devices and SharedCounters can
  be set in a ResourceSlice", ``kubectl explain resourceslice.spec``), so each
  node's pool has two slices. A slice whose devices consume counters holds at
  most 64 devices: 19 per H100, so at most :data:`MAX_MIG_DRA_GPUS` GPUs per node.
"""

from __future__ import annotations

from typing import Any

from gatekeeper.sandbox import gpu
from gatekeeper.sandbox.gpu import ClusterObjectMeta, Manifest
from gatekeeper.webhook.gpu.sizing import MIG_CATALOG, layout_profiles

PRODUCTS = {
    "A30-24GB": "NVIDIA-A30",
    "A100-40GB": "NVIDIA-A100-SXM4-40GB",
    "A100-80GB": "NVIDIA-A100-SXM4-80GB",
    "H100-80GB": "NVIDIA-H100-80GB-HBM3",
    "H200-141GB": "NVIDIA-H200",
    "B200-180GB": "NVIDIA-B200",
    "GB200-186GB": "NVIDIA-GB200",
}
"""``nvidia.com/gpu.product`` as GPU feature discovery writes it (the product name, spaces as dashes)."""
PRODUCT_LABEL = "nvidia.com/gpu.product"
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
LAYOUT = "all-balanced"
BALANCED_COUNTS = (2, 1, 1)
"""Per GPU in ``all-balanced``: instances of its 1g, 2g and 3g profile (A30: 1g and 2g only)."""
MIG_DEVICE_CLASS = "mig.nvidia.com"
MAX_MIG_DRA_GPUS = 3
MIG_DRA_MODEL = "H100-80GB"
MEMORY_SLICES = 8
COMPUTE_SLICES = 7
PLACEMENTS: dict[int, tuple[tuple[int, ...], int]] = {
    # compute slices of a profile -> (memory-slice starts, memory slices per instance), for 7-slice GPUs
    # (NVIDIA MIG user guide's placement diagrams; the mock NVML tables in the DRA driver agree).
    1: ((0, 1, 2, 3, 4, 5, 6), 1),
    2: ((0, 2, 4), 2),
    3: ((0, 4), 4),
    4: ((0,), 4),
    7: ((0,), 8),
}
TWO_SLICE_1G = ((0, 2, 4, 6), 2)
"""The 1g profile with twice the memory (``1g.20gb`` on an 80 GB GPU) takes two memory slices."""


def mig_node_name(model: str, index: int) -> str:
    return f"mig-{model.lower()}-{index}"


def mig_node(name: str, model: str, gpus: int) -> Manifest:
    """A device-plugin MIG node: the product label and ``nvidia.com/mig-<profile>`` capacity of all-balanced."""
    if model not in PRODUCTS:
        raise ValueError(f"--mig-node: no sandbox product for {model!r}; expected one of {', '.join(PRODUCTS)}")
    node = gpu.node(name, gpus, advertise_extended_resource=False)
    labels = node["metadata"].setdefault("labels", {})
    labels[PRODUCT_LABEL] = PRODUCTS[model]
    labels[MIG_CONFIG_LABEL] = LAYOUT
    labels["nvidia.com/mig.strategy"] = "mixed"
    for profile, per_gpu in zip(layout_profiles(model, LAYOUT), BALANCED_COUNTS, strict=False):
        for key in ("capacity", "allocatable"):
            node["status"][key][f"nvidia.com/mig-{profile}"] = str(per_gpu * gpus)
    return node


def mig_dra_gpus(gpus_per_node: int) -> int:
    return min(gpus_per_node, MAX_MIG_DRA_GPUS)


def mig_dra_node(name: str, gpus: int) -> Manifest:
    node = gpu.node(name, gpus, advertise_extended_resource=False)
    node["metadata"].setdefault("labels", {})[PRODUCT_LABEL] = PRODUCTS[MIG_DRA_MODEL]
    return node


def _counters(memory_slices: range, compute: int) -> dict[str, Any]:
    out: dict[str, Any] = {f"memory-slice-{i}": {"value": "1"} for i in memory_slices}
    out["compute-slices"] = {"value": str(compute)}
    return out


def counter_set(index: int) -> str:
    return f"gpu-{index}-counter-set"


def partitions(node_name: str, index: int, gpus: int) -> list[dict[str, Any]]:
    """The full GPU and every (profile, placement) MIG device of GPU ``index``, as dynamic MIG publishes them."""
    uuid = gpu.gpu_uuid(node_name, index)
    base = {"productName": {"string": gpu.PRODUCT}, "parentUUID": {"string": uuid},
            "resource.kubernetes.io/pcieRoot": {"string": gpu.pcie_root(index, gpus)}}
    full: dict[str, Any] = {
        "name": f"gpu-{index}",
        "attributes": {**base, "type": {"string": "gpu"}, "uuid": {"string": uuid}, "index": {"int": index}},
        "capacity": {"memory": {"value": gpu.GPU_MEMORY}},
        "consumesCounters": [{"counterSet": counter_set(index),
                              "counters": _counters(range(MEMORY_SLICES), COMPUTE_SLICES)}],
    }
    out = [full]
    profiles = MIG_CATALOG[MIG_DRA_MODEL]
    smallest = min(p.memory_gb for p in profiles)
    for p in profiles:
        starts, size = TWO_SLICE_1G if p.slices == 1 and p.memory_gb > smallest else PLACEMENTS[p.slices]
        for start in starts:
            out.append({
                "name": f"gpu-{index}-mig-{p.name.replace('.', '')}-{start}",
                "attributes": {**base, "type": {"string": "mig"}, "profile": {"string": p.name}},
                "capacity": {"memory": {"value": f"{p.memory_gb}G"}},
                "consumesCounters": [{"counterSet": counter_set(index),
                                      "counters": _counters(range(start, start + size), p.slices)}],
            })
    return out


def mig_dra_slices(node_name: str, gpus: int, node_uid: str = "") -> list[Manifest]:
    """The node's pool: one slice of counter sets, one of devices (v1.37 allows only one kind per slice)."""
    meta_owner: ClusterObjectMeta = {}
    if node_uid:
        meta_owner["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}]
    pool = {"name": node_name, "generation": 1, "resourceSliceCount": 2}
    counters: Manifest = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": f"{node_name}-counters", **meta_owner},
        "spec": {"driver": gpu.DRIVER, "nodeName": node_name, "pool": dict(pool), "sharedCounters": [
            {"name": counter_set(i), "counters": _counters(range(MEMORY_SLICES), COMPUTE_SLICES)}
            for i in range(gpus)]},
    }
    devices: Manifest = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": f"{node_name}-devices", **meta_owner},
        "spec": {"driver": gpu.DRIVER, "nodeName": node_name, "pool": dict(pool),
                 "devices": [d for i in range(gpus) for d in partitions(node_name, i, gpus)]},
    }
    return [counters, devices]


def mig_device_class() -> Manifest:
    """MIG partitions of the driver (the NVIDIA driver's ``mig.nvidia.com`` class)."""
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": MIG_DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression":
                 f'device.driver == "{gpu.DRIVER}" && device.attributes["{gpu.DRIVER}"].type == "mig"'}}]},
    }
