"""Fake GPU nodes: the Node objects KWOK animates and the DRA objects a GPU driver would publish.

Every node exists twice over, on purpose: as classic extended-resource capacity
(``nvidia.com/gpu: N``, what the device plugin advertises) and as a
``resource.k8s.io/v1`` ResourceSlice (what the DRA driver ``gpu.nvidia.com``
publishes), so the webhook's rewrite from one to the other can be tested
against a scheduler that really allocates both.

Pure manifests here; ``up`` applies them with kubectl.
"""

from __future__ import annotations

import uuid
from typing import Any

from gatekeeper.kube import objects

DRIVER = "gpu.nvidia.com"
DEVICE_CLASS = "gpu.nvidia.com"
EXTENDED_RESOURCE = "nvidia.com/gpu"
PRODUCT = "NVIDIA H100 80GB HBM3"
GPU_MEMORY = "80Gi"
PCIE_ROOTS = ("pci0000:00", "pci0000:80")
"""Two PCIe roots per node, half the GPUs each, so a 2-GPU ``matchAttribute`` constraint means something."""
NODE_PREFIX = "gpu-node-"
SHARING_MODES = ("none", "memory", "unlimited", "<N>")
"""``--gpu-sharing`` / a pool's ``sharing``, as the NVIDIA DRA driver's ``--consumable-shares``
(kubernetes-sigs/dra-driver-nvidia-gpu, cmd/gpu-kubelet-plugin/consumable_shares.go) publishes a GPU:

* ``none``: exclusive (no ``allowMultipleAllocations``);
* ``memory``: ``allowMultipleAllocations: true`` and a ``memory`` capacity whose ``requestPolicy``
  defaults to the whole GPU and allows 1Mi..all in 1Mi steps. A claim that asks for no memory still
  gets the whole GPU (the default), so whole-GPU pods behave exactly as with ``none``;
* ``unlimited``: the same, but memory defaults to 0 (and may be 0): any number of claims;
* ``N`` (a count): memory as ``unlimited``, plus a ``shares`` capacity of N whose requests default to 1
  (1..N in steps of 1): N claims per GPU, the device plugin's time-slicing ``replicas: N``."""
MEMORY_STEP = "1Mi"
SHARES_CAPACITY = "shares"


class ClusterObjectMeta(objects.ObjectMeta, total=False):
    """Adds what cluster-scoped objects the sandbox creates need on top of the shared shape."""

    uid: str
    ownerReferences: list[dict[str, Any]]


class Manifest(objects.TypeMeta, total=False):
    metadata: ClusterObjectMeta
    spec: dict[str, Any]
    status: dict[str, Any]


def node_names(count: int) -> list[str]:
    return [f"{NODE_PREFIX}{i}" for i in range(count)]


def device_class(extended_resource_mapping: bool = False) -> Manifest:
    """The GPUs' DeviceClass; ``extended_resource_mapping`` adds KEP-5004's ``extendedResourceName``."""
    # Whole GPUs only: with --mig-dra-nodes the driver also publishes MIG partitions (type "mig"), as the
    # NVIDIA driver's gpu.nvidia.com class leaves those to mig.nvidia.com.
    expression = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": expression}}]}
    if extended_resource_mapping:
        spec["extendedResourceName"] = EXTENDED_RESOURCE
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": spec,
    }


def node(name: str, gpus: int, advertise_extended_resource: bool = True, product: str = PRODUCT) -> Manifest:
    """A Node as KWOK's docs create them; KWOK fills conditions and keeps our capacity.

    No ``kwok.x-k8s.io/node=fake:NoSchedule`` taint: KWOK's docs add it to keep real
    pods off fake nodes in a real cluster, but here every node is fake, and the
    taint would force a toleration onto every pod the tests and webhook produce.

    Without ``advertise_extended_resource`` the node has no ``nvidia.com/gpu`` capacity, as a node
    served only by a DRA driver: the scheduler serves the resource there through KEP-5004's
    DeviceClass mapping (a node that advertises it keeps device-plugin accounting).
    """
    resources = {"cpu": "128", "memory": "1Ti", "pods": "110", "ephemeral-storage": "10Ti"}
    if advertise_extended_resource:
        resources[EXTENDED_RESOURCE] = str(gpus)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kwok.x-k8s.io/node": "fake",
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.product": product.replace(" ", "-"),
            },
        },
        "spec": {},
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def gpu_uuid(node_name: str, index: int) -> str:
    """Stable across restarts, unique across nodes, shaped like nvidia-smi's ``GPU-<uuid>``."""
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node_name}.gpu{index}.sandbox.gatekeeper')}"


def pcie_root(index: int, gpus: int) -> str:
    return PCIE_ROOTS[0] if index < (gpus + 1) // 2 else PCIE_ROOTS[1]


def check_sharing(sharing: str) -> str:
    """``sharing`` if it is one of :data:`SHARING_MODES` (a count: a positive integer), else ValueError."""
    if sharing in ("none", "memory", "unlimited") or (sharing.isdigit() and 0 < int(sharing) <= 1024):
        return sharing
    raise ValueError(f"gpu sharing must be none, memory, unlimited or a share count 1..1024, got {sharing!r}")


def gpu_device(node_name: str, i: int, gpus: int, sharing: str = "none", product: str = PRODUCT,
               memory: str = GPU_MEMORY, architecture: str = "Hopper") -> dict[str, Any]:
    """One GPU as the driver publishes it (``sharing``: see :data:`SHARING_MODES`)."""
    device: dict[str, Any] = {
        "name": f"gpu-{i}",
        "attributes": {
            "type": {"string": "gpu"},
            "productName": {"string": product},
            "architecture": {"string": architecture},
            "index": {"int": i},
            "uuid": {"string": gpu_uuid(node_name, i)},
            "resource.kubernetes.io/pcieRoot": {"string": pcie_root(i, gpus)},
        },
        "capacity": {"memory": {"value": memory}},
    }
    check_sharing(sharing)
    if sharing == "none":
        return device
    device["allowMultipleAllocations"] = True
    mem = device["capacity"]["memory"]
    if sharing == "memory":
        mem["requestPolicy"] = {"default": memory,
                                "validRange": {"min": MEMORY_STEP, "max": memory, "step": MEMORY_STEP}}
        return device
    mem["requestPolicy"] = {"default": "0", "validRange": {"min": "0", "max": memory, "step": MEMORY_STEP}}
    if sharing != "unlimited":
        device["capacity"][SHARES_CAPACITY] = {"value": sharing, "requestPolicy": {
            "default": "1", "validRange": {"min": "1", "max": sharing, "step": "1"}}}
    return device


def resource_slice(node_name: str, gpus: int, node_uid: str = "", sharing: str = "none", product: str = PRODUCT,
                   memory: str = GPU_MEMORY, architecture: str = "Hopper") -> Manifest:
    """The one slice of pool ``node_name``; owned by the Node so deleting the node cleans it up."""
    devices = [gpu_device(node_name, i, gpus, sharing, product, memory, architecture) for i in range(gpus)]
    meta: ClusterObjectMeta = {"name": f"{node_name}-{DRIVER}"}
    if node_uid:
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
        ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": meta,
        "spec": {
            "driver": DRIVER,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def as_list(items: list[Manifest]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "List", "items": items}


def node_ready(obj: dict[str, Any], *, require_untainted: bool) -> bool:
    """Ready=True, and (with node-lifecycle on) the not-ready taint already removed."""
    conditions = obj.get("status", {}).get("conditions", [])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    if not ready or not require_untainted:
        return ready
    taints = obj.get("spec", {}).get("taints") or []
    return not any(t.get("key", "").startswith("node.kubernetes.io/") for t in taints)
