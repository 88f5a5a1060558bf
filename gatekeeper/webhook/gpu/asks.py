"""What a GPU pod asks for in the words people write (pure): HAMi's resource names, model choice, fallbacks.

HAMi (Project-HAMi) users write, per container, ``nvidia.com/gpumem`` (MiB of one GPU's memory),
``nvidia.com/gpumem-percentage`` (percent of it; HAMi refuses it together with gpumem) and
``nvidia.com/gpucores`` (percent of the SMs), with ``nvidia.com/gpu`` the number of GPUs (1 when only the
others are set, HAMi's ``defaultGPUNum``). Once HAMi is gone no node advertises those names and such a
pod waits forever, so they are read as a ``shared`` ask: memory becomes a DRA capacity request. Cores have
no DRA counterpart: they are recorded, not enforced.

Every denial here is a :class:`AskError` with a ``reason`` (the label of
``gatekeeper_webhook_gpu_denials_total``) and a message that says what to write instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gatekeeper.kube.admission import quoted
from gatekeeper.webhook.gpu.models import GpuModel, ModelError, parse_choice
from gatekeeper.webhook.gpu.modes import PolicyError
from gatekeeper.webhook.gpu.sizing import MIB, parse_quantity
from gatekeeper.webhook.settings import (
    FALLBACK_WAYS,
    FALLBACKS_ANNOTATION,
    MEMORY_ANNOTATION,
    MODELS_ANNOTATION,
    GpuSettings,
)

HAMI_MEMORY = "nvidia.com/gpumem"
HAMI_PERCENT = "nvidia.com/gpumem-percentage"
HAMI_CORES = "nvidia.com/gpucores"
ALIASES = (HAMI_MEMORY, HAMI_PERCENT, HAMI_CORES)
MAX_MIB = 16 * 1024 * 1024
"""16 TiB in MiB: more than any GPU; a larger gpumem is refused instead of becoming a huge quantity."""


class AskError(PolicyError):
    """A pod's GPU ask cannot be served as written; ``reason`` labels the denial counter."""

    def __init__(self, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class AliasAsk:
    """One container's HAMi resources (None: not set)."""

    memory_mib: int | None = None
    percent: int | None = None
    cores: int | None = None


def _whole(value: Any, name: str, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise AskError(f"{where}: {name} must be a whole number, got {quoted(value)}")
    try:
        q = parse_quantity(str(value))
    except ValueError:
        raise AskError(f"{where}: {name} must be a whole number, got {quoted(value)}") from None
    if q != q.to_integral_value() or not low <= q <= high:
        raise AskError(f"{where}: {name} must be a whole number from {low} to {high}, got {quoted(value)}")
    return int(q)


def alias_ask(container: dict[str, Any], where: str) -> AliasAsk | None:
    """The container's HAMi ask (limits first, then requests, as HAMi reads them); None if it has none."""
    res = container.get("resources")
    res = res if isinstance(res, dict) else {}
    found: dict[str, Any] = {}
    for key in ("requests", "limits"):
        m = res.get(key)
        if isinstance(m, dict):
            found.update({k: m[k] for k in ALIASES if k in m})
    if not found:
        return None
    mem = found.get(HAMI_MEMORY)
    pct = found.get(HAMI_PERCENT)
    if mem is not None and pct is not None:
        raise AskError(f"{where} asks for both {HAMI_MEMORY} and {HAMI_PERCENT}, which HAMi refuses too: keep one "
                       "(MiB of memory, or a percentage of the GPU's)", "contradictory-ask")
    return AliasAsk(
        memory_mib=None if mem is None else _whole(mem, HAMI_MEMORY, where, 1, MAX_MIB),
        percent=None if pct is None else _whole(pct, HAMI_PERCENT, where, 1, 100),
        cores=None if found.get(HAMI_CORES) is None else _whole(found[HAMI_CORES], HAMI_CORES, where, 0, 100))


@dataclass(frozen=True)
class MemoryAsk:
    """GPU memory one device of a claim needs: bytes, or a percentage of whichever model it lands on."""

    nbytes: int | None = None
    percent: int | None = None
    source: str = ""
    """Where it came from, for messages: the annotation, a namespace default, or a container's HAMi resource."""

    def bytes_on(self, model: GpuModel) -> int:
        if self.percent is not None:
            return -(-model.memory_bytes * self.percent // 100 // MIB) * MIB  # whole MiB, rounded up
        return self.nbytes or 0


def merge_aliases(asks: list[AliasAsk], annotated: int | None, where: str) -> MemoryAsk | None:
    """One claim's memory from its containers' HAMi asks (the largest: init containers hand their GPU on).

    ``annotated``: bytes of ``gatekeeper.dev/gpu-memory``; a pod that says both must say the same.
    """
    mibs = [a.memory_mib for a in asks if a.memory_mib is not None]
    pcts = [a.percent for a in asks if a.percent is not None]
    if mibs and pcts:
        raise AskError(f"{where}: its containers mix {HAMI_MEMORY} and {HAMI_PERCENT} in one claim: use one of them "
                       "in every container", "contradictory-ask")
    if pcts:
        if annotated is not None:
            raise AskError(f"{where} asks for {HAMI_PERCENT} and {MEMORY_ANNOTATION}: remove one of them",
                           "contradictory-ask")
        return MemoryAsk(percent=max(pcts), source=HAMI_PERCENT)
    if not mibs:
        return None
    nbytes = max(mibs) * MIB
    if annotated is not None and annotated != nbytes:
        raise AskError(f"{where} asks for {HAMI_MEMORY}={max(mibs)} (MiB) but {MEMORY_ANNOTATION} says "
                       f"{annotated // MIB}Mi: remove one of them, or make them equal", "contradictory-ask")
    return MemoryAsk(nbytes=nbytes, source=HAMI_MEMORY)


def model_choice(annotations: dict[str, Any], namespace: str, settings: GpuSettings,
                 where: str) -> tuple[GpuModel, ...]:
    """The models the pod may use: its annotation, else its namespace's default; () when neither says."""
    raw = annotations.get(MODELS_ANNOTATION)
    source = f"annotation {MODELS_ANNOTATION}"
    if raw is None:
        raw = settings.namespace_gpu_models.get(namespace)
        source = f"namespace {namespace}'s default (namespaceGpuModels)"
    if raw is None:
        return ()
    if not isinstance(raw, str):
        raise AskError(f"{where}: {source} must be a string, got {quoted(raw)}", "unknown-model")
    try:
        return parse_choice(raw, settings.gpu_models, f"{where}: {source}")
    except ModelError as exc:
        raise AskError(str(exc), "unknown-model") from None


def fallbacks(annotations: dict[str, Any], settings: GpuSettings, where: str) -> tuple[str, ...]:
    """The ordered ways of a ``first-available`` pod: its annotation, else the ``fallbacks`` setting."""
    raw = annotations.get(FALLBACKS_ANNOTATION)
    if raw is None:
        return tuple(settings.fallbacks)
    ways = [w.strip() for w in str(raw).split(",")] if isinstance(raw, str) else []
    bad = [w for w in ways if w not in FALLBACK_WAYS]
    if not ways or bad or len(set(ways)) != len(ways):
        what = f"unknown way {quoted(bad[0])}" if bad else "a list of distinct ways"
        raise AskError(f"{where}: annotation {FALLBACKS_ANNOTATION}: {what}; write an ordered list of "
                       f"{', '.join(FALLBACK_WAYS)}, e.g. 'mig-dra,shared,dra'", "unknown-fallback")
    return tuple(ways)
