"""GPU pod rewrite policy (mutating, pure).

Why: whole-GPU pods idle at 12-30% utilization, and DRA replaces device-plugin
counting plus custom NUMA/topology schedulers (the seeds' last lesson). At Pod
CREATE, every container (init and sidecar containers included) that asks for
``nvidia.com/gpu`` is rewritten according to the pod's mode:

* ``dra``: a pod ``resourceClaims`` entry per container, pointing at a shared
  ResourceClaimTemplate (``resource.k8s.io/v1``) requesting ``count: N`` devices
  of the device class; N > 1 adds a ``matchAttribute`` constraint (default
  ``resource.kubernetes.io/pcieRoot``) so the scheduler itself aligns topology.
* ``mps-dra``: the same, plus NVIDIA's opaque ``GpuConfig`` with MPS sharing.
* ``time-slicing`` / ``mps``: rename to the device plugin's shared resource.
* ``mig``: rename to ``nvidia.com/mig-<profile>``, the smallest profile of the
  configured GPU model that fits the ``gatekeeper.dev/gpu-memory`` annotation.
* ``off``: untouched.

Mode: pod annotation ``gatekeeper.dev/gpu-mode``, else ``namespaceModes``, else
``defaultMode``. The rewrite is idempotent (its output no longer asks for
``nvidia.com/gpu``), and pods already using DRA claims or shared names are left
alone -- unless they carry our ``gpu-rewritten`` annotation: then those claims
are ours, and a GPU container another webhook injected before a reinvocation
is rewritten too. Claim names come from container names, never the pod name, so
``generateName`` pods work; template names come from (mode, count, device
class, constraint), so all pods of a shape share one template per namespace.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from gatekeeper.kube.admission import (
    AdmissionRequest,
    Decision,
    PatchOp,
    add_map_entry,
    append_list_items,
    as_dict,
    escape,
    object_label,
    op_add,
    op_remove,
    short,
)
from gatekeeper.webhook.settings import (
    MEMORY_ANNOTATION,
    MODE_ANNOTATION,
    MODES,
    REWRITTEN_ANNOTATION,
    GpuSettings,
)

GPU = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"
DRA_API = "resource.k8s.io/v1"
REQUEST_NAME = "gpu"
MANAGED_BY = {"app.kubernetes.io/managed-by": "gatekeeper"}


@dataclass(frozen=True)
class MigProfile:
    """One MIG GPU-instance profile: compute slices (of 7) and memory in GB, as in its name."""

    name: str
    slices: int
    memory_gb: int


def _profiles(*specs: str) -> tuple[MigProfile, ...]:
    out = []
    for s in specs:
        g, mem = s.split(".")
        out.append(MigProfile(s, int(g.removesuffix("g")), int(mem.removesuffix("gb"))))
    return tuple(out)


_A100_80 = _profiles("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
MIG_CATALOG: dict[str, tuple[MigProfile, ...]] = {
    # NVIDIA MIG User Guide, "Supported MIG Profiles" (the +me media-extension variants are left
    # out: one per GPU, meant for video decode, never the right answer to "how much memory").
    "A100-40GB": _profiles("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    "A100-80GB": _A100_80,
    "H100-80GB": _A100_80,
    "H100-94GB": _profiles("1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"),
    "H100-96GB": _profiles("1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"),
    "H200-141GB": _profiles("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
}

_MEM = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gib|gb|gi|g|mib|mb|mi|m)?\s*$", re.IGNORECASE)


def parse_gpu_memory(text: str) -> float:
    """GB as MIG profile names count them: '20', '20gb', '20G' and '20Gi' all mean 20; '512Mi' is 0.5."""
    m = _MEM.match(text)
    if not m:
        raise ValueError(f"{MEMORY_ANNOTATION} must be a size like '20Gi' or '10gb', got {text!r}")
    value, unit = float(m.group(1)), (m.group(2) or "g").lower()
    return value / 1024 if unit.startswith("m") else value


def smallest_mig_profile(model: str, need_gb: float) -> MigProfile | None:
    fits = [p for p in MIG_CATALOG[model] if p.memory_gb >= need_gb]
    return min(fits, key=lambda p: (p.memory_gb, p.slices)) if fits else None


@dataclass(frozen=True)
class GpuContainer:
    """A container asking for whole GPUs, and where it sits in the pod."""

    path: str
    """JSON Pointer of the container, e.g. ``/spec/initContainers/0``."""
    name: str
    count: int
    container: dict[str, Any]


class PolicyError(ValueError):
    """The pod cannot be admitted as written; the message goes to the user."""


def _count(value: Any, where: str) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise PolicyError(f"{where}: {GPU} must be a whole number of GPUs, got {value!r}") from None
    if n < 0:
        raise PolicyError(f"{where}: {GPU} must not be negative, got {value!r}")
    return n


def _resource_maps(c: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    res = as_dict(c.get("resources"))
    limits, requests = res.get("limits"), res.get("requests")
    return (res, limits if isinstance(limits, dict) else None,
            requests if isinstance(requests, dict) else None)


def _containers(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for key in ("initContainers", "containers"):
        items = spec.get(key)
        if isinstance(items, list):
            out += [(f"/spec/{key}/{i}", c) for i, c in enumerate(items) if isinstance(c, dict)]
    return out


def gpu_containers(spec: dict[str, Any], label: str) -> list[GpuContainer]:
    out = []
    for path, c in _containers(spec):
        _, limits, requests = _resource_maps(c)
        raw = (limits or {}).get(GPU, (requests or {}).get(GPU))
        if raw is None:
            continue
        n = _count(raw, f"{label} container {c.get('name', '?')}")
        if n > 0:
            out.append(GpuContainer(path, str(c.get("name", "")), n, c))
    return out


def _already_shared_or_dra(spec: dict[str, Any], settings: GpuSettings) -> bool:
    if spec.get("resourceClaims"):
        return True
    shared = {settings.time_slicing_resource, settings.mps_resource}
    for _, c in _containers(spec):
        res, limits, requests = _resource_maps(c)
        if res.get("claims"):
            return True
        for m in (limits or {}, requests or {}):
            if any(k in shared or k.startswith(MIG_PREFIX) for k in m):
                return True
    return False


def resolve_mode(annotations: dict[str, Any], namespace: str, settings: GpuSettings) -> str:
    value = annotations.get(MODE_ANNOTATION)
    if value is not None:
        if value not in MODES:
            raise PolicyError(
                f"annotation {MODE_ANNOTATION} must be one of {', '.join(MODES)}, got {value!r}")
        return str(value)
    return settings.namespace_modes.get(namespace, settings.default_mode)


def claim_name(container: str) -> str:
    """Pod-level claim name from the container name (unique per pod), kept a DNS label."""
    name = f"gpu-{container}"
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(container.encode()).hexdigest()[:8]
    return f"gpu-{container[:50].rstrip('-')}-{digest}"


def template_spec(settings: GpuSettings, mode: str, count: int) -> dict[str, Any]:
    """ResourceClaimTemplate ``spec`` (which itself holds the claim's ``spec``)."""
    devices: dict[str, Any] = {
        "requests": [{
            "name": REQUEST_NAME,
            "exactly": {"deviceClassName": settings.device_class, "allocationMode": "ExactCount",
                        "count": count},
        }]
    }
    if count > 1 and settings.match_attribute:
        devices["constraints"] = [{"requests": [REQUEST_NAME], "matchAttribute": settings.match_attribute}]
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


def template_name(settings: GpuSettings, mode: str, count: int) -> str:
    """Deterministic from what the template contains, so equal shapes share one template."""
    return _template_name(settings.template_prefix, mode, count, settings.device_class,
                          settings.match_attribute if count > 1 else "",
                          settings.mps_driver if mode == "mps-dra" else "")


@functools.lru_cache(maxsize=256)
def _template_name(prefix: str, mode: str, count: int, device_class: str, match_attribute: str,
                   mps_driver: str) -> str:
    key = "|".join([mode, str(count), device_class, match_attribute, mps_driver])
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    return f"{prefix}-{mode}-{count}-{digest}"


def claim_template(settings: GpuSettings, mode: str, count: int, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": DRA_API,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": template_name(settings, mode, count), "namespace": namespace,
                     "labels": dict(MANAGED_BY)},
        "spec": template_spec(settings, mode, count),
    }


def _drop_gpu(c: GpuContainer) -> list[PatchOp]:
    """Remove nvidia.com/gpu from limits and requests (the whole map if it held nothing else)."""
    _, limits, requests = _resource_maps(c.container)
    ops: list[PatchOp] = []
    for key, m in (("limits", limits), ("requests", requests)):
        if m is not None and GPU in m:
            if len(m) == 1:
                ops.append(op_remove(f"{c.path}/resources/{key}"))
            else:
                ops.append(op_remove(f"{c.path}/resources/{key}/{escape(GPU)}"))
    return ops


def _rename(c: GpuContainer, new: str) -> list[PatchOp]:
    """Move the GPU count to ``new`` in limits (always) and requests (if it was there)."""
    _, limits, requests = _resource_maps(c.container)
    ops: list[PatchOp] = []
    if limits is None:  # requests without limits: extended resources need limits; set them
        ops.append(op_add(f"{c.path}/resources/limits", {new: str(c.count)}))
    else:
        if GPU in limits:
            ops.append(op_remove(f"{c.path}/resources/limits/{escape(GPU)}"))
        ops.append(op_add(f"{c.path}/resources/limits/{escape(new)}", str(c.count)))
    if requests is not None and GPU in requests:
        ops.append(op_remove(f"{c.path}/resources/requests/{escape(GPU)}"))
        ops.append(op_add(f"{c.path}/resources/requests/{escape(new)}", str(c.count)))
    return ops


def _mig_profile(annotations: dict[str, Any], settings: GpuSettings, label: str) -> str:
    raw = annotations.get(MEMORY_ANNOTATION)
    if raw is None:
        if settings.mig_default_profile:
            return settings.mig_default_profile
        raise PolicyError(f"{label} uses gpu-mode mig but has no {MEMORY_ANNOTATION} annotation "
                          f"(e.g. '20Gi'): set it so a {settings.mig_gpu_model} MIG profile can be chosen")
    try:
        need = parse_gpu_memory(str(raw))
    except ValueError as exc:
        raise PolicyError(f"{label}: {exc}") from None
    profile = smallest_mig_profile(settings.mig_gpu_model, need)
    if profile is None:
        largest = max(MIG_CATALOG[settings.mig_gpu_model], key=lambda p: p.memory_gb)
        raise PolicyError(
            f"{label} needs {raw} of GPU memory ({MEMORY_ANNOTATION}), more than the largest "
            f"{settings.mig_gpu_model} MIG profile {largest.name}: use gpu-mode dra for whole GPUs"
        )
    return profile.name


def handles(req: AdmissionRequest, settings: GpuSettings) -> bool:
    return (settings.enabled and req.kind == "Pod" and req.group == "" and not req.sub_resource
            and req.operation == "CREATE")


def review(req: AdmissionRequest, settings: GpuSettings) -> Decision:
    """Decide one Pod CREATE (callers check :func:`handles` first)."""
    pod = req.object or {}
    meta, spec = as_dict(pod.get("metadata")), as_dict(pod.get("spec"))
    annotations = as_dict(meta.get("annotations"))
    label = object_label("Pod", req.namespace, meta)
    try:
        found = gpu_containers(spec, label)
        if not found:
            return Decision(outcome="skipped")
        mode = resolve_mode(annotations, req.namespace, settings)
        if mode == "off":
            return Decision(outcome="skipped", audit={"gpu-mode": "off"})
        # A pod we rewrote before (reinvocation after a later webhook injected another GPU container)
        # has our own claims and shared names; only a pod that came with its own is left alone.
        if REWRITTEN_ANNOTATION not in annotations and _already_shared_or_dra(spec, settings):
            return Decision(outcome="skipped", warnings=[
                f"{label} already uses DRA claims or shared GPUs; its {GPU} requests were left as they are"])
        return _rewrite(req, settings, mode, found, spec, meta, annotations, label)
    except PolicyError as exc:
        return Decision(allowed=False, outcome="denied", message=str(exc), code=422, reason="Invalid",
                        audit={"gpu-denied": str(exc)})


def _rewrite(req: AdmissionRequest, settings: GpuSettings, mode: str, found: list[GpuContainer],
             spec: dict[str, Any], meta: dict[str, Any], annotations: dict[str, Any], label: str) -> Decision:
    ops: list[PatchOp] = []
    notes: list[str] = []
    warnings: list[str] = []
    templates: dict[str, dict[str, Any]] = {}
    claims: list[dict[str, str]] = []
    existing = spec.get("resourceClaims")
    taken = {rc.get("name") for rc in existing if isinstance(rc, dict)} if isinstance(existing, list) else set()
    for c in found:
        if mode in ("dra", "mps-dra"):
            tmpl = claim_template(settings, mode, c.count, req.namespace)
            tname = tmpl["metadata"]["name"]
            templates[tname] = tmpl
            cname = claim_name(c.name)
            if cname in taken:
                raise PolicyError(f"{label}: container {c.name} would get DRA claim {cname}, but the pod "
                                  "already has a resourceClaims entry of that name: rename one of them")
            claims.append({"name": cname, "resourceClaimTemplateName": tname})
            ops += _drop_gpu(c)
            res, _, _ = _resource_maps(c.container)
            ops += append_list_items(res.get("claims"), f"{c.path}/resources/claims", [{"name": cname}])
            target = f"DRA claim {cname} ({tname})"
            notes.append(f"{c.name}:{c.count}->{cname}")
        else:
            if mode == "mig":
                new = MIG_PREFIX + _mig_profile(annotations, settings, label)
            else:
                new = settings.time_slicing_resource if mode == "time-slicing" else settings.mps_resource
            ops += _rename(c, new)
            target = f"{new}={c.count}"
            notes.append(f"{c.name}:{c.count}->{new}")
        warnings.append(short(f"gatekeeper ({mode}): container {c.name}: {GPU}={c.count} -> {target}"))
    if claims:
        ops += append_list_items(spec.get("resourceClaims"), "/spec/resourceClaims", claims)
    summary = f"{mode} " + " ".join(notes)
    previous = annotations.get(REWRITTEN_ANNOTATION)
    if isinstance(previous, str) and previous:
        summary = f"{previous}; {summary}"  # reinvocation: keep what the first pass recorded
    ops.append(add_map_entry(meta.get("annotations") if isinstance(meta.get("annotations"), dict) else None,
                             "/metadata/annotations", REWRITTEN_ANNOTATION, summary))
    if not meta and "metadata" not in (req.object or {}):
        ops.insert(0, op_add("/metadata", {}))
    return Decision(
        outcome="mutated",
        patch=ops,
        warnings=warnings,
        audit={"gpu-mode": mode, "gpu-rewrite": summary},
        templates=list(templates.values()),
    )
