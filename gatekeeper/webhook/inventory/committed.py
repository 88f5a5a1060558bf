"""Per physical GPU: memory and shares committed against capacity, claims and pods on it (pure).

The scheduler records what it allocated in each ResourceClaim (``status.allocation.devices.results``:
driver, pool, device, and for a shared device ``consumedCapacity``), and the driver publishes what
exists in ResourceSlices. Together they say, per GPU, what an operator cannot see anywhere else:
how much of its memory and how many of its shares are promised, to how many pods, and which GPUs
nobody holds. A result on an exclusive device commits all of that device's memory (it is the
claim's alone); a MIG partition commits its own memory on its parent GPU (``parentUUID``).

The packing benchmark counts its pods' claims with :func:`gpu_rows` too, so the exported metrics and
the report are one computation over the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gatekeeper.webhook.gpu.sizing import parse_quantity

Key = tuple[str, str]
"""(node, GPU device name)."""


@dataclass
class GpuRow:
    """One physical GPU and what is committed on it."""

    node: str
    gpu: str
    model: str
    memory_capacity: int = 0
    """Bytes (the GPU device's ``capacity.memory``)."""
    shares_capacity: int = 0
    """The GPU's share count (0: it publishes none)."""
    memory_committed: int = 0
    shares_committed: int = 0
    claims: set[str] = field(default_factory=set)
    """``namespace/name`` of the claims allocated on it (or on its MIG partitions)."""
    pods: set[str] = field(default_factory=set)
    """``namespace/name`` of the pods those claims are reserved for."""

    @property
    def idle(self) -> bool:
        return not self.claims


def _attr(device: dict[str, Any], name: str) -> str:
    value = (device.get("attributes") or {}).get(name) or {}
    return str(value.get("string", "")) if isinstance(value, dict) else ""


def _quantity(value: Any) -> int:
    try:
        return int(parse_quantity(str(value)))
    except ValueError:
        return 0


def _capacity(device: dict[str, Any], name: str) -> int:
    cap = (device.get("capacity") or {}).get(name) or {}
    return _quantity(cap.get("value", "0")) if isinstance(cap, dict) else 0


def _index(slices: list[dict[str, Any]]) -> tuple[dict[Key, GpuRow], dict[tuple[str, str, str], tuple[Key, int]]]:
    """GPU rows, and (driver, pool, device) -> (the GPU it is or sits on, the memory it holds)."""
    rows: dict[Key, GpuRow] = {}
    by_uuid: dict[tuple[str, str], Key] = {}
    partitions: list[tuple[tuple[str, str, str], str, str, int]] = []
    devices: dict[tuple[str, str, str], tuple[Key, int]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        driver, pool = str(spec.get("driver", "")), str((spec.get("pool") or {}).get("name", ""))
        node = str(spec.get("nodeName") or pool)
        for d in spec.get("devices") or []:
            ident, kind, memory = (driver, pool, str(d.get("name", ""))), _attr(d, "type"), _capacity(d, "memory")
            if kind == "gpu":
                key = (node, ident[2])
                rows[key] = GpuRow(node, ident[2], _attr(d, "productName"), memory, _capacity(d, "shares"))
                by_uuid[(pool, _attr(d, "uuid"))] = key
                devices[ident] = (key, memory)
            elif _attr(d, "parentUUID"):
                partitions.append((ident, pool, _attr(d, "parentUUID"), memory))
    for ident, pool, parent, memory in partitions:
        if (pool, parent) in by_uuid:
            devices[ident] = (by_uuid[(pool, parent)], memory)
    return rows, devices


def gpu_rows(slices: list[dict[str, Any]], claims: list[dict[str, Any]]) -> list[GpuRow]:
    """Every GPU the slices publish, with what the allocated claims commit on it; sorted by node and GPU."""
    rows, devices = _index(slices)
    for c in claims:
        meta, status = c.get("metadata") or {}, c.get("status") or {}
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        ns = str(meta.get("namespace", ""))
        name = f"{ns}/{meta.get('name', '')}"
        pods = {f"{ns}/{r.get('name', '')}" for r in status.get("reservedFor") or [] if r.get("resource") == "pods"}
        for r in results:
            found = devices.get((str(r.get("driver", "")), str(r.get("pool", "")), str(r.get("device", ""))))
            if found is None:
                continue
            key, memory = found
            row = rows[key]
            consumed = r.get("consumedCapacity")
            if isinstance(consumed, dict):
                row.memory_committed += _quantity(consumed.get("memory", "0"))
                row.shares_committed += _quantity(consumed.get("shares", "0"))
            else:  # an exclusive device (a whole GPU or a MIG partition): all its memory is this claim's
                row.memory_committed += memory
            row.claims.add(name)
            row.pods |= pods
    return [rows[k] for k in sorted(rows)]


def idle_per_node(rows: list[GpuRow]) -> dict[tuple[str, str], int]:
    """(node, model) -> GPUs nobody holds."""
    out: dict[tuple[str, str], int] = {}
    for r in rows:
        out[(r.node, r.model)] = out.get((r.node, r.model), 0) + int(r.idle)
    return out


def _pick(d: Any, *keys: str) -> dict[str, Any]:
    return {k: d[k] for k in keys if isinstance(d, dict) and k in d}


def slim_slice(s: dict[str, Any]) -> dict[str, Any]:
    """What :func:`gpu_rows` reads of a ResourceSlice: the leader keeps every slice, so not the rest of it."""
    spec = s.get("spec") or {}
    devices = [{**_pick(d, "name", "allowMultipleAllocations"),
                "attributes": _pick(d.get("attributes"), "type", "productName", "uuid", "parentUUID"),
                "capacity": _pick(d.get("capacity"), "memory", "shares")} for d in spec.get("devices") or []]
    return {"metadata": _pick(s.get("metadata"), "namespace", "name"),
            "spec": {**_pick(spec, "driver", "nodeName"), "pool": _pick(spec.get("pool"), "name"), "devices": devices}}


def slim_claim(c: dict[str, Any]) -> dict[str, Any]:
    """What :func:`gpu_rows` reads of a ResourceClaim: allocation results and who it is reserved for."""
    status = c.get("status") or {}
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
    return {"metadata": _pick(c.get("metadata"), "namespace", "name"),
            "status": {"allocation": {"devices": {"results": [
                _pick(r, "driver", "pool", "device", "consumedCapacity") for r in results]}},
                "reservedFor": [_pick(r, "resource", "name") for r in status.get("reservedFor") or []]}}
