"""The asyncio edge of the fleet budget: renew our Lease, list the fleet's, apply our share (``core/fleet.py``).

The apiservers are the coordination engine, as for leader election: no datastore or consensus of our own. A
renewal is one server-side apply (``force``), so the workers of one proxy renewing the same Lease never conflict.
RBAC: ``deploy/examples/proxy-identity-rbac.yaml`` (Leases in the fleet's namespace only).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from urllib.parse import quote

import orjson
from prometheus_client import Counter, Gauge

from gatekeeper.kube.objects import Lease
from gatekeeper.proxy.flowcontrol.core.fleet import FleetShare, LeaseView, Membership, fleet_bound, lease_views
from gatekeeper.proxy.flowcontrol.edge.seatleases import SeatLeaser, first_answer, leases_path, micro_time
from gatekeeper.proxy.flowcontrol.settings import FleetSettings
from gatekeeper.proxy.identity.auth import identity_headers
from gatekeeper.proxy.identity.tokens.fetch import Upstream
from gatekeeper.proxy.messages import UserInfo
from gatekeeper.runtime.tasks import stop_task

log = logging.getLogger("gatekeeper.proxy.flowcontrol.fleet")

FLEET_LABEL = "gatekeeper.dev/fleet"
MAX_LIST_BYTES = 4 << 20

MEMBERS = Gauge("gatekeeper_fleet_members", "Proxies of this fleet counted alive (the size shares divide by).",
                multiprocess_mode="livemax")
SHARE = Gauge("gatekeeper_fleet_share_seats", "This proxy's seats of each priority level, its share of the fleet's.",
              ["priority_level"], multiprocess_mode="livemax")
PARTITIONED = Gauge("gatekeeper_fleet_partitioned",
                    "1 while this proxy could not renew its Lease for a whole duration (it runs on the "
                    "conservative share of fallbackMembers).", multiprocess_mode="livemax")
RENEW_FAILURES = Counter("gatekeeper_fleet_lease_renew_failures", "Lease renewals or fleet listings that failed.",
                         ["reason"])


def own_identity(settings: FleetSettings) -> str:
    """``fleet.identity``, else ``NODE_NAME``/``POD_NAME``, else the host name, as a lower-case DNS name."""
    raw = settings.identity or os.environ.get("NODE_NAME") or os.environ.get("POD_NAME") or socket.gethostname()
    name = "".join(c if c.isalnum() or c in "-." else "-" for c in raw.lower()).strip("-.")[:200]
    if not name:
        raise ValueError(f"fleet: cannot make a Lease name of the identity {raw!r}; set flowControl.fleet.identity")
    return name


def lease_name(identity: str) -> str:
    return f"gatekeeper-proxy-{identity}"


def lease_body(settings: FleetSettings, identity: str, now: float,
               annotations: dict[str, str] | None = None) -> Lease:
    body: Lease = {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": lease_name(identity), "namespace": settings.namespace,
                     "labels": {FLEET_LABEL: settings.name}},
        "spec": {"holderIdentity": identity, "leaseDurationSeconds": max(1, round(settings.lease_duration_seconds)),
                 "renewTime": micro_time(now)},
    }
    if annotations:  # server-side apply: dropped from a later body, they are removed from the Lease
        body["metadata"]["annotations"] = dict(annotations)
    return body


def parse_leases(body: bytes) -> list[LeaseView]:
    """The fleet's Leases from a LeaseList (see :func:`lease_views`)."""
    return lease_views(orjson.loads(body).get("items") or [])


class FleetMember:
    """Renews our Lease and re-divides the budget on every period (see the module docstring)."""

    def __init__(self, settings: FleetSettings,
                 apply: Callable[[FleetShare], dict[str, tuple[int, int]]],
                 clock: Callable[[], float] = time.monotonic, *,
                 user: UserInfo | None = None,
                 demand: Callable[[str], tuple[int, int]] = lambda level: (0, 0),
                 seats_changed: Callable[[], None] = lambda: None) -> None:
        """``apply(share_of)``: give flow control the function from (level, nominal seats) to ours; ``demand`` and
        ``seats_changed``: a leased level's (seats executing, seats waiting) here, and held seat Leases changed."""
        self.settings = settings
        self.identity = own_identity(settings)
        self.apply = apply
        self.clock = clock
        self.membership = Membership(self.identity, settings.lease_duration_seconds, settings.fallback_members)
        self.upstreams: Sequence[Upstream] = ()
        self.decided: tuple[int, int] | None = None
        self.was_partitioned = False
        self._task: asyncio.Task[None] | None = None
        self.annotations: dict[str, str] = {}
        """Put on our Lease at every renewal (``edge/endpoints.py``: where in-cluster callers reach us)."""
        self.on_listing: list[Callable[[bytes], None]] = []
        """Called with every fleet LeaseList read, after membership has seen it."""
        user = user or UserInfo(name="system:gatekeeper-proxy", groups=["system:authenticated"])
        self.headers = [("accept", "application/json"),
                        *identity_headers(UserInfo(name=user.name, groups=list(user.groups), source="x509"))]
        """What every call of the fleet carries (the proxy's own identity): its Lease's, the seat Leases' and the
        endpoint publisher's."""
        base = leases_path(settings.namespace)
        self._patch_path = f"{base}/{quote(lease_name(self.identity))}?fieldManager=gatekeeper-proxy&force=true"
        self._list_path = f"{base}?labelSelector={quote(f'{FLEET_LABEL}={settings.name}', safe='')}"
        self.seats = SeatLeaser(settings, self.identity, self.headers, demand, seats_changed, clock)

    def set_worker(self, index: int) -> None:
        """Each worker process holds seat Leases of its own (its seats are not in the workers' shared ledger)."""
        self.seats.holder = f"{self.identity}-w{index}"

    def seats_for(self, level: str, limit: int) -> int | None:
        """Seat Leases this process holds of ``level`` when the fleet leases it (fewer seats than live proxies);
        None: the level takes the static share."""
        size = self.decided[0] if self.decided is not None else 1
        if not self.settings.seat_leases or size <= 1 or limit >= size or not self.seats.usable:
            return None
        return self.seats.held(level, limit)

    def use_upstream(self, upstreams: Sequence[Upstream]) -> None:
        self.upstreams = self.seats.upstreams = upstreams
        if not any(u.ssl_identity is not None for u in upstreams):
            raise ValueError("flowControl.fleet needs upstream.clientCertFile and clientKeyFile (the front-proxy "
                             "certificate): the proxy renews its Lease as its own identity (tokens.proxyUser)")

    def start(self) -> None:
        self.step_decision()  # until the first listing: ourselves alone, or the partition fallback
        self._task = asyncio.get_running_loop().create_task(self._run(), name="gatekeeper-fleet")

    async def close(self) -> None:
        await self.seats.close()
        await stop_task(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await self.renew_and_list()
            self.step_decision()
            await asyncio.sleep(self.settings.renew_interval_seconds)

    async def _call(self, method: str, path: str, body: bytes | None, extra: list[tuple[str, str]]) -> bytes:
        """One call on the first backend that answers; raises the last failure."""
        # Half the Lease's life, as client-go's leader election: a storm-slowed apiserver is no partition.
        deadline = max(1.0, self.settings.lease_duration_seconds / 2)
        status, answer = await first_answer(self.upstreams, method, path, [*self.headers, *extra], body,
                                            deadline=deadline, max_bytes=MAX_LIST_BYTES, retry_from=300)
        if status in (401, 403):
            raise PermissionError(f"{method} {path.split('?')[0]}: {status} {answer[:300]!r}")
        return answer

    async def renew_and_list(self) -> None:
        now = self.clock()
        try:
            body = orjson.dumps(lease_body(self.settings, self.identity, time.time(), self.annotations))
            await self._call("PATCH", self._patch_path, body, [("content-type", "application/apply-patch+yaml")])
            self.membership.renewed(now)
        except Exception as exc:
            self._failed("renew", exc)
            self.seats.heartbeat(isinstance(exc, PermissionError))  # a refusal is an answer: the seats find out
            return
        self.seats.heartbeat(True)
        try:
            listing = await self._call("GET", self._list_path, None, [])
            self.membership.observe(parse_leases(listing), self.clock())
            for hook in self.on_listing:
                hook(listing)
        except Exception as exc:
            self._failed("list", exc)

    def _failed(self, what: str, exc: Exception) -> None:
        reason = "forbidden" if isinstance(exc, PermissionError) else what
        RENEW_FAILURES.labels(reason).inc()
        log.warning("fleet %s: %s failed: %s", self.settings.name, what, exc)

    def step_decision(self) -> None:
        now = self.clock()
        size, rank = self.membership.decide(now)
        partitioned = self.membership.partitioned(now) and self.decided is not None
        if partitioned != self.was_partitioned:
            self.was_partitioned = partitioned
            PARTITIONED.set(1 if partitioned else 0)
            if partitioned:
                log.warning("fleet %s: our Lease not renewed for %gs: assuming at least %d proxies (fallbackMembers)",
                            self.settings.name, self.settings.lease_duration_seconds, size)
            else:
                log.info("fleet %s: Lease renewed again", self.settings.name)
        if (size, rank) == self.decided:
            return
        self.decided = (size, rank)
        MEMBERS.set(size)
        seats = self.apply(FleetShare(size, rank))
        for level, (here, _) in seats.items():
            SHARE.labels(level).set(here)
        described = ", ".join(
            f"{lv} {here} of {whole} as seat Leases" if lv in self.seats.leased else
            f"{lv} {here} of {whole} (fleet-wide at most {fleet_bound(whole, size)})"
            for lv, (here, whole) in sorted(seats.items()))
        log.info("fleet %s: %d proxies, this one (%s) is number %d; seats here: %s", self.settings.name, size,
                 self.identity, rank + 1, described)
