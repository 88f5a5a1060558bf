"""The DRA claims of a rewritten pod: one per claim group, each built from what the group asks (pure).

What a group asks comes from the pod (``gatekeeper.dev/gpu-memory``, ``gpu-models``, ``gpu-fallbacks``), its
namespace's defaults, and its containers' HAMi resources; ways.py turns that into the claim's ways.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gatekeeper.kube.admission import PatchOp, append_list_items, short
from gatekeeper.webhook.gpu import migpools
from gatekeeper.webhook.gpu.asks import MemoryAsk, fallbacks, merge_aliases, model_choice
from gatekeeper.webhook.gpu.claims import ClaimShape, shape_template
from gatekeeper.webhook.gpu.containers import GPU, GpuContainer, claim_groups, drop_gpu, resource_maps
from gatekeeper.webhook.gpu.migpools import MigChoice
from gatekeeper.webhook.gpu.modes import PolicyError
from gatekeeper.webhook.gpu.sizing import mib_quantity, mig_need_bytes, parse_quantity_bytes
from gatekeeper.webhook.gpu.ways import GroupAsk, claim_shape
from gatekeeper.webhook.settings import MEMORY_ANNOTATION, GpuSettings


def mig_choice(annotations: dict[str, Any], spec: dict[str, Any], settings: GpuSettings, label: str,
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




def _annotated_bytes(annotations: dict[str, Any], namespace: str, settings: GpuSettings,
                     label: str) -> tuple[int | None, str, bool]:
    """(bytes, source, from the pod's own annotation) of the shared memory ask; None when nothing says."""
    raw = annotations.get(MEMORY_ANNOTATION)
    if raw is not None:
        return parse_quantity_bytes(shared_memory(annotations, namespace, settings, label)), \
            f"annotation {MEMORY_ANNOTATION}", True
    default = settings.namespace_gpu_memory.get(namespace) or settings.shared_default_memory
    if not default:
        return None, "", False
    return parse_quantity_bytes(shared_memory(annotations, namespace, settings, label)), \
        f"the default for namespace {namespace}", False


def _group_ask(settings: GpuSettings, annotations: dict[str, Any], spec: dict[str, Any], namespace: str,
               members: list[GpuContainer], models: tuple[Any, ...], label: str, shared: bool) -> GroupAsk:
    """``shared``: a shared or shares way is built, so gpu-memory is read in Kubernetes units (the mig modes
    read a bare number as GB, and a dra pod's annotation is not read at all)."""
    annotated, source, own = _annotated_bytes(annotations, namespace, settings, label) if shared else (None, "", False)
    aliases = [c.alias for c in members if c.alias is not None]
    alias_memory = merge_aliases(aliases, annotated if own else None, label) if aliases else None
    shared_ask = alias_memory or (MemoryAsk(nbytes=annotated, source=source) if annotated is not None else None)
    if alias_memory is not None:
        mig_memory: MemoryAsk | None = alias_memory
    else:
        raw = annotations.get(MEMORY_ANNOTATION)
        try:
            mig_memory = MemoryAsk(nbytes=mig_need_bytes(str(raw)), source=f"annotation {MEMORY_ANNOTATION}") \
                if raw is not None else None
        except ValueError:
            mig_memory = None  # only a mig-dra way reads it, and mig_choice explains the error

    def profile() -> str:
        if alias_memory is not None and alias_memory.nbytes:
            return migpools.catalog_profile(settings, alias_memory.nbytes, alias_memory.source, label)
        return mig_choice(annotations, spec, settings, label, dynamic=True).profile

    return GroupAsk(shared_ask, mig_memory, models, profile)


@dataclass
class DraRewrite:
    """What the DRA branch of a rewrite adds: patch, pod claims, templates, and words for people."""

    ops: list[PatchOp] = field(default_factory=list)
    claims: list[dict[str, str]] = field(default_factory=list)
    templates: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _note(shape: ClaimShape) -> str:
    way = shape.ways[0]
    if len(shape.ways) > 1:
        return "@{" + ",".join(w.name for w in shape.ways) + "}"
    memory = dict(way.capacity).get("memory", "")
    profile = next((e.rpartition("== ")[2].strip('"') for e in way.selectors if "profile ==" in e), "")
    return f"@{memory or profile}" if memory or profile else ""


def dra_claims(settings: GpuSettings, mode: str, found: list[GpuContainer], spec: dict[str, Any],
               annotations: dict[str, Any], namespace: str, label: str) -> DraRewrite:
    """One claim per claim group; raises PolicyError (an AskError with a reason) when the pod cannot be served."""
    out = DraRewrite()
    existing = spec.get("resourceClaims")
    taken = {rc.get("name") for rc in existing if isinstance(rc, dict)} if isinstance(existing, list) else set()
    models = model_choice(annotations, namespace, settings, label)
    ways = fallbacks(annotations, settings, label) if mode == "first-available" else ()
    shared = bool({mode, *ways} & {"shared", "shares"})
    for cname, count, members in claim_groups(found):
        ask = _group_ask(settings, annotations, spec, namespace, members, models, label, shared)
        shape, warnings = claim_shape(settings, mode, count, ask, label, ways)
        out.warnings += [short(w) for w in warnings]
        tmpl = shape_template(settings, shape, namespace)
        tname = tmpl["metadata"]["name"]
        out.templates[tname] = tmpl
        if cname in taken:
            raise PolicyError(f"{label}: container {members[0].name} would get DRA claim {cname}, but the pod "
                              "already has a resourceClaims entry of that name: rename one of them")
        out.claims.append({"name": cname, "resourceClaimTemplateName": tname})
        for c in members:
            out.ops += drop_gpu(c)
            res, _, _ = resource_maps(c.container)
            out.ops += append_list_items(res.get("claims"), f"{c.path}/resources/claims", [{"name": cname}])
            out.notes.append(f"{c.name}:{c.count}->{cname}{_note(shape)}")
            out.warnings.append(short(f"gatekeeper ({mode}): container {c.name}: {GPU}={c.count} -> "
                                      f"DRA claim {cname} ({tname})"))
            if c.alias is not None and c.alias.cores is not None:
                out.warnings.append(short(f"gatekeeper: container {c.name}: nvidia.com/gpucores={c.alias.cores} "
                                          "is recorded, not enforced: DRA has no share of SMs"))
    if models:
        out.notes.append("models=" + ",".join(m.name for m in models))
    return out
