"""One leader among every webhook process of the cluster, by a ``coordination.k8s.io/v1`` Lease.

Several replicas, each with several workers, would otherwise all watch every ResourceClaim and all
export the same per-GPU series. The Lease is the Kubernetes way to pick one (what kube-controller-manager
does): the holder renews it every ``renewSeconds``; another process takes it over only once it has
seen the same resourceVersion for ``leaseSeconds`` (time measured on its own clock, as client-go does, so
clocks that disagree do not matter); every write carries the resourceVersion it read, so two processes
cannot both win (the loser gets 409). A leader that cannot renew for ``leaseSeconds`` stops leading
on its own, before anyone can take over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gatekeeper.webhook.kube_errors import describe

log = logging.getLogger(__name__)


class Conflict(Exception):
    """The Lease changed since it was read (409), or another process created it first."""


@dataclass(frozen=True)
class LeaseOps:
    """The three calls the elector makes; kube_api.lease_ops builds them from an ApiClient."""

    get: Callable[[], Awaitable[dict[str, Any] | None]]
    create: Callable[[dict[str, Any]], Awaitable[dict[str, Any] | None]]
    replace: Callable[[dict[str, Any]], Awaitable[dict[str, Any] | None]]
    """create and replace return the Lease as written (its new resourceVersion), None if the answer lacks it."""


def _micro(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    """:meth:`run` keeps ``leading`` true while this process holds the Lease; ``on_change(leading)`` on changes."""

    def __init__(self, ops: LeaseOps, name: str, namespace: str, identity: str, lease_seconds: float,
                 renew_seconds: float, on_change: Callable[[bool], None] = lambda _: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ops, self.name, self.namespace, self.identity = ops, name, namespace, identity
        self.lease_seconds, self.renew_seconds = lease_seconds, renew_seconds
        self.on_change, self.clock = on_change, clock
        self.leading = False
        self._seen: tuple[str, float] = ("", 0.0)
        """(resourceVersion last seen, when it was first seen on our clock)."""
        self._renewed = 0.0
        self._written: dict[str, Any] | None = None
        """The Lease as this process's last write left it: a leader renews from it without reading first (one
        call per renewal, not two); a write that meets another's change gets 409, and the next step reads."""

    def _spec(self, old: dict[str, Any], now: float) -> dict[str, Any]:
        mine = old.get("holderIdentity") == self.identity
        return {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_seconds),
                "acquireTime": old.get("acquireTime") if mine and old.get("acquireTime") else _micro(now),
                "renewTime": _micro(now),
                "leaseTransitions": int(old.get("leaseTransitions") or 0) + (1 if old.get("holderIdentity")
                                                                             and not mine else 0)}

    async def try_once(self) -> bool:
        """Read the Lease and take or renew it if it is ours to take; whether this process now leads."""
        now = time.time()
        current, self._written = (self._written if self.leading else None), None
        if current is None:
            current = await self.ops.get()
        if current is None:
            self._written = await self.ops.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                                   "metadata": {"name": self.name, "namespace": self.namespace},
                                                   "spec": self._spec({}, now)})
            return True
        meta, spec = current.get("metadata") or {}, current.get("spec") or {}
        rv = str(meta.get("resourceVersion", ""))
        if rv != self._seen[0]:
            self._seen = (rv, self.clock())
        holder = spec.get("holderIdentity")
        expired = self.clock() - self._seen[1] >= self.lease_seconds
        if holder and holder != self.identity and not expired:
            return False
        self._written = await self.ops.replace({**current, "spec": {**spec, **self._spec(spec, now)}})
        return True

    def _set(self, leading: bool) -> None:
        if leading != self.leading:
            self.leading = leading
            log.info("GPU inventory lease %s/%s: %s", self.namespace, self.name,
                     "leading" if leading else "following")
            self.on_change(leading)

    async def step(self) -> None:
        try:
            leading = await self.try_once()
            if leading:
                self._renewed = self.clock()
        except Conflict:
            leading = False
        except Exception as exc:  # an apiserver we cannot reach: keep leading only while the lease surely holds
            log.warning("GPU inventory lease: %s", describe(exc))
            # Others may take over leaseSeconds after they saw our last renewal; we notice only at our next
            # step, up to renewSeconds later, so stop one renewal early.
            leading = self.leading and self.clock() - self._renewed < self.lease_seconds - self.renew_seconds
        self._set(leading)

    async def run(self) -> None:
        try:
            while True:
                await self.step()
                await asyncio.sleep(self.renew_seconds)
        finally:
            self._set(False)
