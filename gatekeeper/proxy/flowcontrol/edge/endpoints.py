"""The asyncio edge of ``fleet.publishEndpoints``: put our advert on our fleet Lease, and while we hold the writer
Lease, write the ``default/kubernetes`` EndpointSlices and Endpoints to the live members' adverts
(``core/endpoints.py``, ``core/leader.py``).

Liveness is the fleet's (``FleetMember.membership``), read after each of its listings, so a dead proxy leaves the
endpoints when it leaves the fleet: ``leaseDurationSeconds`` after its last renewal, plus up to one renewal
interval to be seen. The writer Lease, ``gatekeeper-endpoints-<fleet>`` beside the members' (and without their
label, so it is no member), makes one proxy at a time the writer. Only worker 0 of a proxy takes part in the
election; every worker puts the advert on the Lease (they renew it under one field manager). On drain a proxy takes
its advert off at once, and a draining writer publishes the others and hands the writer Lease back. RBAC:
``deploy/examples/proxy-identity-rbac.yaml`` (EndpointSlices and Endpoints in ``default``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any
from urllib.parse import quote

import orjson
from prometheus_client import Counter, Gauge

from gatekeeper.proxy.flowcontrol.core import endpoints as core
from gatekeeper.proxy.flowcontrol.core.fleet import LeaseView, lease_view
from gatekeeper.proxy.flowcontrol.core.leader import LeaderElection
from gatekeeper.proxy.flowcontrol.edge.fleet import MAX_LIST_BYTES, FleetMember, lease_name
from gatekeeper.proxy.flowcontrol.edge.seatleases import first_answer, leases_path, micro_time
from gatekeeper.proxy.flowcontrol.settings import PublishEndpointsSettings
from gatekeeper.runtime.tasks import stop_task

log = logging.getLogger("gatekeeper.proxy.flowcontrol.endpoints")

WRITER = Gauge("gatekeeper_fleet_endpoints_writer",
               "1 while this proxy holds the writer Lease of the kubernetes Service's endpoints.",
               multiprocess_mode="livemax")
PUBLISHED = Gauge("gatekeeper_fleet_endpoints_published",
                  "Proxies in the kubernetes Service's endpoints as this proxy last wrote or read them as the writer.",
                  multiprocess_mode="livemax")
WRITES = Counter("gatekeeper_fleet_endpoints_writes", "Writes of the kubernetes Service's endpoints by this proxy.",
                 ["kind", "op"])
FAILURES = Counter("gatekeeper_fleet_endpoints_failures",
                   "Failed calls for the kubernetes Service's endpoints or the writer Lease.", ["reason"])
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{core.NAMESPACE}/endpointslices"
ENDPOINTS = f"/api/v1/namespaces/{core.NAMESPACE}/endpoints"
MERGE = "application/merge-patch+json"


class Conflict(RuntimeError):
    """409: someone else wrote first (the writer Lease, or a slice); the next round reads again."""


def writer_lease_name(fleet: str) -> str:
    return f"gatekeeper-endpoints-{fleet}"


class EndpointPublisher:
    """See the module docstring. ``writer``: this process takes part in the writer election (worker 0)."""

    def __init__(self, fleet: FleetMember, advert: core.Advert, *, writer: bool) -> None:
        self.fleet = fleet
        self.advert = advert
        self.writer = writer
        self.election = LeaderElection(fleet.identity, fleet.settings.lease_duration_seconds)
        self.adverts: dict[str, core.Advert] = {}
        """holder -> advert, from the fleet's last listing."""
        self.listed = asyncio.Event()
        self.leaving = False
        self.was_leading = False
        self._record: LeaseView | None = None
        self._task: asyncio.Task[None] | None = None
        leases = leases_path(fleet.settings.namespace)
        self._writer_path = f"{leases}/{quote(writer_lease_name(fleet.settings.name))}"
        self._own_path = f"{leases}/{quote(lease_name(fleet.identity))}"

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.fleet.annotations.update(self.advert.annotations())
        self.fleet.on_listing.append(self._listed)
        if self.writer:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gatekeeper-fleet-endpoints")

    async def leave(self) -> None:
        """Draining: our advert off the Lease now; as the writer, publish the others and hand the Lease back."""
        self.leaving = True
        for key in self.advert.annotations():
            self.fleet.annotations.pop(key, None)
        gone = {"metadata": {"annotations": dict.fromkeys(self.advert.annotations())}}
        with contextlib.suppress(Exception):
            await self._request("PATCH", self._own_path, gone, MERGE)
        if self.writer and self.election.leading(self.fleet.clock()):
            with contextlib.suppress(Exception):
                await self.reconcile()
            await self._release()

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None
        with contextlib.suppress(ValueError):
            self.fleet.on_listing.remove(self._listed)

    def _listed(self, listing: bytes) -> None:
        try:
            self.adverts = core.adverts_of(orjson.loads(listing).get("items") or [])
        except (ValueError, AttributeError):
            return
        self.listed.set()

    # -- the writer -----------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.listed.wait(), self.fleet.settings.renew_interval_seconds)
            fresh = self.listed.is_set()
            self.listed.clear()
            try:
                if await self.elect() and fresh and not self.leaving:
                    await self.reconcile()
            except Conflict as exc:
                self._failed("conflict", exc)
            except Exception as exc:
                self._failed("error", exc)

    async def elect(self) -> bool:
        """One round of the election; True while we are the writer."""
        now = self.fleet.clock()
        status, body = await self._request("GET", self._writer_path)
        record = None if status == 404 else lease_view(orjson.loads(self._ok(status, body, "read the writer Lease")))
        action = self.election.observe(record, now)
        if action != "follow" and not self.leaving:
            spec = {"holderIdentity": self.fleet.identity, "renewTime": micro_time(time.time()),
                    "leaseDurationSeconds": max(1, round(self.fleet.settings.lease_duration_seconds))}
            if action != "renew":
                spec.update(acquireTime=spec["renewTime"],
                            leaseTransitions=(record.transitions + 1) if record else 0)
            if action == "create":
                new = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "spec": spec,
                       "metadata": {"name": writer_lease_name(self.fleet.settings.name),
                                    "labels": {"gatekeeper.dev/endpoints-writer": self.fleet.settings.name}}}
                status, body = await self._request("POST", self._writer_path.rsplit("/", 1)[0], new)
            else:
                assert record is not None
                patch = {"metadata": {"resourceVersion": record.version}, "spec": spec}
                status, body = await self._request("PATCH", self._writer_path, patch, MERGE)
            if status == 409:  # another proxy won this round
                self.election.lost()
                FAILURES.labels("conflict").inc()
            else:
                self._record = lease_view(orjson.loads(self._ok(status, body, f"{action} the writer Lease")))
                self.election.wrote(now)
        elif action == "follow":
            self.election.lost()
        return self._note_leading(self.election.leading(now))

    def _note_leading(self, leading: bool) -> bool:
        if leading != self.was_leading:
            self.was_leading = leading
            WRITER.set(1 if leading else 0)
            if leading:
                log.info("fleet %s: this proxy (%s) now writes the kubernetes Service's endpoints",
                         self.fleet.settings.name, self.fleet.identity)
            else:
                log.info("fleet %s: this proxy (%s) no longer writes the kubernetes Service's endpoints (now: %s)",
                         self.fleet.settings.name, self.fleet.identity, self.election.holder() or "nobody")
                PUBLISHED.set(0)
        return leading

    async def reconcile(self) -> None:
        """Bring the Service's slices and Endpoints to the live members' adverts (ours unless leaving)."""
        now = self.fleet.clock()
        if self.fleet.membership.partitioned(now):
            return  # we cannot tell who is alive, and could not write anyway
        alive = set(self.fleet.membership.alive(now))
        members = {h: a for h, a in self.adverts.items() if h in alive and h != self.fleet.identity}
        if not self.leaving:
            members[self.fleet.identity] = self.advert
        status, body = await self._request("GET", f"{SLICES}?labelSelector="
                                           f"{quote(f'{core.SERVICE_NAME_LABEL}={core.SERVICE}', safe='')}")
        slices = list(orjson.loads(self._ok(status, body, "list the kubernetes EndpointSlices")).get("items") or [])
        status, body = await self._request("GET", f"{ENDPOINTS}/{core.SERVICE}")
        current = None if status == 404 else orjson.loads(self._ok(status, body, "read the kubernetes Endpoints"))
        before = core.published(slices)
        writes = core.plan(members.values(), slices, current)
        for write in writes:
            await self._apply(write)
        after = core.published(core.desired_slices(members.values()).values()) if writes else before
        PUBLISHED.set(len(after))
        if writes:
            log.info("fleet %s: the kubernetes Service's endpoints are now %s (were %s)", self.fleet.settings.name,
                     ", ".join(after) or "-", ", ".join(before) or "none")
        elif not members:
            log.warning("fleet %s: no live proxy to publish; the kubernetes Service keeps %s",
                        self.fleet.settings.name, ", ".join(before) or "no endpoints")

    async def _apply(self, write: core.Write) -> None:
        base = SLICES if write.kind == "EndpointSlice" else ENDPOINTS
        method, path = {"create": ("POST", base), "update": ("PUT", f"{base}/{quote(write.name)}"),
                        "delete": ("DELETE", f"{base}/{quote(write.name)}")}[write.op]
        status, body = await self._request(method, path, dict(write.body) if write.body else None)
        if not (write.op == "delete" and status == 404):
            self._ok(status, body, f"{write.op} {write.kind} {core.NAMESPACE}/{write.name}")
        WRITES.labels(write.kind, write.op).inc()

    async def _release(self) -> None:
        record = self._record
        if record is None:
            return
        patch = {"metadata": {"resourceVersion": record.version},
                 "spec": {"holderIdentity": None, "leaseDurationSeconds": 1}}
        with contextlib.suppress(Exception):
            await self._request("PATCH", self._writer_path, patch, MERGE)
        self.election.lost()
        self._note_leading(False)

    # -- calls ----------------------------------------------------------------------------------------------
    async def _request(self, method: str, path: str, body: Any = None,
                       content_type: str = "application/json") -> tuple[int, bytes]:
        """One call on the first backend that answers (below 500); raises the last failure."""
        payload = None if body is None else orjson.dumps(body)
        headers = [*self.fleet.headers, *([("content-type", content_type)] if payload is not None else [])]
        return await first_answer(self.fleet.upstreams, method, path, headers, payload, max_bytes=MAX_LIST_BYTES,
                                  deadline=max(1.0, self.fleet.settings.lease_duration_seconds / 2))

    def _ok(self, status: int, body: bytes, what: str) -> bytes:
        if status in (401, 403):
            raise PermissionError(f"{what}: {status} {body[:300]!r}")
        if status == 409:
            raise Conflict(f"{what}: {status} {body[:300]!r}")
        if status >= 300:
            raise RuntimeError(f"{what}: {status} {body[:300]!r}")
        return body

    def _failed(self, reason: str, exc: Exception) -> None:
        reason = "forbidden" if isinstance(exc, PermissionError) else reason
        FAILURES.labels(reason).inc()
        log.warning("fleet %s: the kubernetes Service's endpoints: %s", self.fleet.settings.name, exc)


def publisher_for(fleet: FleetMember | None, settings: PublishEndpointsSettings, listener_port: int, *,
                  writer: bool) -> EndpointPublisher | None:
    """The publisher when ``fleet.publishEndpoints`` is on (the process wiring starts and closes it)."""
    if fleet is None or not settings.enabled:
        return None
    return EndpointPublisher(fleet, core.Advert(*settings.resolve(listener_port)), writer=writer)
