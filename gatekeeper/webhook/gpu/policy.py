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
    short,
)
from gatekeeper.webhook.gpu import migpools
from gatekeeper.webhook.gpu.asks import AskError
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
from gatekeeper.webhook.gpu.containers import (
    GPU,
    MIG_PREFIX,
    POD_CLAIM,
    GpuContainer,
    already_shared_or_dra,
    claim_groups,
    gpu_containers,
    rename,
)
from gatekeeper.webhook.gpu.dra_rewrite import dra_claims, mig_choice, shared_memory
from gatekeeper.webhook.gpu.modes import PolicyError, PolicyForbidden, decide_mode, resolve_mode
from gatekeeper.webhook.gpu.sizing import (
    MIG_CATALOG,
    MigProfile,
    mig_need_bytes,
    parse_quantity_bytes,
    smallest_mig_profile,
)
from gatekeeper.webhook.settings import (
    DECISION_ANNOTATION,
    MEMORY_ANNOTATION,
    MODELS_ANNOTATION,
    REWRITTEN_ANNOTATION,
    GpuSettings,
)

__all__ = [
    "DRA_API",
    "DRA_MODES",
    "GPU",
    "MANAGED_BY",
    "MEMORY_ANNOTATION",
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
        found = gpu_containers(spec, label, aliases=settings.hami_aliases)
        if not found:
            return Decision(outcome="skipped")
        groups = as_dict(req.raw.get("userInfo")).get("groups") or []
        mode, source = decide_mode(annotations, req.namespace, settings, groups, namespace_label_mode)
        mode, source = _asked_mode(found, mode, source, annotations, label)
        if mode == "off":
            return Decision(outcome="skipped", audit={"gpu-mode": "off", "gpu-mode-source": source})
        # A pod we rewrote before (reinvocation after a later webhook injected another GPU container)
        # has our own claims and shared names; only a pod that came with its own is left alone.
        if REWRITTEN_ANNOTATION not in annotations and already_shared_or_dra(spec, settings):
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
                        audit={"gpu-denied": str(exc), "gpu-mode-source": "enforced", DENIED_REASON: "forbidden"})
    except PolicyError as exc:
        return Decision(allowed=False, outcome="denied", message=str(exc), code=422, reason="Invalid",
                        audit={"gpu-denied": str(exc), DENIED_REASON: getattr(exc, "reason", "invalid")})


DENIED_REASON = "gpu-denied-reason"
"""Audit key of a denial's reason: the ``reason`` label of ``gatekeeper_webhook_gpu_denials_total``."""
ALIAS_MODES = ("shared", "shares", "mig-dra", "first-available")
"""Modes that can serve a share of a GPU's memory, as HAMi's resources ask."""


def _asked_mode(found: list[GpuContainer], mode: str, source: str, annotations: dict[str, Any],
                label: str) -> tuple[str, str]:
    """The mode once HAMi resources and model choice are read: a HAMi pod whose mode is only the cluster's default
    (``off`` or one that cannot hold a share) is ``shared`` (source ``hami-alias``); one whose annotation or
    namespace chose such a mode, or a model choice in a device-plugin mode, is a contradiction, denied with the
    fix rather than silently half-served."""
    if MODELS_ANNOTATION in annotations and mode in ("time-slicing", "mps", "mig"):
        raise AskError(f"{label} names GPU models ({MODELS_ANNOTATION}) but gpu-mode {mode} ({source}) goes through "
                       "the device plugin, which cannot choose a model: use a DRA mode (dra, shared, shares, mig-dra, "
                       "first-available) or remove the annotation", "contradictory-ask")
    asked = [c for c in found if c.alias is not None]
    if not asked:
        return mode, source
    if source == "default" and mode not in ALIAS_MODES:
        return "shared", "hami-alias"  # the pod's own ask is more specific than the cluster's default
    if mode == "off":
        return mode, source
    if mode not in ALIAS_MODES:
        what = "HAMi resources (nvidia.com/gpumem, gpumem-percentage or gpucores)"
        raise AskError(f"{label}: container {asked[0].name} asks for a share of a GPU with {what}, but gpu-mode "
                       f"{mode} ({source}) cannot serve one: remove them, or use gpu-mode {', '.join(ALIAS_MODES)}",
                       "contradictory-ask")
    return mode, source


def _rewrite(req: AdmissionRequest, settings: GpuSettings, mode: str, found: list[GpuContainer],
             spec: dict[str, Any], meta: dict[str, Any], annotations: dict[str, Any], label: str) -> Decision:
    ops: list[PatchOp] = []
    notes: list[str] = []
    warnings: list[str] = []
    templates: dict[str, dict[str, Any]] = {}
    claims: list[dict[str, str]] = []
    if mode in DRA_MODES:
        dra = dra_claims(settings, mode, found, spec, annotations, req.namespace, label)
        ops, claims, templates, notes, warnings = dra.ops, dra.claims, dra.templates, dra.notes, dra.warnings
    else:
        mig = mig_choice(annotations, spec, settings, label) if mode == "mig" else None
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
            ops += rename(c, new)
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
