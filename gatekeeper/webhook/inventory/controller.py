"""The GPU inventory: while this process holds the Lease, watch ResourceSlices and ResourceClaims and publish
per-GPU committed capacity (committed.py) as a snapshot the /metrics pages show (exposition.py).

Followers watch nothing: the cost of the view (a LIST and WATCH of every claim) is paid once per cluster.
The view is recomputed at most every ``publishSeconds`` after a change, not per event: a burst of a
thousand claims costs a few recomputations, not a thousand; and not at all without a change (a heartbeat
re-publishes the last rows with a new time).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from gatekeeper.webhook.inventory.committed import gpu_rows, slim_claim, slim_slice
from gatekeeper.webhook.inventory.exposition import SnapshotStore, snapshot
from gatekeeper.webhook.inventory.lease import LeaseElector
from gatekeeper.webhook.listwatch import ListFn, ListWatch, WatchFn


class ObjectView(ListWatch):
    """Objects by namespace/name, kept by LIST+WATCH, each cut to what the inventory reads (``slim``): the
    leader holds every claim of the cluster, and a claim's spec, conditions and managedFields are most of it.
    ``changed`` is set on every change."""

    def __init__(self, what: str, list_fn: ListFn, watch_fn: WatchFn, changed: asyncio.Event,
                 slim: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        super().__init__(list_fn, watch_fn)
        self.what = what
        self.items: dict[str, dict[str, Any]] = {}
        self.changed = changed
        self.slim = slim

    @staticmethod
    def _key(obj: dict[str, Any]) -> str:
        meta = obj.get("metadata") or {}
        return f"{meta.get('namespace', '')}/{meta.get('name', '')}"

    def replace(self, items: list[dict[str, Any]]) -> None:
        self.items = {self._key(o): self.slim(o) for o in items}
        self.changed.set()

    def apply(self, event: str, obj: dict[str, Any]) -> None:
        if event == "DELETED":
            self.items.pop(self._key(obj), None)
        else:
            self.items[self._key(obj)] = self.slim(obj)
        self.changed.set()


class Inventory:
    """Runs the elector; while leading, the two views and the publisher."""

    def __init__(self, elector_factory: Any, slices: tuple[ListFn, WatchFn], claims: tuple[ListFn, WatchFn],
                 store: SnapshotStore, publish_seconds: float = 1.0) -> None:
        self.changed = asyncio.Event()
        self.slices = ObjectView("resourceslices", *slices, self.changed, slim_slice)
        self.claims = ObjectView("resourceclaims", *claims, self.changed, slim_claim)
        self.store, self.publish_seconds = store, publish_seconds
        self.elector: LeaseElector = elector_factory(self._on_change)
        self._tasks: list[asyncio.Task[None]] = []

    def _on_change(self, leading: bool) -> None:
        self.store.leader = leading
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        if leading:
            self._tasks = [asyncio.create_task(self.slices.run()), asyncio.create_task(self.claims.run()),
                           asyncio.create_task(self._publish())]
        else:
            self.store.publish(None)

    heartbeat_seconds = 5.0
    """With no change, the snapshot is re-published at least this often, so its age says the leader is alive."""

    def publish_now(self) -> dict[str, Any]:
        snap = snapshot(gpu_rows(list(self.slices.items.values()), list(self.claims.items.values())))
        self.store.publish(snap)
        return snap

    async def _publish(self) -> None:
        await self.slices.synced.wait()
        await self.claims.synced.wait()
        snap: dict[str, Any] | None = None
        while True:
            if snap is None or self.changed.is_set():
                self.changed.clear()
                snap = self.publish_now()
            else:  # a heartbeat: the same rows at a new time, not a recount of every claim of the cluster
                snap = {**snap, "at": time.time()}
                self.store.publish(snap)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=max(self.heartbeat_seconds, self.publish_seconds))
            await asyncio.sleep(self.publish_seconds)

    async def run(self) -> None:
        try:
            await self.elector.run()
        finally:
            for t in self._tasks:
                t.cancel()
            self.store.publish(None)
