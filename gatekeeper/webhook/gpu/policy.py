"""GPU pod rewrite policy (mutating, pure); modes.py decides the mode, claims.py builds claims, sizing.py reads sizes.

Why: whole-GPU pods idle at 12-30% utilization, and DRA replaces device-plugin
counting plus custom NUMA/topology schedulers (the seeds' last lesson). At Pod
CREATE, every container (init and sidecar containers included) that asks for
``nvidia.com/gpu`` is rewritten according to the pod's mode:

* ``dra``: a pod ``resourceClaims`` entry per container, pointing at a shared
  ResourceClaimTemplate (``resource.k8s.io/v1``) requesting ``count: N`` devices
  of the device class; 1 < N <= ``alignUpTo`` adds a ``matchAttribute``
  constraint (default ``resource.kubernetes.io/pcieRoot``) so the scheduler
  itself aligns topology.
* ``shared``: the same claim, but each device request also asks for
  ``capacity.requests.memory`` (from ``gatekeeper.dev/gpu-memory``, else the
  namespace's or the configured default). On GPUs published with
  ``allowMultipleAllocations`` (the NVIDIA DRA driver's consumable-shares mode)
  the scheduler packs many such claims onto one GPU until its memory is used:
  this is the mode that raises utilization.
* ``mps-dra``: the same, plus NVIDIA's opaque ``GpuConfig`` with MPS sharing.
* ``time-slicing`` / ``mps``: rename to the device plugin's shared resource.
* ``mig``: rename to ``nvidia.com/mig-<profile>``, the smallest profile that fits
  the ``gatekeeper.dev/gpu-memory`` annotation among those the ``migPools``
  really run, and keep the pod on those pools (migpools.py); without pools, any
  profile of the configured GPU model.
* ``mig-dra``: a claim of MIG partitions (DRA partitionable devices) selected
  by their profile attribute, which the scheduler allocates while the GPU's
  shared counters have room.
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
    quoted,
    short,
)
from gatekeeper.webhook.gpu import migpools
from gatekeeper.webhook.gpu.claims import (
    DRA_API,
    DRA_MODES,
    MANAGED_BY,
    REQUEST_NAME,
    aligned,
    claim_name,
    claim_template,
    template_name,
    template_spec,
)
from gatekeeper.webhook.gpu.migpools import MigChoice
from gatekeeper.webhook.gpu.modes import PolicyError, PolicyForbidden, decide_mode, resolve_mode
from gatekeeper.webhook.gpu.sizing import (
    MIG_CATALOG,
    MigProfile,
    mib_quantity,
    mig_need_bytes,
    parse_quantity,
    parse_quantity_bytes,
    smallest_mig_profile,
)
from gatekeeper.webhook.settings import (
    DECISION_ANNOTATION,
    MEMORY_ANNOTATION,
    REWRITTEN_ANNOTATION,
    GpuSettings,
)

__all__ = [
    "DRA_API",
    "DRA_MODES",
    "GPU",
    "MANAGED_BY",
    "MIG_CATALOG",
    "MIG_PREFIX",
    "POD_CLAIM",
    "REQUEST_NAME",
    "GpuContainer",
    "MigProfile",
    "PolicyError",
    "PolicyForbidden",
    "aligned",
    "claim_groups",
    "claim_name",
    "claim_template",
    "decide_mode",
    "gpu_containers",
    "handles",
    "mig_need_bytes",
    "parse_quantity_bytes",
    "resolve_mode",
    "review",
    "served_by_extended_resource",
    "shared_memory",
    "smallest_mig_profile",
    "template_name",
    "template_spec",
]

GPU = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"


@dataclass(frozen=True)
class GpuContainer:
    """A container asking for whole GPUs, and where it sits in the pod."""

    path: str
    """JSON Pointer of the container, e.g. ``/spec/initContainers/0``."""
    name: str
    count: int
    container: dict[str, Any]


MAX_GPUS = 1 << 20
"""More GPUs than any pod could be given; a larger count is refused instead of becoming a template name."""


def _count(value: Any, where: str) -> int:
    """GPUs asked for, read as the apiserver reads a quantity: ``1000m`` is 1 and ``1e3`` or ``1k`` is 1000
    (``int()`` refused those, so valid pods were denied even in mode off, and took ``1_0`` for 10)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise PolicyError(f"{where}: {GPU} must be a whole number of GPUs, got {quoted(value)}")
    try:
        q = parse_quantity(str(value))
    except ValueError:
        raise PolicyError(f"{where}: {GPU} must be a whole number of GPUs, got {quoted(value)}") from None
    if q < 0:
        raise PolicyError(f"{where}: {GPU} must not be negative, got {quoted(value)}")
    if q != q.to_integral_value() or q > MAX_GPUS:
        raise PolicyError(f"{where}: {GPU} must be a whole number of GPUs (at most {MAX_GPUS}), got {quoted(value)}")
    return int(q)


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


POD_CLAIM = "gpu"
"""The claim app and regular init containers share (never clashes: per-container claims are ``gpu-<name>``)."""


def _regular_init(c: GpuContainer) -> bool:
    return c.path.startswith("/spec/initContainers/") and c.container.get("restartPolicy") != "Always"


def claim_groups(found: list[GpuContainer]) -> list[tuple[str, int, list[GpuContainer]]]:
    """(claim name, GPU count, containers using it), as device-plugin semantics allocate.

    A regular init container runs to completion before the app containers start, so the kubelet
    hands its GPUs on to them: the pod needs max(largest init, sum of app), not the sum of all.
    A claim is reserved for the pod's whole life, so a claim per init container would hold GPUs that
    nobody uses after start-up. With regular init containers asking for GPUs, they and the app
    containers therefore share one claim of that size. Sidecars (``restartPolicy: Always``) run
    beside the app containers and keep a claim of their own, as they keep their own devices with the
    device plugin. Without regular GPU init containers every container keeps its own claim, so
    containers do not see each other's GPUs.
    """
    inits = [c for c in found if _regular_init(c)]
    if not inits:
        return [(claim_name(c.name), c.count, [c]) for c in found]
    app = [c for c in found if c.path.startswith("/spec/containers/")]
    # By path (unique per container), not ``c not in inits + app``: that compared whole containers pairwise, and
    # a pod of 100,000 GPU containers (a 6 MiB review) kept the worker's event loop busy for many minutes.
    shared = {c.path for c in inits} | {c.path for c in app}
    sidecars = [c for c in found if c.path not in shared]
    count = max(max(c.count for c in inits), sum(c.count for c in app))
    return [(POD_CLAIM, count, inits + app)] + [(claim_name(c.name), c.count, [c]) for c in sidecars]


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


def _mig_choice(annotations: dict[str, Any], spec: dict[str, Any], settings: GpuSettings, label: str,
                dynamic: bool = False) -> MigChoice:
    """``dynamic`` (mig-dra): any profile of ``migGpuModel``, no pools (partitions are found by attribute)."""
    raw = annotations.get(MEMORY_ANNOTATION)
    selector = spec.get("nodeSelector")
    pinned = selector.get(settings.mig_pool_label) if isinstance(selector, dict) else None
    pinned = str(pinned) if pinned is not None else None
    if raw is None:
        if settings.mig_default_profile and dynamic:
            return MigChoice(settings.mig_default_profile)
        if settings.mig_default_profile:
            return migpools.choose(settings, None, "", pinned, label)
        what = ("a MIG profile of its pool" if settings.mig_pools and not dynamic
                else f"a {settings.mig_gpu_model} MIG profile")
        raise PolicyError(f"{label} uses gpu-mode {'mig-dra' if dynamic else 'mig'} but has no {MEMORY_ANNOTATION} "
                          "annotation "
                          f"(e.g. '20Gi'): set it so {what} can be chosen")
    try:
        need = mig_need_bytes(str(raw))
    except ValueError as exc:
        raise PolicyError(f"{label}: {exc}") from None
    if dynamic:
        return MigChoice(migpools.catalog_profile(settings, need, str(raw), label))
    return migpools.choose(settings, need, str(raw), pinned, label)


def shared_memory(annotations: dict[str, Any], namespace: str, settings: GpuSettings, label: str) -> str:
    """The capacity request (whole MiB, rounded up) of a shared pod's GPUs; where it came from is in the error."""
    raw = annotations.get(MEMORY_ANNOTATION)
    source = f"annotation {MEMORY_ANNOTATION}"
    if raw is None:
        raw = settings.namespace_gpu_memory.get(namespace) or settings.shared_default_memory
        source = f"the default for namespace {namespace}"
    if not raw:
        raise PolicyError(f"{label} uses gpu-mode shared but says no GPU memory: set the annotation "
                          f"{MEMORY_ANNOTATION} (e.g. '16Gi') to what one GPU container needs")
    try:
        return mib_quantity(parse_quantity_bytes(str(raw)))
    except ValueError as exc:
        raise PolicyError(f"{label}: {source}: {exc}") from None


def handles(req: AdmissionRequest, settings: GpuSettings) -> bool:
    return (settings.enabled and req.kind == "Pod" and req.group == "" and not req.sub_resource
            and req.operation == "CREATE")


def served_by_extended_resource(found: list[GpuContainer], settings: GpuSettings) -> bool:
    """Whether KEP-5004 alone gives these containers what ``dra`` mode would.

    With a DeviceClass mapping ``nvidia.com/gpu`` the scheduler turns each container's count into a
    DRA request itself; what it cannot add is a topology constraint, so only claims that
    :func:`aligned` would constrain still need our rewrite.
    """
    return not any(aligned(settings, count) for _, count, _ in claim_groups(found))


def review(req: AdmissionRequest, settings: GpuSettings, extended_resource_mapped: bool = False,
           namespace_label_mode: str | None = None) -> Decision:
    """Decide one Pod CREATE (callers check :func:`handles` first).

    ``extended_resource_mapped``: a DeviceClass has ``extendedResourceName: nvidia.com/gpu`` (KEP-5004);
    with ``settings.kep5004 == "step-aside"`` plain ``dra`` pods that need nothing more are then left for the
    scheduler to serve. With ``rewrite`` (the default) the mapping changes nothing here.
    ``namespace_label_mode``: the pod's namespace's ``gatekeeper.dev/gpu-mode`` label, if any.
    """
    pod = req.object or {}
    meta, spec = as_dict(pod.get("metadata")), as_dict(pod.get("spec"))
    annotations = as_dict(meta.get("annotations"))
    label = object_label("Pod", req.namespace, meta)
    try:
        found = gpu_containers(spec, label)
        if not found:
            return Decision(outcome="skipped")
        groups = as_dict(req.raw.get("userInfo")).get("groups") or []
        mode, source = decide_mode(annotations, req.namespace, settings, groups, namespace_label_mode)
        if mode == "off":
            return Decision(outcome="skipped", audit={"gpu-mode": "off", "gpu-mode-source": source})
        # A pod we rewrote before (reinvocation after a later webhook injected another GPU container)
        # has our own claims and shared names; only a pod that came with its own is left alone.
        if REWRITTEN_ANNOTATION not in annotations and _already_shared_or_dra(spec, settings):
            if source == "enforced":
                # Skipping would leave nvidia.com/gpu in place: whole GPUs through the device plugin, in the
                # very namespace whose mode is meant to hold. One claim or shared GPU of the pod's own was
                # enough to get them.
                raise PolicyForbidden(
                    f"namespace {req.namespace} enforces gpu-mode {mode}, but {label} asks for {GPU} beside DRA "
                    f"claims or shared GPUs of its own, which gatekeeper does not rewrite: remove {GPU} (gatekeeper "
                    f"then leaves the pod as it is) or the pod's own claims and shared GPU resources")
            return Decision(outcome="skipped", warnings=[
                f"{label} already uses DRA claims or shared GPUs; its {GPU} requests were left as they are"])
        if (mode == "dra" and extended_resource_mapped and settings.kep5004 == "step-aside"
                and served_by_extended_resource(found, settings)):
            return Decision(outcome="skipped", audit={"gpu-mode": "dra", "gpu-mode-source": source,
                                                      "gpu-kep5004": "served"}, warnings=[short(
                f"gatekeeper (dra): {label} left as it is: a DeviceClass maps {GPU} (KEP-5004), so the "
                "scheduler allocates its GPUs through DRA itself")])
        decision = _rewrite(req, settings, mode, found, spec, meta, annotations, label)
        decision.audit["gpu-mode-source"] = source
        recorded = f"mode={mode} source={source}"
        if annotations.get(DECISION_ANNOTATION) != recorded:
            # After the rewritten annotation, whose add created the map if the pod had none. Written whenever it
            # differs, not only when absent: a pod created with its own "mode=shared source=enforced" kept it
            # while being rewritten by opt-out to dra. On reinvocation the value is ours and equal: no op.
            decision.patch.append(op_add(f"/metadata/annotations/{escape(DECISION_ANNOTATION)}", recorded))
        return decision
    except PolicyForbidden as exc:
        return Decision(allowed=False, outcome="denied", message=str(exc), code=403, reason="Forbidden",
                        audit={"gpu-denied": str(exc), "gpu-mode-source": "enforced"})
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
    memory = shared_memory(annotations, req.namespace, settings, label) if mode == "shared" else ""
    profile = _mig_choice(annotations, spec, settings, label, dynamic=True).profile if mode == "mig-dra" else ""
    if mode in DRA_MODES:
        for cname, count, members in claim_groups(found):
            tmpl = claim_template(settings, mode, count, req.namespace, memory, profile)
            tname = tmpl["metadata"]["name"]
            templates[tname] = tmpl
            if cname in taken:
                raise PolicyError(f"{label}: container {members[0].name} would get DRA claim {cname}, but the pod "
                                  "already has a resourceClaims entry of that name: rename one of them")
            claims.append({"name": cname, "resourceClaimTemplateName": tname})
            for c in members:
                ops += _drop_gpu(c)
                res, _, _ = _resource_maps(c.container)
                ops += append_list_items(res.get("claims"), f"{c.path}/resources/claims", [{"name": cname}])
                notes.append(f"{c.name}:{c.count}->{cname}" + (f"@{memory or profile}" if memory or profile else ""))
                warnings.append(short(f"gatekeeper ({mode}): container {c.name}: {GPU}={c.count} -> "
                                      f"DRA claim {cname} ({tname})"))
    else:
        mig = _mig_choice(annotations, spec, settings, label) if mode == "mig" else None
        if mig is not None and mig.pools:
            ops += migpools.placement_ops(spec, settings.mig_pool_label, mig.pools)
            notes.append("pools=" + ",".join(p.name for p in mig.pools))
        for c in found:
            if mode == "mps" and c.count > 1:
                raise PolicyError(
                    f"{label}: container {c.name} asks for {GPU}={c.count} in gpu-mode mps, but an MPS share is "
                    f"one GPU (the device plugin refuses more): ask for 1, or use gpu-mode dra or mps-dra "
                    f"for {c.count} GPUs")
            if mig is not None:
                new = MIG_PREFIX + mig.profile
            else:
                new = settings.time_slicing_resource if mode == "time-slicing" else settings.mps_resource
            ops += _rename(c, new)
            notes.append(f"{c.name}:{c.count}->{new}")
            warnings.append(short(f"gatekeeper ({mode}): container {c.name}: {GPU}={c.count} -> {new}={c.count}"))
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
