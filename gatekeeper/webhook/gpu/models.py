"""GPU models a pod may name, and the CEL that picks them by the driver's product attribute (pure).

Why a catalog: people name GPUs as ``H100-80GB`` or ``an A100 or better``; the NVIDIA DRA driver
publishes each GPU's NVML product name (``productName``, e.g. ``NVIDIA H100 80GB HBM3``) and its
memory (``capacity.memory``). The catalog maps the short name to the product names NVML reports for
it (SXM and PCIe parts differ) and to the memory it has, so a pod's choice becomes a selector the
scheduler evaluates, and a typo becomes a denial naming the known models instead of a pod that waits
forever for a GPU no node has.

Memory is nominal (the name's GiB); a real driver publishes NVML's total, a little less (81559Mi for an
H100 80GB HBM3). A percentage of a GPU (HAMi's ``gpumem-percentage``) is computed from it, so an
operator whose GPUs publish less sets ``gpuModels`` to the published value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gatekeeper.kube.admission import quoted
from gatekeeper.webhook.gpu.sizing import GIB, parse_quantity_bytes


@dataclass(frozen=True)
class GpuModel:
    """One GPU model as pods name it and as the driver publishes it."""

    name: str = ""
    """What pods and namespaces write, e.g. ``H100-80GB`` (the MIG catalog's names where the model has MIG)."""
    product_names: list[str] = field(default_factory=list)
    """NVML product names of this model (the driver's ``productName`` attribute), e.g. ``NVIDIA H100 80GB HBM3``."""
    memory: str = ""
    """Memory of one GPU as the driver publishes it (``capacity.memory``), e.g. ``80Gi``."""

    @property
    def memory_bytes(self) -> int:
        return parse_quantity_bytes(self.memory)

    def validate(self) -> None:
        where = f"gpuModels[{self.name or '?'}]"
        if not self.name or "," in self.name or self.name.startswith(">="):
            raise ValueError(f"{where}: name is required and may not contain ',' or start with '>='")
        if not self.product_names:
            raise ValueError(f"{where}: productNames must list the product name(s) the driver publishes")
        if any('"' in p or "\\" in p for p in self.product_names):
            raise ValueError(f"{where}: productNames may not contain '\"' or '\\' (they go into a CEL string)")
        try:
            self.memory_bytes  # noqa: B018 - parse to validate
        except ValueError as exc:
            raise ValueError(f"{where}: memory: {exc}") from None


def _m(name: str, memory_gib: int, *products: str) -> GpuModel:
    return GpuModel(name, list(products), f"{memory_gib}Gi")


DEFAULT_MODELS: tuple[GpuModel, ...] = (
    # NVML product names (nvidia-smi --query-gpu=name) of the data-centre parts; MIG-capable names match
    # sizing.MIG_CATALOG so mig-dra can size per model.
    _m("T4-16GB", 16, "Tesla T4"),
    _m("L4-24GB", 24, "NVIDIA L4"),
    _m("A30-24GB", 24, "NVIDIA A30"),
    _m("A100-40GB", 40, "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"),
    _m("L40S-48GB", 48, "NVIDIA L40S"),
    _m("A100-80GB", 80, "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"),
    _m("H100-80GB", 80, "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"),
    _m("H100-94GB", 94, "NVIDIA H100 NVL"),
    _m("H200-141GB", 141, "NVIDIA H200"),
    _m("B200-180GB", 180, "NVIDIA B200"),
)


class ModelError(ValueError):
    """A pod or namespace names GPU models wrongly; the message names the known ones."""


def parse_choice(text: str, models: tuple[GpuModel, ...] | list[GpuModel], where: str) -> tuple[GpuModel, ...]:
    """``H100-80GB,A100-80GB`` or ``>=40Gi`` (models with at least that much memory per GPU), or both.

    Terms are ORed; the result keeps the catalog's order (smallest first) and is never empty: a name
    not in the catalog, or a minimum no model reaches, is a ModelError listing what is known.
    """
    known = {m.name: m for m in models}
    chosen: dict[str, GpuModel] = {}
    terms = [t.strip() for t in str(text).split(",")]
    for term in terms:
        if not term:
            raise ModelError(f"{where}: empty model name in {quoted(text)}; write names separated by commas, of: "
                             f"{', '.join(known)}")
        if term.startswith(">="):
            try:
                need = parse_quantity_bytes(term[2:])
            except ValueError as exc:
                raise ModelError(f"{where}: {term!r}: {exc}") from None
            fits = [m for m in models if m.memory_bytes >= need]
            if not fits:
                largest = max(models, key=lambda m: m.memory_bytes)
                raise ModelError(f"{where}: no known GPU model has {term[2:]} or more per GPU (the largest is "
                                 f"{largest.name}, {largest.memory}): ask for less")
            chosen.update((m.name, m) for m in fits)
        elif term in known:
            chosen[term] = known[term]
        else:
            raise ModelError(f"{where}: unknown GPU model {quoted(term)}; known models: {', '.join(known)} "
                             "(or '>=SIZE' for any model with that much memory, e.g. '>=40Gi')")
    return tuple(m for m in models if m.name in chosen)


def product_selector(attribute: str, chosen: tuple[GpuModel, ...]) -> str:
    """CEL: the device's product attribute (``domain/name``) is one of the chosen models' product names."""
    domain, _, name = attribute.rpartition("/")
    products = [p for m in chosen for p in m.product_names]
    listed = ", ".join(f'"{p}"' for p in products)
    return f'device.attributes["{domain}"].{name} in [{listed}]'


def describe(chosen: tuple[GpuModel, ...]) -> str:
    return ",".join(m.name for m in chosen)


def largest_memory(models: tuple[GpuModel, ...] | list[GpuModel]) -> int:
    return max((m.memory_bytes for m in models), default=0)


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:g}Gi"
