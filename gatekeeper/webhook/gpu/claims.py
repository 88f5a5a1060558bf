"""ResourceClaimTemplates the GPU rewrite points pods at (pure).

Template names come from what the template contains (mode, count and a hash
of the whole spec: classes, selectors, capacity, constraint, driver config), so
every pod of one shape shares one template per namespace, and two shapes never
collide.

Selectors keep each way on the devices it is meant for (DRAConsumableCapacity's
``device.allowMultipleAllocations``): a shared claim on shareable devices only,
since the allocator gives a capacity request an exclusive device whole; a
whole-GPU claim off devices with a share count, whose default request is one
share.

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
from dataclasses import dataclass
from typing import Any

from gatekeeper.webhook.gpu.models import GpuModel, product_selector
from gatekeeper.webhook.settings import GpuSettings

DRA_API = "resource.k8s.io/v1"
REQUEST_NAME = "gpu"
MANAGED_BY = {"app.kubernetes.io/managed-by": "gatekeeper"}
DRA_MODES = ("dra", "mps-dra", "shared", "shares", "mig-dra", "first-available")


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


SHAREABLE = "device.allowMultipleAllocations"
"""CEL (DRAConsumableCapacity): the device may be allocated to several claims (the driver's consumable shares)."""


def counted_selector(settings: GpuSettings) -> str:
    """CEL: a shareable device that publishes a share count (``--consumable-shares=N``)."""
    domain, _, name = settings.shares_capacity.rpartition("/")
    return f'{SHAREABLE} && "{name}" in device.capacity["{domain}"]'


def whole_selector(settings: GpuSettings) -> str:
    """CEL: a device a claim that asks for no capacity gets whole: exclusive, or shared by memory (whose
    requestPolicy defaults to all of it). A device with a share count defaults to one share and no memory:
    a whole-GPU pod there would share its GPU with N - 1 others (loadtest/reports/2026-12-06-mixed-fleet-before.md)."""
    domain, _, name = settings.shares_capacity.rpartition("/")
    return f'!{SHAREABLE} || !("{name}" in device.capacity["{domain}"])'


@dataclass(frozen=True)
class Way:
    """One way to serve a claim's devices: its ``exactly`` request, or one ``firstAvailable`` entry."""

    mode: str
    """dra, shared, shares, mps-dra or mig-dra."""
    device_class: str
    selectors: tuple[str, ...] = ()
    """CEL expressions, all of which a device must meet."""
    capacity: tuple[tuple[str, str], ...] = ()
    """(capacity name, quantity) asked of each device, e.g. ``("memory", "20480Mi")``."""
    name: str = ""
    """Sub-request name inside ``firstAvailable`` (unused for ``exactly``)."""

    def body(self, count: int) -> dict[str, Any]:
        out: dict[str, Any] = {"deviceClassName": self.device_class, "allocationMode": "ExactCount", "count": count}
        if self.capacity:
            out["capacity"] = {"requests": dict(self.capacity)}
        if self.selectors:
            out["selectors"] = [{"cel": {"expression": e}} for e in self.selectors]
        return out


@dataclass(frozen=True)
class ClaimShape:
    """Everything a claim template holds: the mode it came from, the GPU count, and its ways in order."""

    mode: str
    count: int
    ways: tuple[Way, ...]
    align: str = ""
    """``matchAttribute`` all devices share ('' = none)."""
    mps_driver: str = ""
    """Driver of the opaque MPS ``GpuConfig`` given to the ``mps-dra`` way."""


def shape_spec(shape: ClaimShape) -> dict[str, Any]:
    """ResourceClaimTemplate ``spec`` (which itself holds the claim's ``spec``).

    One way is a plain ``exactly`` request; several are ``firstAvailable`` sub-requests, which the
    scheduler tries in order on each node. Driver config names the sub-request it belongs to
    (``gpu/mps-dra``), so the container is configured for whichever way was allocated.
    """
    request: dict[str, Any] = {"name": REQUEST_NAME}
    if len(shape.ways) == 1:
        request["exactly"] = shape.ways[0].body(shape.count)
    else:
        request["firstAvailable"] = [{"name": w.name, **w.body(shape.count)} for w in shape.ways]
    devices: dict[str, Any] = {"requests": [request]}
    if shape.align:
        devices["constraints"] = [{"requests": [REQUEST_NAME], "matchAttribute": shape.align}]
    mps = [w for w in shape.ways if w.mode == "mps-dra"]
    if mps:
        target = REQUEST_NAME if len(shape.ways) == 1 else f"{REQUEST_NAME}/{mps[0].name}"
        devices["config"] = [{
            "requests": [target],
            "opaque": {
                "driver": shape.mps_driver,
                "parameters": {
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "GpuConfig",
                    "sharing": {"strategy": "MPS"},
                },
            },
        }]
    return {"spec": {"devices": devices}}


def shape_name(prefix: str, shape: ClaimShape) -> str:
    """Deterministic from what the template contains, so equal shapes share one template."""
    return _shape_facts(prefix, shape)[0]


@functools.lru_cache(maxsize=512)
def _shape_facts(prefix: str, shape: ClaimShape) -> tuple[str, str]:
    """(template name, spec hash) of a shape: a review asks for both, and every pod of one shape for the same
    two, so the spec is serialised (twice, in the two canonical forms the names and hashes already in clusters
    were made with) once per shape, not three times per review."""
    spec = shape_spec(shape)
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8]
    return f"{prefix}-{shape.mode}-{shape.count}-{digest}", spec_hash(spec)


def single_way(settings: GpuSettings, mode: str, memory: str = "", profile: str = "",
               models: tuple[GpuModel, ...] = ()) -> Way:
    """The way a claim of one mode is served: class, selectors and capacity for ``mode``."""
    product = (product_selector(settings.product_attribute, models),) if models else ()
    if mode == "mig-dra":
        return Way(mode, settings.mig_device_class, (profile_selector(settings, profile), *product))
    capacity: tuple[tuple[str, str], ...] = (("memory", memory),) if memory else ()
    if not settings.consumable_capacity:
        return Way(mode, settings.device_class, product, capacity)
    if mode == "shares":
        shares = (settings.shares_capacity.rpartition("/")[2], str(settings.shares_per_pod))
        return Way(mode, settings.device_class, (counted_selector(settings), *product), (shares, *capacity))
    if mode == "shared":
        return Way(mode, settings.device_class, (SHAREABLE, *product), capacity)
    return Way(mode, settings.device_class, (whole_selector(settings), *product), capacity)


def simple_shape(settings: GpuSettings, mode: str, count: int, memory: str = "", profile: str = "",
                 models: tuple[GpuModel, ...] = ()) -> ClaimShape:
    """One mode, one way: what dra, shared, shares, mps-dra and mig-dra pods get."""
    way = single_way(settings, mode, memory, profile, models)
    return ClaimShape(mode, count, (way,), "" if mode == "mig-dra" else aligned(settings, count),
                      settings.mps_driver if mode == "mps-dra" else "")


def template_spec(settings: GpuSettings, mode: str, count: int, memory: str = "", profile: str = "") -> dict[str, Any]:
    """:func:`shape_spec` of a one-mode claim: ``memory`` becomes ``capacity.requests.memory`` (shared),
    ``profile`` the MIG profile selector (mig-dra)."""
    return shape_spec(simple_shape(settings, mode, count, memory, profile))


def template_name(settings: GpuSettings, mode: str, count: int, memory: str = "", profile: str = "") -> str:
    return shape_name(settings.template_prefix, simple_shape(settings, mode, count, memory, profile))


SPEC_HASH_ANNOTATION = "gatekeeper.dev/spec-hash"
"""On every template: a hash of its spec, so the reconciler can tell ours from an edited or foreign one."""


def spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def claim_template(settings: GpuSettings, mode: str, count: int, namespace: str,
                   memory: str = "", profile: str = "") -> dict[str, Any]:
    return shape_template(settings, simple_shape(settings, mode, count, memory, profile), namespace)


def shape_template(settings: GpuSettings, shape: ClaimShape, namespace: str) -> dict[str, Any]:
    name, digest = _shape_facts(settings.template_prefix, shape)
    return {
        "apiVersion": DRA_API,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": dict(MANAGED_BY), "annotations": {SPEC_HASH_ANNOTATION: digest}},
        "spec": shape_spec(shape),
    }
