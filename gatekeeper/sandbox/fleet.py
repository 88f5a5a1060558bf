"""GPU node pools of the sandbox: how many nodes of which GPU model, published with which sharing (pure).

Real GPU clusters mix models and driver settings (the NVIDIA DRA driver's ``--consumable-shares`` is per
node, not per cluster), and a rewrite that is right on a uniform fleet can be wrong on a mixed one: a
claim asking for memory may land on a GPU that cannot be shared and take all of it. ``--gpu-pool``
builds such a fleet; ``--mixed-fleet`` is the one the tests and the packing report use.

A pool is ``name=NAME,nodes=N,gpus=G,model=MODEL,sharing=SHARING`` (every key but ``name`` optional):
``model`` is a name of the webhook's GPU model catalog (its first product name becomes the devices'
``productName`` and the nodes' ``nvidia.com/gpu.product``, its memory their ``capacity.memory``),
``sharing`` one of gpu.SHARING_MODES. Nodes are named ``gpu-<pool>-<i>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gatekeeper.sandbox import gpu
from gatekeeper.webhook.gpu.models import DEFAULT_MODELS, GpuModel

ARCHITECTURES = {"T4": "Turing", "L4": "Ada Lovelace", "L40S": "Ada Lovelace", "A30": "Ampere", "A100": "Ampere",
                 "H100": "Hopper", "H200": "Hopper", "B200": "Blackwell"}
"""The driver's ``architecture`` attribute by model family (cosmetic: nothing selects on it here)."""
POOL_KEYS = ("name", "nodes", "gpus", "model", "sharing")
_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?")


@dataclass(frozen=True)
class GpuPool:
    """Nodes of one GPU model published with one sharing setting."""

    name: str
    """Node names are ``gpu-<name>-<i>``."""
    nodes: int = 1
    """Nodes in the pool."""
    gpus: int = 4
    """GPUs per node."""
    model: str = "H100-80GB"
    """Webhook catalog model name (gatekeeper.webhook.gpu.models)."""
    sharing: str = "none"
    """none, memory, unlimited or a share count (gpu.SHARING_MODES)."""

    def node_names(self) -> list[str]:
        return [f"gpu-{self.name}-{i}" for i in range(self.nodes)]

    def catalog(self) -> GpuModel:
        return model(self.model)

    def record(self) -> dict[str, Any]:
        """What ``state.extra["gpu_pools"]`` keeps of the pool (tests and the packing report read it)."""
        m = self.catalog()
        return {"name": self.name, "nodes": self.node_names(), "gpus": self.gpus, "model": self.model,
                "product": m.product_names[0], "memory": m.memory, "sharing": self.sharing}


def model(name: str) -> GpuModel:
    for m in DEFAULT_MODELS:
        if m.name == name:
            return m
    raise ValueError(f"unknown GPU model {name!r}; expected one of {', '.join(m.name for m in DEFAULT_MODELS)}")


def parse_pool(text: str) -> GpuPool:
    """``name=a100,nodes=1,gpus=4,model=A100-40GB,sharing=4``; ValueError naming the bad key or value."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in POOL_KEYS or key in fields:
            raise ValueError(f"--gpu-pool {text!r}: expected comma-separated {'=, '.join(POOL_KEYS)}= (each once), "
                             f"got {part!r}")
        fields[key] = value.strip()
    name = fields.get("name", "")
    if not _NAME.fullmatch(name):
        raise ValueError(f"--gpu-pool {text!r}: name= is required, lower-case letters, digits and '-'")
    try:
        pool = GpuPool(name, int(fields.get("nodes", "1")), int(fields.get("gpus", "4")),
                       fields.get("model", "H100-80GB"), gpu.check_sharing(fields.get("sharing", "none")))
        model(pool.model)
    except ValueError as exc:
        raise ValueError(f"--gpu-pool {text!r}: {exc}") from None
    if not 1 <= pool.nodes <= 100 or not 1 <= pool.gpus <= 16:
        raise ValueError(f"--gpu-pool {text!r}: nodes must be 1..100 and gpus 1..16")
    return pool


MIXED_FLEET: tuple[GpuPool, ...] = (
    GpuPool("h100-shared", 1, 4, "H100-80GB", "memory"),
    GpuPool("h100-whole", 1, 4, "H100-80GB", "none"),
    GpuPool("a100-shares", 1, 4, "A100-40GB", "4"),
    GpuPool("a100-whole", 1, 4, "A100-40GB", "none"),
)
"""``--mixed-fleet`` (with one ``--mig-dra-nodes`` node of 3 H100s): two models, GPUs shared by memory, shared by
a count of 4, and exclusive, on 4 nodes of 4 GPUs, plus dynamic MIG. Small enough for a 2-core machine."""


def manifests(pool: GpuPool, uids: dict[str, str] | None = None) -> tuple[list[gpu.Manifest], list[gpu.Manifest]]:
    """(nodes, resource slices) of the pool; ``uids`` (node name -> uid) makes the slices owned by their nodes."""
    m = pool.catalog()
    product, arch = m.product_names[0], ARCHITECTURES.get(pool.model.split("-")[0], "")
    nodes = [gpu.node(n, pool.gpus, product=product) for n in pool.node_names()]
    slices = [gpu.resource_slice(n, pool.gpus, (uids or {}).get(n, ""), pool.sharing, product, m.memory, arch)
              for n in pool.node_names()]
    return nodes, slices
