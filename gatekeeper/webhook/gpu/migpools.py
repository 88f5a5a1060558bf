"""Which MIG profile a pod gets, and on which node pools it may run (pure).

Why pools: a MIG profile exists only where a node's MIG layout created it. One
cluster-wide GPU model lets the webhook pick ``nvidia.com/mig-2g.10gb`` for a
cluster whose nodes all run ``all-1g.10gb``, and the pod waits forever. With
``migPools`` every pool names its GPU model and layout (or profile list), and
sizing picks only profiles some pool really offers.

Choice: in each candidate pool the smallest allowed profile whose memory is at
least the ask (names count GB, 10^9 bytes, a lower bound of the real size: round
up, never down); across pools the smallest of those, by memory, then compute
slices (least waste; more left for other pods). A container asks for one
resource name, so only pools offering that very profile can take the pod: one
pool gets a ``nodeSelector``; several get one ``nodeAffinity`` ``In`` term, so
the scheduler still chooses among all the capacity that fits rather than the
webhook pinning a single pool. A pod whose ``nodeSelector`` already names a pool
is sized for that pool only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gatekeeper.kube.admission import PatchOp, add_map_entry, escape, op_add, short
from gatekeeper.webhook.gpu.modes import PolicyError
from gatekeeper.webhook.gpu.sizing import MIG_CATALOG, smallest_mig_profile
from gatekeeper.webhook.settings import GpuSettings, MigPool

REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


@dataclass(frozen=True)
class MigChoice:
    """The profile every GPU container of the pod gets, and the pools that offer it (empty: no pools set)."""

    profile: str
    pools: tuple[MigPool, ...] = ()


def _gb(nbytes: int) -> str:
    return f"{nbytes / 10**9:.1f} GB"


def _describe(pools: list[MigPool]) -> str:
    return "; ".join(f"{p.name} ({p.gpu_model}): {', '.join(p.allowed())}" for p in pools)


def choose(settings: GpuSettings, need_bytes: int | None, raw: str, pinned: str | None, label: str) -> MigChoice:
    """``need_bytes`` None: the pod has no gpu-memory, use ``migDefaultProfile`` (the caller checked it is set).

    ``pinned``: the pod's own ``nodeSelector`` value for ``migPoolLabel``, if any.
    """
    if not settings.mig_pools:
        return MigChoice(catalog_profile(settings, need_bytes, raw, label))
    key = settings.mig_pool_label
    pools = list(settings.mig_pools)
    if pinned is not None:
        pools = [p for p in pools if p.label_value == pinned]
        if not pools:
            raise PolicyError(
                f"{label} pins nodeSelector {key}={pinned}, but no MIG pool has that value (pools: "
                f"{', '.join(f'{p.name}={p.label_value}' for p in settings.mig_pools)}): pin one of them, "
                "or drop the nodeSelector and let the webhook choose")
    if need_bytes is None:
        best = settings.mig_default_profile
        offering = tuple(p for p in pools if best in p.allowed())
        if not offering:
            raise PolicyError(f"{label} has no gatekeeper.dev/gpu-memory, and the default MIG profile {best} is "
                              f"offered by none of its pools ({_describe(pools)}): set gatekeeper.dev/gpu-memory")
        return MigChoice(best, offering)
    fits = [f for f in (smallest_mig_profile(p.gpu_model, need_bytes, p.allowed()) for p in pools) if f]
    if not fits:
        where = f"pool {pools[0].name}" if pinned is not None else "any MIG pool"
        raise PolicyError(
            f"{label} needs {short(raw, 40)} ({_gb(need_bytes)}) of GPU memory per GPU (gatekeeper.dev/gpu-memory), "
            "more than "
            f"the largest MIG profile of {where} ({_describe(pools)}): ask for less, or use gpu-mode dra or "
            "shared for a whole or shared GPU")
    best_profile = min(fits, key=lambda p: (p.memory_gb, p.slices))
    return MigChoice(best_profile.name, tuple(p for p in pools if best_profile.name in p.allowed()))


def catalog_profile(settings: GpuSettings, need_bytes: int | None, raw: str, label: str) -> str:
    """Any profile of ``migGpuModel``: one model for every node, as before pools existed, and mig-dra,
    where the driver creates whichever profile a claim asks for (dynamic MIG), so no layout limits it."""
    if need_bytes is None:
        return settings.mig_default_profile
    profile = smallest_mig_profile(settings.mig_gpu_model, need_bytes)
    if profile is None:
        largest = max(MIG_CATALOG[settings.mig_gpu_model], key=lambda p: p.memory_gb)
        raise PolicyError(
            f"{label} needs {short(raw, 40)} of GPU memory (gatekeeper.dev/gpu-memory), more than the largest "
            f"{settings.mig_gpu_model} MIG profile {largest.name}: use gpu-mode dra for whole GPUs")
    return profile.name


def placement_ops(spec: dict[str, Any], key: str, pools: tuple[MigPool, ...]) -> list[PatchOp]:
    """Keep the pod on ``pools``: a nodeSelector for one, a nodeAffinity ``In`` term for several.

    Existing required node-affinity terms are ORed by the scheduler, so the expression is added to
    every one of them (ANDed inside each); adding a term of our own would widen, not narrow.
    """
    if not pools:
        return []
    selector = spec.get("nodeSelector") if isinstance(spec.get("nodeSelector"), dict) else None
    if len(pools) == 1:
        value = pools[0].label_value
        if selector is not None and selector.get(key) == value:
            return []
        return [add_map_entry(selector, "/spec/nodeSelector", key, value)]
    expr = {"key": key, "operator": "In", "values": sorted(p.label_value for p in pools)}
    term = {"nodeSelectorTerms": [{"matchExpressions": [expr]}]}
    affinity = spec.get("affinity")
    if not isinstance(affinity, dict):
        return [op_add("/spec/affinity", {"nodeAffinity": {REQUIRED: term}})]
    node = affinity.get("nodeAffinity")
    if not isinstance(node, dict):
        return [op_add("/spec/affinity/nodeAffinity", {REQUIRED: term})]
    required = node.get(REQUIRED)
    base = f"/spec/affinity/nodeAffinity/{escape(REQUIRED)}"
    terms = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    if not isinstance(terms, list) or not terms:
        return [op_add(base, term)]
    ops: list[PatchOp] = []
    for i, t in enumerate(terms):
        exprs = t.get("matchExpressions") if isinstance(t, dict) else None
        if isinstance(exprs, list) and expr in exprs:
            continue  # reinvocation: this term already keeps the pod on the pools
        if isinstance(exprs, list):
            ops.append(op_add(f"{base}/nodeSelectorTerms/{i}/matchExpressions/-", expr))
        else:
            ops.append(op_add(f"{base}/nodeSelectorTerms/{i}/matchExpressions", [expr]))
    return ops
