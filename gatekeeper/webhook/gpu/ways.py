"""The claim one pod's GPU group gets: its ways, in order, from the mode, the memory and the models asked (pure).

A mode is one way (``shared``: memory on a shareable GPU); ``first-available`` lists several, and the
scheduler takes the first that has room on a node (``firstAvailable``, resource.k8s.io/v1). A model choice
adds the product selector to every way. Two asks expand one way into several sub-requests, because a DRA
request holds one capacity amount and one MIG profile for every device it matches:

* a percentage of a GPU's memory (HAMi's ``gpumem-percentage``) is a different amount on each model, so
  the way becomes one sub-request per model, each asking its share of that model's memory;
* a MIG profile depends on the model (``3g.40gb`` is an H100's, not an A30's), so ``mig-dra`` with a model
  choice gets one selector ORing (model, smallest fitting profile) pairs.

The API allows 8 sub-requests; more are denied, naming the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gatekeeper.webhook.gpu.asks import AskError, MemoryAsk
from gatekeeper.webhook.gpu.claims import ClaimShape, Way, aligned, profile_selector, single_way
from gatekeeper.webhook.gpu.models import GpuModel, describe, gib, largest_memory, product_selector
from gatekeeper.webhook.gpu.modes import PolicyError
from gatekeeper.webhook.gpu.sizing import MIG_CATALOG, mib_quantity, smallest_mig_profile
from gatekeeper.webhook.settings import MEMORY_ANNOTATION, GpuSettings

MAX_SUBREQUESTS = 8
"""``firstAvailable`` holds at most 8 entries (resource.k8s.io/v1 validation)."""


@dataclass(frozen=True)
class GroupAsk:
    """What one claim group asks for, beyond its GPU count."""

    shared_memory: MemoryAsk | None = None
    """Memory per GPU for shared and shares ways (gpu-memory in Kubernetes units, or HAMi's)."""
    mig_memory: MemoryAsk | None = None
    """Memory per GPU for a MIG profile (gpu-memory in the mig modes' units: a bare number is GB)."""
    models: tuple[GpuModel, ...] = ()
    """Models the pod may use; () = any."""
    mig_profile: Callable[[], str] | None = None
    """Without a model choice: the ``migGpuModel`` profile for the pod (raises PolicyError if none fits); called
    only when a mig-dra way is built."""


def _memory_ways(settings: GpuSettings, mode: str, memory: MemoryAsk | None, ask: GroupAsk,
                 label: str) -> list[Way]:
    candidates = ask.models or tuple(settings.gpu_models)
    if memory is None:
        if mode == "shares":
            return [single_way(settings, mode, models=ask.models)]
        raise AskError(f"{label} uses gpu-mode shared but says no GPU memory: set the annotation "
                       f"{MEMORY_ANNOTATION} (e.g. '16Gi') to what one GPU container needs")
    if memory.percent is None:
        nbytes = memory.nbytes or 0
        if nbytes > largest_memory(candidates):
            where = f"the models it may use ({describe(ask.models)})" if ask.models else "any known GPU model"
            biggest = max(candidates, key=lambda m: m.memory_bytes)
            raise AskError(f"{label} asks for {gib(nbytes)} of GPU memory ({memory.source}), more than {where} has "
                           f"(the largest is {biggest.name}, {biggest.memory}): ask for less, or for "
                           f"{'more GPUs' if mode == 'shared' else 'gpu-mode dra'}", "memory-too-large")
        return [single_way(settings, mode, mib_quantity(nbytes), models=ask.models)]
    if len(candidates) > MAX_SUBREQUESTS:
        raise AskError(f"{label} asks for {memory.percent}% of a GPU's memory ({memory.source}), which is a "
                       f"different amount on each of the {len(candidates)} known models; name at most "
                       f"{MAX_SUBREQUESTS} in the annotation gatekeeper.dev/gpu-models", "too-many-ways")
    return [single_way(settings, mode, mib_quantity(memory.bytes_on(m)), models=(m,)) for m in candidates]


def _mig_way(settings: GpuSettings, ask: GroupAsk, label: str) -> Way:
    """mig-dra: the smallest profile that holds the memory, per model the pod may use."""
    if not ask.models:
        if ask.mig_profile is None:
            raise AskError(f"{label} uses gpu-mode mig-dra but no MIG profile can be chosen for it")
        return single_way(settings, "mig-dra", profile=ask.mig_profile())
    memory = ask.mig_memory
    if memory is None:
        raise AskError(f"{label} uses gpu-mode mig-dra with a model choice but says no GPU memory: set "
                       f"{MEMORY_ANNOTATION} (e.g. '20Gi') so each model's MIG profile can be chosen")
    pairs = []
    for m in ask.models:
        fit = smallest_mig_profile(m.name, memory.bytes_on(m)) if m.name in MIG_CATALOG else None
        if fit is not None:
            pairs.append(f"({product_selector(settings.product_attribute, (m,))} && "
                         f"{profile_selector(settings, fit.name)})")
    if not pairs:
        raise AskError(f"{label}: none of the models it may use ({describe(ask.models)}) has a MIG profile with "
                       f"the memory it asks ({memory.source}): choose MIG-capable models, or another gpu-mode",
                       "memory-too-large")
    return Way("mig-dra", settings.mig_device_class, (" || ".join(pairs),))


def ways_of(settings: GpuSettings, mode: str, ask: GroupAsk, label: str) -> list[Way]:
    """The sub-requests one way (mode) of a claim becomes."""
    if mode == "mig-dra":
        return [_mig_way(settings, ask, label)]
    if mode in ("shared", "shares"):
        return _memory_ways(settings, mode, ask.shared_memory, ask, label)
    return [single_way(settings, mode, models=ask.models)]


def claim_shape(settings: GpuSettings, mode: str, count: int, ask: GroupAsk, label: str,
                fallbacks: tuple[str, ...] = ()) -> tuple[ClaimShape, list[str]]:
    """The claim of one group, and warnings: in ``first-available``, a way that cannot serve this pod (a shared
    way without memory, a MIG way the memory is too large for) is left out with a warning, as long as one remains."""
    if mode != "first-available":
        ways = ways_of(settings, mode, ask, label)
        warnings: list[str] = []
    else:
        ways, warnings, errors = [], [], []
        for way in fallbacks:
            try:
                ways += ways_of(settings, way, ask, label)
            except PolicyError as exc:
                if getattr(exc, "reason", "") == "too-many-ways":
                    raise
                errors.append(exc)
                warnings.append(f"first-available: way {way} left out: {exc}"[:300])
        if not ways:
            raise AskError(f"{label}: no way of {', '.join(fallbacks)} can serve it: "
                           + "; ".join(str(e) for e in errors), getattr(errors[0], "reason", "invalid"))
    if len(ways) > MAX_SUBREQUESTS:
        raise AskError(f"{label}: its ways ({', '.join(fallbacks)}) and models make {len(ways)} sub-requests, more "
                       f"than the {MAX_SUBREQUESTS} a claim may list: list fewer ways or models", "too-many-ways")
    if len(ways) > 1:
        seen: dict[str, int] = {}
        for w in ways:
            seen[w.mode] = seen.get(w.mode, 0) + 1
        multi = {m for m, n in seen.items() if n > 1}
        numbered: dict[str, int] = {}
        named = []
        for w in ways:
            i = numbered[w.mode] = numbered.get(w.mode, -1) + 1
            named.append(Way(w.mode, w.device_class, w.selectors, w.capacity,
                             f"{w.mode}-{i}" if w.mode in multi else w.mode))
        ways = named
    align = "" if all(w.mode == "mig-dra" for w in ways) else aligned(settings, count)
    mps = settings.mps_driver if any(w.mode == "mps-dra" for w in ways) else ""
    return ClaimShape(mode, count, tuple(ways), align, mps), warnings
