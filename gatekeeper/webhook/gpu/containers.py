"""The containers of a pod that ask for GPUs, and the JSON Patch that takes their device-plugin asks away (pure).

A container asks for GPUs with ``nvidia.com/gpu``, or (HAMi) with ``nvidia.com/gpumem``,
``gpumem-percentage`` or ``gpucores`` alone, which HAMi reads as one GPU (its ``defaultGPUNum``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gatekeeper.kube.admission import PatchOp, as_dict, escape, op_add, op_remove, quoted
from gatekeeper.webhook.gpu.asks import ALIASES, AliasAsk, alias_ask
from gatekeeper.webhook.gpu.claims import claim_name
from gatekeeper.webhook.gpu.modes import PolicyError
from gatekeeper.webhook.gpu.sizing import parse_quantity
from gatekeeper.webhook.settings import GpuSettings

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
    alias: AliasAsk | None = None
    """The container's HAMi resources, when the policy reads them (``hamiAliases``)."""


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


def resource_maps(c: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    res = as_dict(c.get("resources"))
    limits, requests = res.get("limits"), res.get("requests")
    return (res, limits if isinstance(limits, dict) else None,
            requests if isinstance(requests, dict) else None)


def all_containers(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for key in ("initContainers", "containers"):
        items = spec.get(key)
        if isinstance(items, list):
            out += [(f"/spec/{key}/{i}", c) for i, c in enumerate(items) if isinstance(c, dict)]
    return out


def gpu_containers(spec: dict[str, Any], label: str, aliases: bool = False) -> list[GpuContainer]:
    """``aliases``: also read HAMi's resources (a container with only those asks for one GPU)."""
    out = []
    for path, c in all_containers(spec):
        _, limits, requests = resource_maps(c)
        raw = (limits or {}).get(GPU, (requests or {}).get(GPU))
        where = f"{label} container {c.get('name', '?')}"
        alias = alias_ask(c, where) if aliases else None
        if raw is None and alias is None:
            continue
        n = 1 if raw is None else _count(raw, where)
        if n > 0:
            out.append(GpuContainer(path, str(c.get("name", "")), n, c, alias))
    return out


def already_shared_or_dra(spec: dict[str, Any], settings: GpuSettings) -> bool:
    if spec.get("resourceClaims"):
        return True
    shared = {settings.time_slicing_resource, settings.mps_resource}
    for _, c in all_containers(spec):
        res, limits, requests = resource_maps(c)
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


def drop_gpu(c: GpuContainer) -> list[PatchOp]:
    """Remove nvidia.com/gpu (and HAMi's names, when read) from limits and requests (the whole map if it held
    nothing else): no node advertises them once the claim serves the container."""
    _, limits, requests = resource_maps(c.container)
    names = (GPU, *ALIASES) if c.alias is not None else (GPU,)
    ops: list[PatchOp] = []
    for key, m in (("limits", limits), ("requests", requests)):
        present = [n for n in names if m is not None and n in m]
        if not present or m is None:
            continue
        if len(present) == len(m):
            ops.append(op_remove(f"{c.path}/resources/{key}"))
        else:
            ops += [op_remove(f"{c.path}/resources/{key}/{escape(n)}") for n in present]
    return ops


def rename(c: GpuContainer, new: str) -> list[PatchOp]:
    """Move the GPU count to ``new`` in limits (always) and requests (if it was there)."""
    _, limits, requests = resource_maps(c.container)
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


