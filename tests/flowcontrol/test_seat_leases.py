"""A fleet's small level (fewer seats than proxies) holds exactly its seats through seat Leases, against an in-process
Lease store with the apiserver's compare-and-swap; test_sandbox_fleet.py runs three proxies against real apiservers.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
import pytest
from fc_helpers import User
from test_middleware import Upstream, call, req, until
from test_watch_lists import settings as watch_list_settings

from gatekeeper.kube import requestinfo
from gatekeeper.proxy.flowcontrol.core.fleet import FleetShare, LeaseView
from gatekeeper.proxy.flowcontrol.core.seatleases import SeatPool, seat_name, wanted_seats
from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl
from gatekeeper.proxy.flowcontrol.settings import FleetSettings

LEVEL = "secrets"


class LeaseStore:
    """Leases as the apiserver keeps them: create fails on a name taken, a merge patch naming a resourceVersion
    fails unless it is the current one; every write bumps it."""

    name = "fake-apiserver"
    ssl_identity = object()

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.writes = 0
        self.forbid = False

    async def call(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes | None = None, *,
                   deadline: float, max_bytes: int) -> tuple[int, bytes]:
        await asyncio.sleep(0)
        if self.forbid:
            return 403, b'{"kind":"Status","code":403}'
        if method == "GET":
            selector = path.partition("labelSelector=")[2].replace("%3D", "=").replace("%2F", "/")
            key, _, value = selector.partition("=")
            items = [lease for lease in self.leases.values() if lease["metadata"]["labels"].get(key) == value]
            return 200, orjson.dumps({"items": items})
        patch = orjson.loads(body or b"{}")
        self.writes += 1
        self.version += 1
        if method == "POST":
            name = patch["metadata"]["name"]
            if name in self.leases:
                return 409, b"{}"
            patch["metadata"]["resourceVersion"] = str(self.version)
            self.leases[name] = patch
            return 201, orjson.dumps(patch)
        name = path.rpartition("/")[2]
        lease = self.leases.get(name)
        if lease is None:
            return 404, b"{}"
        if patch["metadata"]["resourceVersion"] != lease["metadata"]["resourceVersion"]:
            return 409, b"{}"
        for k, v in patch["spec"].items():
            if v is None:
                lease["spec"].pop(k, None)
            else:
                lease["spec"][k] = v
        lease["metadata"]["resourceVersion"] = str(self.version)
        return 200, orjson.dumps(lease)

    def holders(self) -> list[str]:
        return sorted(lease["spec"].get("holderIdentity", "") for lease in self.leases.values())


FAST = {"seat_poll_seconds": 0.01, "seat_max_hold_seconds": 0.3, "seat_turn_pause_seconds": 0.03,
        "seat_linger_seconds": 0.01, "lease_duration_seconds": 1.5, "renew_interval_seconds": 0.5}


def fleet_of(store: LeaseStore, n: int, **fleet: Any) -> list[FlowControl]:
    """``n`` proxies' flow control (the seeds' budget of 2) that see a fleet of ``n`` and share ``store``."""
    out = []
    for rank in range(n):
        fs = FleetSettings(enabled=True, name="t", identity=f"p{rank}", **{**FAST, **fleet})
        fc = FlowControl(watch_list_settings(coalesce=False, fleet=fs))
        assert fc.fleet is not None
        fc.fleet.seats.upstreams = [store]
        fc.fleet.decided = (n, rank)
        fc.share_seats(FleetShare(n, rank))
        out.append(fc)
    return out


def executing(fcs: list[FlowControl]) -> int:
    return sum(fc.controller.levels[LEVEL].executing_seats for fc in fcs)


async def close(fcs: list[FlowControl]) -> None:
    for fc in fcs:
        await fc.close()


async def test_three_proxies_never_run_more_than_the_levels_two_seats_and_all_are_served():
    store = LeaseStore()
    fcs = fleet_of(store, 3)
    up = Upstream(body=b"x" * 2000, chunks=4)
    peak = 0

    async def watch_peak() -> None:
        nonlocal peak
        while True:
            peak = max(peak, executing(fcs), up.running)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch_peak())
    try:
        assert all(fc.controller.levels[LEVEL].limit == 0 for fc in fcs)  # nobody holds a seat while idle
        results = await asyncio.gather(*(call(fcs[i % 3], req(target="/api/v1/secrets", user=f"u{i}"), up)
                                         for i in range(30)))
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    assert [s for s, _, _ in results] == [200] * 30
    assert peak <= 2 and up.calls == 30
    # every proxy served some: none was locked out for holding no seat when its requests came
    assert all(fc.controller.levels[LEVEL].executing_requests == 0 for fc in fcs)
    await until(lambda: store.holders() == ["", ""], "every seat to be given back once idle")
    await close(fcs)


async def test_a_proxy_with_endless_demand_takes_turns_with_the_others():
    store = LeaseStore()
    fcs = fleet_of(store, 3)
    up = Upstream(body=b"y" * 100, chunks=1)
    up.gate.clear()
    busy = [asyncio.create_task(call(fcs[0], req(target="/api/v1/secrets", user=f"b{i}"), up)) for i in range(6)]
    await until(lambda: fcs[0].controller.levels[LEVEL].executing_seats == 2, "the busy proxy to take both seats")
    other = asyncio.create_task(call(fcs[1], req(target="/api/v1/secrets", user="other"), up))
    await asyncio.sleep(0.05)
    up.gate.set()  # from now on every request ends at once: the busy proxy always has the next one queued
    status, _, _ = await asyncio.wait_for(other, 5)
    assert status == 200
    assert [(await t)[0] for t in busy] == [200] * 6
    await close(fcs)


async def test_a_crashed_holders_seat_is_taken_once_its_lease_expires():
    store = LeaseStore()
    fcs = fleet_of(store, 3)
    up = Upstream(body=b"z", chunks=1)
    up.gate.clear()
    held = [asyncio.create_task(call(fcs[0], req(target="/api/v1/secrets", user=f"h{i}"), up)) for i in range(2)]
    await until(lambda: up.calls == 2, "proxy 0 to run two LISTs on both seats")
    fcs[0].fleet.seats.upstreams = []  # it dies: its Leases are never renewed nor given back
    for t in fcs[0].fleet.seats._tasks.values():
        t.cancel()
    up2 = Upstream(body=b"w", chunks=1)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    status, _, _ = await asyncio.wait_for(call(fcs[1], req(target="/api/v1/secrets", user="next"), up2), 10)
    assert status == 200 and loop.time() - t0 >= 1.0  # not before the dead holder's Lease expired (1.5 s)
    up.gate.set()
    await asyncio.gather(*held)
    await close(fcs)


async def test_forbidden_seat_leases_fall_back_to_one_seat_per_proxy():
    store = LeaseStore()
    store.forbid = True
    fcs = fleet_of(store, 3)
    up = Upstream(body=b"f", chunks=1)
    status, _, _ = await asyncio.wait_for(call(fcs[0], req(target="/api/v1/secrets", user="a"), up), 5)
    assert status == 200
    assert fcs[0].controller.levels[LEVEL].limit == 1 and not fcs[0].controller.levels[LEVEL].leased
    await close(fcs)


async def test_levels_with_as_many_seats_as_proxies_keep_their_static_shares():
    store = LeaseStore()
    fcs = fleet_of(store, 2)
    assert [fc.controller.levels[LEVEL].limit for fc in fcs] == [1, 1]
    assert not any(fc.controller.levels[LEVEL].leased for fc in fcs)
    assert all(not fc.controller.levels["catch-all"].leased for fc in fcs)
    await close(fcs)
    big = fleet_of(LeaseStore(), 3, seat_leases=False)
    assert [fc.controller.levels[LEVEL].limit for fc in big] == [1, 1, 1]  # seatLeases off: max(L, N)
    await close(big)


def test_a_pool_never_offers_a_seat_a_live_holder_renews():
    pool = SeatPool("me", "t", LEVEL, 2)
    a, b = seat_name("t", LEVEL, 0), seat_name("t", LEVEL, 1)
    assert pool.free(0.0) == [(a, ""), (b, "")]  # not created yet
    pool.observe([LeaseView(a, "other", "t1", 10, "5"), LeaseView(b, "", "t1", 10, "6")], 0.0)
    assert pool.free(5.0) == [(b, "6")]
    pool.observe([LeaseView(a, "other", "t2", 10, "7"), LeaseView(b, "", "t1", 10, "6")], 9.0)  # renewed
    assert pool.free(15.0) == [(b, "6")]
    assert pool.free(19.5) == [(a, "7"), (b, "6")]  # silent for its whole duration: the holder is gone
    assert wanted_seats(1, 5, 2) == 2 and wanted_seats(0, 0, 2) == 0


def test_seat_lease_names_are_valid_whatever_the_level_is_called():
    name = seat_name("fleet", "A_Very/Odd level " * 30, 3)
    assert len(name) <= 253 and name.endswith("-3") and name == name.lower()
    assert all(c.isalnum() or c in "-." for c in name)


@pytest.fixture(autouse=True)
def _users_are_plain():
    assert User("x").name == "x" and requestinfo.parse("GET", "/api/v1/secrets").verb == "list"


class FlakyStore(LeaseStore):
    """The Lease store, unreachable while ``down`` (every call fails as a refused connection does)."""

    down = False

    async def call(self, *args: Any, **kw: Any) -> tuple[int, bytes]:
        if self.down:
            await asyncio.sleep(0)
            raise OSError("connection refused")
        return await super().call(*args, **kw)


async def test_a_held_seat_lease_is_renewed_while_its_holder_waits_for_another():
    """Proxy 0 runs one long request on a seat Lease and has another queued, proxy 1 holds the other seat: proxy 0
    keeps asking for a second seat and must still renew the one it holds, or proxy 2 takes it as expired."""
    store = LeaseStore()
    fcs = fleet_of(store, 3)
    up = Upstream(body=b"x", chunks=1)
    up.gate.clear()  # every request runs until the end of the test
    tasks = [asyncio.create_task(call(fcs[1], req(target="/api/v1/secrets", user="p1"), up))]
    await until(lambda: up.calls == 1, "proxy 1 to run one request on a seat Lease")
    tasks += [asyncio.create_task(call(fcs[0], req(target="/api/v1/secrets", user=f"p0-{i}"), up)) for i in range(2)]
    await until(lambda: up.calls == 2, "proxy 0 to run one request on the other seat")
    tasks.append(asyncio.create_task(call(fcs[2], req(target="/api/v1/secrets", user="p2"), up)))
    try:
        await asyncio.sleep(4.0)  # more than two Lease durations (1.5 s)
        assert up.running == 2, f"{up.running} requests of a 2-seat level at once (holders {store.holders()})"
    finally:
        up.gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close(fcs)


async def test_unreachable_seat_leases_fall_back_to_one_seat_per_proxy_and_come_back_after():
    store = FlakyStore()
    fcs = fleet_of(store, 3)
    up = Upstream(body=b"x", chunks=1)
    try:
        store.down = True
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        status, _, _ = await asyncio.wait_for(call(fcs[0], req(target="/api/v1/secrets", user="a"), up), 10)
        assert status == 200 and 1.4 <= loop.time() - t0 < 5  # served on the static share after a Lease duration
        assert not fcs[0].controller.levels[LEVEL].leased
        store.down = False
        fcs[0].fleet.seats.heartbeat(True)  # the fleet's own renewal reached the apiservers again
        assert fcs[0].controller.levels[LEVEL].leased  # exactly L again
        assert (await call(fcs[0], req(target="/api/v1/secrets", user="b"), up))[0] == 200
    finally:
        await close(fcs)
