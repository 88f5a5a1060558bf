"""The inventory's Prometheus series, from the leader's latest snapshot (any worker's /metrics shows them).

Only the leader watches ResourceSlices and ResourceClaims; with ``--workers N`` a scrape lands on any
worker, so the leader writes its snapshot beside prometheus-client's multiprocess files and every
worker's page reads it. A snapshot older than ``staleSeconds`` (a leader that died without clearing
it) is not shown: a stale "committed" figure is worse than none. Followers show only
``gatekeeper_gpu_inventory_leader 0``.

Series (labels ``node``, ``gpu``, ``model``):
``gatekeeper_gpu_memory_capacity_bytes``, ``gatekeeper_gpu_memory_committed_bytes``,
``gatekeeper_gpu_shares_capacity``, ``gatekeeper_gpu_shares_committed`` (GPUs with a share count only),
``gatekeeper_gpu_claims``, ``gatekeeper_gpu_pods``; per (``node``, ``model``) ``gatekeeper_gpu_idle``
(whole GPUs nobody holds); ``gatekeeper_gpu_inventory_leader`` (1 where this pod leads, with a fresh snapshot).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from gatekeeper.webhook.inventory.committed import GpuRow, idle_per_node

SNAPSHOT_FILE = "gpu-inventory.json"

ROW_SERIES = (
    ("gatekeeper_gpu_memory_capacity_bytes", "Memory of the GPU", "memory_capacity"),
    ("gatekeeper_gpu_memory_committed_bytes", "GPU memory allocated to claims (whole devices count whole)",
     "memory_committed"),
    ("gatekeeper_gpu_shares_capacity", "Shares the GPU publishes (consumable shares count)", "shares_capacity"),
    ("gatekeeper_gpu_shares_committed", "Shares of the GPU allocated to claims", "shares_committed"),
    ("gatekeeper_gpu_claims", "ResourceClaims allocated on the GPU or its MIG partitions", "claims"),
    ("gatekeeper_gpu_pods", "Pods the claims on the GPU are reserved for", "pods"),
)


def snapshot(rows: list[GpuRow], now: float | None = None) -> dict[str, Any]:
    """What the leader publishes: plain numbers per GPU, and when."""
    return {"at": time.time() if now is None else now,
            "rows": [{"node": r.node, "gpu": r.gpu, "model": r.model, "memory_capacity": r.memory_capacity,
                      "memory_committed": r.memory_committed, "shares_capacity": r.shares_capacity,
                      "shares_committed": r.shares_committed, "claims": len(r.claims), "pods": len(r.pods)}
                     for r in rows],
            "idle": [{"node": n, "model": m, "gpus": c} for (n, m), c in sorted(idle_per_node(rows).items())]}


class SnapshotStore:
    """The leader's latest snapshot: in memory, and (multiprocess mode) in a file the other workers read."""

    def __init__(self, directory: str | None, stale_seconds: float) -> None:
        self.path = Path(directory) / SNAPSHOT_FILE if directory else None
        self.stale_seconds = stale_seconds
        self.mine: dict[str, Any] | None = None
        self.leader = False

    def publish(self, snap: dict[str, Any] | None) -> None:
        self.mine = snap
        if self.path is None:
            return
        if snap is None:
            self.path.unlink(missing_ok=True)
            return
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(snap))
        tmp.replace(self.path)

    def current(self) -> dict[str, Any] | None:
        snap = self.mine
        if snap is None and self.path is not None:
            try:
                snap = json.loads(self.path.read_text())
            except (OSError, ValueError):
                snap = None
        if not isinstance(snap, dict) or time.time() - float(snap.get("at", 0)) > self.stale_seconds:
            return None
        return snap


class InventoryCollector:
    """A prometheus-client collector over a :class:`SnapshotStore`."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.store.current()
        leader = GaugeMetricFamily("gatekeeper_gpu_inventory_leader",
                                   "1 where this pod leads the GPU inventory, with a fresh snapshot (one per cluster)")
        leader.add_metric([], 1.0 if snap is not None else 0.0)
        yield leader
        if snap is None:
            return
        labels = ["node", "gpu", "model"]
        for name, doc, key in ROW_SERIES:
            fam = GaugeMetricFamily(name, doc, labels=labels)
            for r in snap["rows"]:
                if key.startswith("shares") and not r["shares_capacity"]:
                    continue
                fam.add_metric([r["node"], r["gpu"], r["model"]], float(r[key]))
            yield fam
        idle = GaugeMetricFamily("gatekeeper_gpu_idle", "Whole GPUs nobody holds", labels=["node", "model"])
        for i in snap["idle"]:
            idle.add_metric([i["node"], i["model"]], float(i["gpus"]))
        yield idle
