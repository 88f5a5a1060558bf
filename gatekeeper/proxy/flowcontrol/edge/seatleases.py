"""The asyncio edge of seat Leases (``core/seatleases.py``): take, renew and give back a small level's seats.

One driver task per leased level runs while this process wants or holds seats of it, and sleeps otherwise. Every
write carries the Lease's resourceVersion (a merge patch with it is a compare-and-swap), so two proxies can never
both believe they took one seat. A seat goes back when nothing of the level runs or waits here, and after
``seatMaxHoldSeconds`` even while requests wait, so proxies take turns; the proxy that gave it back waits before
asking again. If the apiservers cannot be reached for a whole Lease duration, or forbid the Leases, the level falls
back to the static share (at least one seat here), as a partitioned fleet member does.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Sequence
from urllib.parse import quote

import orjson
from prometheus_client import Counter, Gauge, Histogram

from gatekeeper.proxy.flowcontrol.core.fleet import lease_views
from gatekeeper.proxy.flowcontrol.core.seatleases import SEAT_LABEL, SeatPool, seat_label, wanted_seats
from gatekeeper.proxy.flowcontrol.settings import FleetSettings
from gatekeeper.proxy.identity.tokens.fetch import Upstream

log = logging.getLogger("gatekeeper.proxy.flowcontrol.seatleases")

HELD = Gauge("gatekeeper_fleet_seat_leases_held",
             "Seat Leases of each small level (fewer seats than proxies) this proxy holds: the requests of the level "
             "it may run now.", ["priority_level"], multiprocess_mode="livesum")
OPERATIONS = Counter("gatekeeper_fleet_seat_lease_operations_total",
                     "Writes and listings of seat Leases, by operation (take, renew, give-back, list) and result (ok, "
                     "conflict: another proxy wrote it first, error).", ["operation", "result"])
CALL_SECONDS = Histogram("gatekeeper_fleet_seat_lease_call_seconds",
                         "How long each seat Lease call to the apiservers took, by operation: what taking turns costs.",
                         ["operation"], buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
WAIT_SECONDS = Histogram("gatekeeper_fleet_seat_wait_seconds",
                         "From wanting a seat Lease (requests waiting here, none held free) to taking one.",
                         ["priority_level"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
DEGRADED = Gauge("gatekeeper_fleet_seat_leases_degraded",
                 "1 while seat Leases cannot be used (apiservers unreachable for a Lease duration, or forbidden): "
                 "small levels run on the static share, at least one seat per proxy.", multiprocess_mode="livemax")

MAX_LIST_BYTES = 1 << 20


def micro_time(now: float) -> str:
    """A Lease's renewTime or acquireTime (MicroTime) for the wall-clock time ``now``."""
    return datetime.datetime.fromtimestamp(now, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def leases_path(namespace: str) -> str:
    """Where the fleet's member, seat and writer Leases live."""
    return f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace)}/leases"


async def first_answer(upstreams: Sequence[Upstream], method: str, path: str, headers: list[tuple[str, str]],
                       body: bytes | None, *, deadline: float, max_bytes: int, retry_from: int = 500
                       ) -> tuple[int, bytes]:
    """The first apiserver's answer: a status below ``retry_from``, or 401/403; a broken call or another status
    tries the next one. Raises the last failure when none answers (the fleet's Lease and endpoint calls)."""
    failure: Exception = RuntimeError("no backend")
    for upstream in upstreams:
        try:
            status, answer = await upstream.call(method, path, headers, body, deadline=deadline, max_bytes=max_bytes)
        except (OSError, TimeoutError, ValueError, RuntimeError) as exc:
            failure = exc
            continue
        if status < retry_from or status in (401, 403):
            return status, answer
        failure = RuntimeError(f"{method} {path.split('?')[0]} on {upstream.name}: {status}")
    raise failure


class SeatLeaser:
    """This process's seat Leases, one pool per leased level (see the module docstring)."""

    def __init__(self, settings: FleetSettings, holder: str, headers: list[tuple[str, str]],
                 demand: Callable[[str], tuple[int, int]], on_change: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``demand(level)``: (seats executing, seats waiting) here; ``on_change()``: held seats changed."""
        self.settings = settings
        self.holder = holder
        self.headers = headers
        self.demand = demand
        self.on_change = on_change
        self.clock = clock
        self.upstreams: Sequence[Upstream] = ()
        self.pools: dict[str, SeatPool] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._pokes: dict[str, asyncio.Event] = {}
        self.leased: set[str] = set()
        """Levels whose seats are Leases now (fewer seats than proxies)."""
        self._failing_since: float | None = None
        self.forbidden = False
        self._forbidden_at = 0.0
        self._was_usable = True
        self._base = leases_path(settings.namespace)

    # -- what flow control asks ----------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        """False while the Leases cannot be used: small levels then take the static share."""
        failing = self._failing_since is not None and \
            self.clock() - self._failing_since >= self.settings.lease_duration_seconds
        return bool(self.upstreams) and not self.forbidden and not failing

    def held(self, level: str, seats: int) -> int:
        """Seats of ``level`` (``seats`` in all) this process may run now; the level is leased from now on."""
        pool = self.pools.get(level)
        if pool is None:
            pool = self.pools[level] = SeatPool(self.holder, self.settings.name, level, seats)
        pool.seats = seats
        self.leased.add(level)
        return pool.usable()

    def settle(self, leased: set[str]) -> None:
        """After flow control re-read its levels: those not leased any more give their seats back."""
        for level in [lv for lv in self.leased if lv not in leased]:
            self.leased.discard(level)
            self.poke(level)

    def poke(self, level: str) -> None:
        """The level's demand changed here: its driver takes or gives back seats."""
        if level not in self.pools:
            return
        event = self._pokes.setdefault(level, asyncio.Event())
        event.set()
        task = self._tasks.get(level)
        if task is None or task.done():
            self._tasks[level] = asyncio.get_running_loop().create_task(self._drive(level),
                                                                         name=f"gatekeeper-seats-{level}")

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for pool in self.pools.values():
            for name in list(pool.held):
                with contextlib.suppress(Exception):
                    await self._give_back(pool, name)

    # -- the driver ------------------------------------------------------------------------------------------
    async def _drive(self, level: str) -> None:
        """Run while the level wants or holds seats here; each turn does at most one call."""
        s = self.settings
        backoff = s.seat_poll_seconds
        pause_until = 0.0
        spare_since: float | None = None
        wanting_since: float | None = None
        last_renew = self.clock()
        while (pool := self.pools.get(level)) is not None:
            event = self._pokes.setdefault(level, asyncio.Event())
            event.clear()
            self._check()  # failing calls for a whole Lease duration make the Leases unusable: time alone flips it
            now = self.clock()
            if pool.held and now - last_renew >= s.lease_duration_seconds / 3:
                await self._renew(pool)  # first, whatever else waits: a Lease not renewed is taken by others
                last_renew = self.clock()
                continue
            leased = level in self.leased
            executing, waiting = self.demand(level) if leased else (0, 0)
            want = wanted_seats(executing, waiting, pool.seats) if leased else 0
            held = len(pool.held)
            oldest = pool.oldest()
            if leased and oldest is not None and oldest not in pool.retiring and pool.contended and \
                    now - pool.held_since[oldest] >= s.seat_max_hold_seconds:
                pool.retiring.add(oldest)  # take turns: nothing new starts on it; it goes back when free
                self._held_changed(pool)
                continue
            if held > executing and (pool.retiring or pool.surplus() or held > want):
                lingering = not (pool.retiring or pool.surplus()) and leased
                spare_since = now if spare_since is None else spare_since
                if not lingering or now - spare_since >= s.seat_linger_seconds:
                    retired = bool(pool.retiring)
                    await self._give_back(pool, pool.to_give_back() or next(iter(pool.held)))
                    spare_since = None
                    if retired:
                        pause_until = self.clock() + s.seat_turn_pause_seconds
                    continue
                await self._sleep(event, s.seat_linger_seconds - (now - spare_since))
                continue
            spare_since = None
            # A retiring seat still covers the request running on it: only what waits asks for more.
            if held >= want:
                wanting_since = None
            elif wanting_since is None:
                wanting_since = now
            if held < want and now >= pause_until and self.usable:
                if await self._take_one(pool):
                    backoff = s.seat_poll_seconds
                    WAIT_SECONDS.labels(level).observe(self.clock() - (wanting_since or now))
                    wanting_since = None
                    continue
                wait = min(backoff, max(0.01, s.lease_duration_seconds / 3 - (self.clock() - last_renew)))
                await self._sleep(event, wait)
                backoff = min(backoff * 2, s.seat_poll_seconds * 4)
                continue
            if not pool.held and want == 0:
                if not leased:
                    self.pools.pop(level, None)
                return  # nothing held, nothing wanted: the next poke starts the driver again
            wait = s.lease_duration_seconds / 3 - (now - last_renew) if pool.held else s.seat_poll_seconds
            if held < want:
                wait = min(wait, max(0.0, pause_until - now) or backoff)
            if self._failing_since is not None and self.usable:
                wait = min(wait, self._failing_since + s.lease_duration_seconds - now)
            if oldest is not None and oldest not in pool.retiring and pool.contended:
                wait = min(wait, s.seat_max_hold_seconds - (now - pool.held_since[oldest]))
            await self._sleep(event, max(0.01, wait))

    async def _sleep(self, event: asyncio.Event, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), seconds)

    # -- Lease calls -----------------------------------------------------------------------------------------
    async def _call(self, method: str, path: str, body: bytes | None, extra: Sequence[tuple[str, str]] = ()
                    ) -> tuple[int, bytes]:
        """The first apiserver that answers; a status is an answer (a 409 is final), a broken call is not."""
        try:
            status, answer = await first_answer(self.upstreams, method, path, [*self.headers, *extra], body,
                                                deadline=max(1.0, self.settings.lease_duration_seconds / 3),
                                                max_bytes=MAX_LIST_BYTES)
        except (OSError, TimeoutError, ValueError, RuntimeError):
            self._unreachable()
            raise
        if status in (401, 403):
            self._refused(status)
        else:
            self._reachable()
        return status, answer

    # -- health: when the Leases cannot be used, small levels take the static share ------------------------------
    def heartbeat(self, reached: bool) -> None:
        """The fleet's own Lease renewal every period: whether the apiservers answered. Brings seat Leases back after
        an outage (no seat call is made while they are off), and lets a refusal be tried again once per duration."""
        if reached:
            if self.forbidden and self.clock() - self._forbidden_at >= self.settings.lease_duration_seconds:
                self.forbidden = False  # RBAC may have been granted since: the next take finds out
            self._reachable()
        else:
            self._unreachable()

    def _reachable(self) -> None:
        self._failing_since = None
        self._check()

    def _unreachable(self) -> None:
        if self._failing_since is None:
            self._failing_since = self.clock()
        self._check()

    def _refused(self, status: int) -> None:
        self._failing_since = None
        if not self.forbidden:
            self.forbidden, self._forbidden_at = True, self.clock()
            log.error("fleet %s: seat Leases refused (%d): small levels fall back to the static share; grant the "
                      "proxy identity get/list/create/patch on leases in %s", self.settings.name, status,
                      self.settings.namespace)
        self._check()

    def _check(self) -> None:
        """Flow control re-reads its levels when the Leases become usable or unusable (time alone flips it)."""
        now = self.usable
        if now != self._was_usable:
            self._was_usable = now
            DEGRADED.set(0 if now else 1)
            log.warning("fleet %s: seat Leases %s", self.settings.name,
                        "usable again: small levels hold exactly their seats" if now else
                        "unusable: small levels run one seat per proxy until they are back")
            self.on_change()

    async def _list(self, pool: SeatPool) -> bool:
        selector = quote(f"{SEAT_LABEL}={seat_label(pool.fleet, pool.level)}", safe="")
        started = self.clock()
        try:
            status, body = await self._call("GET", f"{self._base}?labelSelector={selector}", None)
            CALL_SECONDS.labels("list").observe(self.clock() - started)
        except Exception as exc:
            OPERATIONS.labels("list", "error").inc()
            log.debug("seat Leases of %s: list failed: %s", pool.level, exc)
            return False
        if status != 200:
            OPERATIONS.labels("list", "error").inc()
            return False
        try:
            seats = lease_views(orjson.loads(body).get("items") or [])
        except ValueError:  # not JSON: another writer's or a broken answer, never a reason to stop the driver
            OPERATIONS.labels("list", "error").inc()
            return False
        OPERATIONS.labels("list", "ok").inc()
        pool.observe(seats, self.clock())
        return True

    def _spec(self, now: float, **more: object) -> dict[str, object]:
        return {"renewTime": micro_time(now), "leaseDurationSeconds": max(1, round(
            self.settings.lease_duration_seconds)), **more}

    async def _write(self, operation: str, pool: SeatPool, name: str, version: str,
                     spec: dict[str, object]) -> tuple[int, str | None]:
        """Create (no version) or compare-and-swap one seat Lease: (status, its new resourceVersion or None);
        status 0 when no apiserver answered."""
        if version:
            body = orjson.dumps({"metadata": {"resourceVersion": version}, "spec": spec})
            args = ("PATCH", f"{self._base}/{quote(name)}", body, [("content-type", "application/merge-patch+json")])
        else:
            body = orjson.dumps({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                 "metadata": {"name": name, "namespace": self.settings.namespace,
                                              "labels": {SEAT_LABEL: seat_label(pool.fleet, pool.level)}},
                                 "spec": spec})
            args = ("POST", self._base, body, [("content-type", "application/json")])
        started = self.clock()
        try:
            status, answer = await self._call(*args)
            CALL_SECONDS.labels(operation).observe(self.clock() - started)
        except Exception as exc:
            OPERATIONS.labels(operation, "error").inc()
            log.debug("seat Lease %s: %s failed: %s", name, operation, exc)
            return 0, None
        if status in (200, 201):
            OPERATIONS.labels(operation, "ok").inc()
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                return status, str(orjson.loads(answer)["metadata"]["resourceVersion"])
            return status, ""
        OPERATIONS.labels(operation, "conflict" if status in (404, 409) else "error").inc()
        return status, None

    async def _take_one(self, pool: SeatPool) -> bool:
        if not pool.listed and not await self._list(pool):
            return False
        for name, version in pool.free(self.clock()):
            now = time.time()
            _, got = await self._write("take", pool, name, version,
                                       self._spec(now, holderIdentity=self.holder, acquireTime=micro_time(now)))
            if got is not None:
                pool.acquired(name, got, self.clock())
                self._held_changed(pool)
                return True
        await self._list(pool)  # lost every race, or saw nothing free: read again before the next try
        return False

    async def _give_back(self, pool: SeatPool, name: str) -> None:
        version = pool.held.get(name, "")
        pool.released(name)
        self._held_changed(pool)  # the limit drops before the write: nothing new starts on this seat
        if version:
            await self._write("give-back", pool, name, version, self._spec(time.time(), holderIdentity=None))

    async def _renew(self, pool: SeatPool) -> None:
        for name, version in list(pool.held.items()):
            status, got = await self._write("renew", pool, name, version, self._spec(time.time()))
            if got is not None:
                pool.renewed(name, got)
            elif status in (404, 409):  # written by another holder since (ours went stale), or deleted
                pool.released(name)
                self._held_changed(pool)
                log.warning("fleet %s: seat Lease %s was taken over while held (renewed too late)",
                            self.settings.name, name)
        await self._list(pool)  # who else holds the level's seats (taking turns only matters if all are held)

    def _held_changed(self, pool: SeatPool) -> None:
        HELD.labels(pool.level).set(len(pool.held))
        self.on_change()
