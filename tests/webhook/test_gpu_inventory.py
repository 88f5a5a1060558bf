"""The GPU inventory: committed capacity per GPU from slices and claims, its series, and its one leader (pure)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gatekeeper.sandbox import gpu, mig
from gatekeeper.webhook.inventory.committed import gpu_rows, idle_per_node, slim_claim, slim_slice
from gatekeeper.webhook.inventory.exposition import InventoryCollector, SnapshotStore, snapshot
from gatekeeper.webhook.inventory.lease import Conflict, LeaseElector, LeaseOps

GIB = 1024**3


def claim(ns: str, name: str, results: list[dict[str, Any]], pods: tuple[str, ...] = ("p",)) -> dict[str, Any]:
    return {"metadata": {"namespace": ns, "name": name},
            "status": {"allocation": {"devices": {"results": results}},
                       "reservedFor": [{"resource": "pods", "name": p, "uid": p} for p in pods]}}


def result(pool: str, device: str, **consumed: str) -> dict[str, Any]:
    r: dict[str, Any] = {"driver": "gpu.nvidia.com", "pool": pool, "device": device, "request": "gpu"}
    if consumed:
        r["consumedCapacity"] = consumed
    return r


SLICES = [gpu.resource_slice("shared", 2, sharing="memory"), gpu.resource_slice("counted", 2, sharing="4"),
          gpu.resource_slice("whole", 2), *mig.mig_dra_slices("mig", 1)]


def test_shared_results_commit_what_they_consumed_and_exclusive_ones_the_whole_device() -> None:
    claims = [claim("a", "c1", [result("shared", "gpu-0", memory="20Gi")], ("p1",)),
              claim("a", "c2", [result("shared", "gpu-0", memory="30Gi")], ("p2",)),
              claim("b", "c3", [result("counted", "gpu-1", memory="0", shares="1")]),
              claim("b", "c4", [result("counted", "gpu-1", memory="8Gi", shares="2")]),
              claim("b", "c5", [result("whole", "gpu-0")]),
              claim("b", "c6", [result("mig", "gpu-0-mig-1g10gb-0"), result("mig", "gpu-0-mig-3g40gb-4")])]
    rows = {(r.node, r.gpu): r for r in gpu_rows(SLICES, claims)}
    assert len(rows) == 7  # every GPU, MIG partitions counted on their GPU, never as GPUs of their own
    shared = rows[("shared", "gpu-0")]
    assert (shared.memory_committed, len(shared.claims), shared.pods) == (50 * GIB, 2, {"a/p1", "a/p2"})
    counted = rows[("counted", "gpu-1")]
    assert (counted.shares_capacity, counted.shares_committed, counted.memory_committed) == (4, 3, 8 * GIB)
    assert rows[("whole", "gpu-0")].memory_committed == 80 * GIB
    assert rows[("mig", "gpu-0")].memory_committed == 50 * 10**9  # 10G + 40G partitions
    assert idle_per_node(list(rows.values()))[("whole", gpu.PRODUCT)] == 1


def test_the_leader_keeps_only_what_the_rows_read_and_gets_the_same_rows() -> None:
    big = claim("a", "c1", [result("shared", "gpu-0", memory="20Gi")])
    big["metadata"]["managedFields"] = [{"manager": "x" * 10_000}]
    big["spec"] = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}
    slim = [slim_claim(big)]
    assert len(json.dumps(slim)) < len(json.dumps(big)) // 10
    rows = [(r.node, r.gpu, r.memory_committed, len(r.pods)) for r in gpu_rows(SLICES, [big])]
    assert rows == [(r.node, r.gpu, r.memory_committed, len(r.pods))
                    for r in gpu_rows([slim_slice(s) for s in SLICES], slim)]


def test_claims_not_allocated_or_on_unknown_devices_commit_nothing() -> None:
    pending = {"metadata": {"namespace": "a", "name": "x"}, "status": {}}
    elsewhere = claim("a", "y", [result("gone-node", "gpu-0")])
    assert all(r.idle and r.memory_committed == 0 for r in gpu_rows(SLICES, [pending, elsewhere]))


def test_the_page_shows_the_snapshot_and_shares_only_where_a_gpu_has_a_count(tmp_path) -> None:
    store = SnapshotStore(str(tmp_path), stale_seconds=30)
    rows = gpu_rows(SLICES, [claim("a", "c", [result("counted", "gpu-0", memory="0", shares="1")])])
    store.publish(snapshot(rows))
    reg = CollectorRegistry()
    reg.register(InventoryCollector(store))
    page = generate_latest(reg).decode()
    assert "gatekeeper_gpu_inventory_leader 1.0" in page
    assert 'gatekeeper_gpu_shares_committed{gpu="gpu-0",model="NVIDIA H100 80GB HBM3",node="counted"} 1.0' in page
    assert 'gatekeeper_gpu_shares_capacity{gpu="gpu-0",model="NVIDIA H100 80GB HBM3",node="shared"}' not in page
    assert 'gatekeeper_gpu_idle{model="NVIDIA H100 80GB HBM3",node="whole"} 2.0' in page


def test_another_worker_reads_the_leaders_file_and_a_stale_or_cleared_one_shows_nothing(tmp_path) -> None:
    leader, other = SnapshotStore(str(tmp_path), 30), SnapshotStore(str(tmp_path), 30)
    leader.publish(snapshot(gpu_rows(SLICES, [])))
    assert other.current() is not None and len(other.current()["rows"]) == 7
    (tmp_path / "gpu-inventory.json").write_text(json.dumps(snapshot([], now=time.time() - 60)))
    assert other.current() is None
    leader.publish(None)
    assert not (tmp_path / "gpu-inventory.json").exists() and other.current() is None


class FakeLeases:
    """One Lease with resourceVersion semantics (a write with an old version gets Conflict)."""

    def __init__(self) -> None:
        self.obj: dict[str, Any] | None = None
        self.rv = 0

    def ops(self) -> LeaseOps:
        async def get() -> dict[str, Any] | None:
            return json.loads(json.dumps(self.obj)) if self.obj else None

        async def create(body: dict[str, Any]) -> dict[str, Any]:
            if self.obj is not None:
                raise Conflict()
            return self._store(body)

        async def replace(body: dict[str, Any]) -> dict[str, Any]:
            if self.obj is None or body["metadata"].get("resourceVersion") != self.obj["metadata"]["resourceVersion"]:
                raise Conflict()
            return self._store(body)

        return LeaseOps(get, create, replace)

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        self.obj = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.rv)}}
        return json.loads(json.dumps(self.obj))


def test_one_leader_renews_and_a_second_takes_over_only_after_the_lease_ran_out() -> None:
    leases, now = FakeLeases(), [0.0]
    a = LeaseElector(leases.ops(), "l", "ns", "a", 15, 5, clock=lambda: now[0])
    b = LeaseElector(leases.ops(), "l", "ns", "b", 15, 5, clock=lambda: now[0])

    async def play() -> None:
        await a.step()
        await b.step()
        assert (a.leading, b.leading) == (True, False)
        for _ in range(5):  # a renews every 5 s: b never sees the same version for 15 s
            now[0] += 5
            await a.step()
            await b.step()
            assert (a.leading, b.leading) == (True, False)
        assert leases.obj is not None and leases.obj["spec"]["holderIdentity"] == "a"
        for _ in range(3):  # a is gone: the version b saw stays the same
            now[0] += 5
            await b.step()
        assert b.leading and leases.obj["spec"]["holderIdentity"] == "b"
        assert leases.obj["spec"]["leaseTransitions"] == 1

    asyncio.run(play())


def test_a_stale_write_loses_and_a_leader_that_cannot_renew_steps_down() -> None:
    leases, now = FakeLeases(), [0.0]
    a = LeaseElector(leases.ops(), "l", "ns", "a", 15, 5, clock=lambda: now[0])

    async def play() -> None:
        await a.step()
        assert a.leading
        broken = LeaseOps(leases.ops().get, leases.ops().create, _fail)
        a.ops = broken
        now[0] += 5
        await a.step()
        assert a.leading  # one failed renewal: the lease still holds
        now[0] += 6
        await a.step()
        assert not a.leading  # 11 s without renewal: others may take over at 15, we stop before

    asyncio.run(play())


async def _fail(body: dict[str, Any]) -> None:
    raise OSError("apiserver unreachable")


@pytest.mark.parametrize("holder", ["", None])
def test_an_empty_holder_is_taken_at_once(holder: str | None) -> None:
    leases = FakeLeases()
    leases._store({"metadata": {"name": "l", "namespace": "ns"}, "spec": {"holderIdentity": holder}})
    b = LeaseElector(leases.ops(), "l", "ns", "b", 15, 5, clock=lambda: 0.0)
    asyncio.run(b.step())
    assert b.leading


def test_a_leader_renews_with_one_call_and_a_change_by_another_is_still_seen() -> None:
    """Idle cost: a leader renews from the Lease its own last write returned (one call every renewSeconds, not a
    read and a write); a write by someone else in between makes the renewal fail (409), and it stops leading."""
    leases, now, calls = FakeLeases(), [0.0], []
    real = leases.ops()

    async def get() -> dict[str, Any] | None:
        calls.append("get")
        return await real.get()

    async def replace(body: dict[str, Any]) -> dict[str, Any] | None:
        calls.append("replace")
        return await real.replace(body)

    a = LeaseElector(LeaseOps(get, real.create, replace), "l", "ns", "a", 15, 5, clock=lambda: now[0])

    async def play() -> None:
        await a.step()
        assert a.leading
        calls.clear()
        for _ in range(4):
            now[0] += 5
            await a.step()
        assert calls == ["replace"] * 4 and a.leading
        assert leases.obj is not None
        leases._store({**leases.obj, "spec": {**leases.obj["spec"], "holderIdentity": "b"}})  # taken meanwhile
        now[0] += 5
        await a.step()
        assert not a.leading
        calls.clear()
        now[0] += 5
        await a.step()
        assert calls == ["get"] and not a.leading  # it reads again: b holds it and has not expired

    asyncio.run(play())


def test_without_a_change_the_leader_republishes_its_rows_without_recounting_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle cost: the heartbeat that keeps the snapshot fresh does not recount every claim of the cluster."""
    from gatekeeper.webhook.inventory import controller
    from gatekeeper.webhook.inventory.controller import Inventory
    from gatekeeper.webhook.inventory.exposition import SnapshotStore

    counts: list[int] = []
    real_rows = controller.gpu_rows

    def counting(*args: Any) -> Any:
        counts.append(1)
        return real_rows(*args)

    monkeypatch.setattr(controller, "gpu_rows", counting)

    async def list_fn() -> tuple[list[dict[str, Any]], str]:
        return [], "1"

    async def watch_fn(rv: str) -> Any:
        await asyncio.sleep(3600)
        yield "BOOKMARK", {}

    async def play() -> None:
        store = SnapshotStore(None, 15)
        inv = Inventory(lambda on_change: None, (list_fn, watch_fn), (list_fn, watch_fn), store, 0.01)
        inv.heartbeat_seconds = 0.01
        for view in (inv.slices, inv.claims):
            await view.relist()
        task = asyncio.create_task(inv._publish())
        await asyncio.sleep(0.05)
        first = store.mine
        await asyncio.sleep(0.2)
        assert len(counts) == 1 and store.mine is not None and first is not None
        assert store.mine["at"] > first["at"] and store.mine["rows"] == first["rows"]
        inv.changed.set()
        await asyncio.sleep(0.1)
        task.cancel()
        assert len(counts) == 2

    asyncio.run(play())
