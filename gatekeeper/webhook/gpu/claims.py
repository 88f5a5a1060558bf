"""ResourceClaimTemplates the GPU rewrite points pods at (pure).

Template names come from what the template contains (mode, count, device
class, constraint, driver config, memory), so every pod of one shape shares one
template per namespace, and two shapes never collide.

Alignment: a multi-GPU claim gets ``matchAttribute`` (default
``resource.kubernetes.io/pcieRoot``) only up to ``alignUpTo`` GPUs. Real 8-GPU
servers, like the sandbox's nodes, spread their GPUs over several PCIe roots, so
"all 8 on one root" is a constraint no node can meet and the pod would stay
Pending with "cannot allocate all claims" forever.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

from gatekeeper.webhook.settings import GpuSettings

DRA_API = "resource.k8s.io/v1"
REQUEST_NAME = "gpu"
MANAGED_BY = {"app.kubernetes.io/managed-by": "gatekeeper"}
DRA_MODES = ("dra", "mps-dra", "shared", "mig-dra")


def claim_name(container: str) -> str:
    """Pod-level claim name from the container name (unique per pod), kept a DNS label."""
    name = f"gpu-{container}"
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(container.encode()).hexdigest()[:8]
    return f"gpu-{container[:50].rstrip('-')}-{digest}"


def aligned(settings: GpuSettings, count: int) -> str:
    """The matchAttribute a claim of ``count`` GPUs gets, or '' where the constraint cannot hold."""
    if count > 1 and settings.match_attribute and count <= settings.align_up_to:
        return settings.match_attribute
    return ""


def profile_selector(settings: GpuSettings, profile: str) -> str:
    """CEL choosing MIG partitions of one profile, by the driver's attribute (``gpu.nvidia.com/profile``)."""
    domain, _, name = settings.mig_profile_attribute.rpartition("/")
    return f'device.attributes["{domain}"].{name} == "{profile}"'


def template_spec(settings: GpuSettings, mode: str, count: int, memory: str = "", profile: str = "") -> dict[str, Any]:
    """ResourceClaimTemplate ``spec`` (which itself holds the claim's ``spec``).

    ``memory`` (shared mode) becomes ``capacity.requests.memory``: each allocated
    device must have that much memory left, and the allocation consumes it, so
    other claims can share the rest of the same GPU (DRAConsumableCapacity).
    ``profile`` (mig-dra) selects partitions of that MIG profile; the scheduler
    allocates one only while its GPU's shared counters (memory and compute
    slices) have room (DRAPartitionableDevices).
    """
    exactly: dict[str, Any] = {"deviceClassName": settings.mig_device_class if profile else settings.device_class,
                               "allocationMode": "ExactCount", "count": count}
    if memory:
        exactly["capacity"] = {"requests": {"memory": memory}}
    if profile:
        exactly["selectors"] = [{"cel": {"expression": profile_selector(settings, profile)}}]
    devices: dict[str, Any] = {"requests": [{"name": REQUEST_NAME, "exactly": exactly}]}
    attribute = "" if profile else aligned(settings, count)
    if attribute:
        devices["constraints"] = [{"requests": [REQUEST_NAME], "matchAttribute": attribute}]
    if mode == "mps-dra":
        devices["config"] = [{
            "requests": [REQUEST_NAME],
            "opaque": {
                "driver": settings.mps_driver,
                "parameters": {
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "GpuConfig",
                    "sharing": {"strategy": "MPS"},
                },
            },
        }]
    return {"spec": {"devices": devices}}


def template_name(settings: GpuSettings, mode: str, count: int, memory: str = "", profile: str = "") -> str:
    """Deterministic from what the template contains, so equal shapes share one template."""
    if profile:  # mig-dra: the class and the selector are what differ
        return _template_name(settings.template_prefix, mode, count, settings.mig_device_class, "",
                              settings.mig_profile_attribute, profile)
    return _template_name(settings.template_prefix, mode, count, settings.device_class,
                          aligned(settings, count), settings.mps_driver if mode == "mps-dra" else "", memory)


@functools.lru_cache(maxsize=256)
def _template_name(prefix: str, mode: str, count: int, device_class: str, match_attribute: str,
                   mps_driver: str, memory: str) -> str:
    parts = [mode, str(count), device_class, match_attribute, mps_driver]
    if memory:  # appended only when set, so the names of existing dra/mps-dra templates stay the same
        parts.append(memory)
    digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:8]
    return f"{prefix}-{mode}-{count}-{digest}"


SPEC_HASH_ANNOTATION = "gatekeeper.dev/spec-hash"
"""On every template: a hash of its spec, so the reconciler can tell ours from an edited or foreign one."""


def spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def claim_template(settings: GpuSettings, mode: str, count: int, namespace: str,
                   memory: str = "", profile: str = "") -> dict[str, Any]:
    spec = template_spec(settings, mode, count, memory, profile)
    return {
        "apiVersion": DRA_API,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": template_name(settings, mode, count, memory, profile), "namespace": namespace,
                     "labels": dict(MANAGED_BY), "annotations": {SPEC_HASH_ANNOTATION: spec_hash(spec)}},
        "spec": spec,
    }
