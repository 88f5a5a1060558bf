"""A fleet of proxies holds one budget: who is alive, how many seats of each level this proxy may use.

Pure, the clock passed in (docs/deploy/proxy.md#one-budget-for-the-fleet). Liveness is judged by the local clock,
as client-go's leader election does, so clocks of different nodes are never compared. Every proxy keeps at least
1 seat (a 0 would 429 clients pinned to it by long-lived connections), so a level holds at most ``max(L, n)``.
Growth applies at once so the budget is never overrun; shrinking waits a TTL. A partitioned proxy assumes the
larger of its last fleet and ``fallbackMembers``, never "unlimited".
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LeaseView:
    """What one Lease says: the fields the fleet's member, seat and writer Leases are read by."""

    name: str
    holder: str
    renew_time: str
    duration_seconds: float
    version: str = ""
    """metadata.resourceVersion: the compare-and-swap precondition of the next write."""
    transitions: int = 0
    """spec.leaseTransitions: takeovers so far (the writer Lease counts them)."""


def lease_view(item: Any) -> LeaseView:
    """One Lease object as read; KeyError, TypeError, ValueError or AttributeError when it is malformed."""
    meta, spec = item["metadata"], item.get("spec") or {}
    return LeaseView(str(meta["name"]), str(spec.get("holderIdentity") or ""), str(spec.get("renewTime") or ""),
                     float(spec.get("leaseDurationSeconds") or 0), str(meta.get("resourceVersion") or ""),
                     int(spec.get("leaseTransitions") or 0))


def lease_views(items: Iterable[Any]) -> list[LeaseView]:
    """A LeaseList's items; a malformed one is skipped (another writer's mistake is not ours)."""
    out = []
    for item in items:
        try:
            out.append(lease_view(item))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return out


def share(limit: int, size: int, rank: int, level: str) -> int:
    """This proxy's seats of a level of ``limit`` seats, as number ``rank`` (0-based) of a fleet of ``size``."""
    if size <= 1:
        return limit
    base, extra = divmod(limit, size)
    slot = (rank + _salt(level)) % size
    return max(1, base + (1 if slot < extra else 0))


def _salt(level: str) -> int:
    return int.from_bytes(hashlib.sha256(level.encode()).digest()[:4], "big")


@dataclass(frozen=True)
class FleetShare:
    """This proxy's place in the fleet, and what it makes of each budget (``share_of`` of flow control)."""

    size: int
    rank: int

    def __call__(self, level: str, limit: int) -> int:
        return share(limit, self.size, self.rank, level)

    def backend_slots(self, cap: int, backends: Sequence[str]) -> dict[str, int]:
        """This proxy's part of ``cap`` expensive LISTs per apiserver: each apiserver's slots are dealt out one
        by one so they add up to exactly ``cap``; only a proxy owning none at all gets a spare (``backend_bound``)."""
        if self.size <= 1 or not backends:
            return dict.fromkeys(backends, cap)
        salt = _salt("expensive-lists-per-backend")
        out = dict.fromkeys(backends, 0)
        for g in range(cap * len(backends)):
            if (g + salt) % self.size == self.rank:
                out[backends[g // cap]] += 1
        if not any(out.values()):  # the k-th proxy without a slot: the spare ones spread evenly
            k = (self.rank - salt - cap * len(backends)) % self.size
            out[backends[k % len(backends)]] = 1
        return out


def backend_bound(cap: int, backends: int, size: int) -> int:
    """The most expensive LISTs the fleet may run on one apiserver at once (the slots' rounding)."""
    spare = max(0, size - cap * backends) if size > 1 else 0
    return cap + -(-spare // max(1, backends))


def fleet_bound(limit: int, size: int) -> int:
    """The most seats of a level the whole fleet can hold at once (the documented rounding)."""
    return max(limit, size) if size > 1 else limit


class Membership:
    """Who is alive in the fleet, from repeated Lease listings, by the local clock."""

    def __init__(self, me: str, ttl: float, fallback_members: int) -> None:
        self.me = me
        self.ttl = ttl
        self.fallback_members = fallback_members
        self._seen: dict[str, tuple[str, float, float, str]] = {}
        """Lease name -> (renewTime as last read, local time it last changed, its duration, holder)."""
        self._renewed_at: float | None = None
        self._last_members: tuple[str, ...] = (me,)
        self._applied: tuple[int, int] | None = None
        """(size, rank) in force."""
        self._applied_at = float("-inf")

    # -- inputs --------------------------------------------------------------------------------------------
    def renewed(self, now: float) -> None:
        """Our own Lease was written."""
        self._renewed_at = now

    def observe(self, leases: Iterable[LeaseView], now: float) -> None:
        """One listing of the fleet's Leases. A Lease gone from the listing is gone (deleted)."""
        seen: dict[str, tuple[str, float, float, str]] = {}
        for lease in leases:
            before = self._seen.get(lease.name)
            changed = now if before is None or before[0] != lease.renew_time else before[1]
            seen[lease.name] = (lease.renew_time, changed, lease.duration_seconds, lease.holder)
        self._seen = seen

    # -- outputs -------------------------------------------------------------------------------------------
    def partitioned(self, now: float) -> bool:
        """Our own Lease has not been renewed for a TTL: we cannot tell who else is alive."""
        return self._renewed_at is None or now - self._renewed_at >= self.ttl

    def alive(self, now: float) -> tuple[str, ...]:
        """The holders alive now, ourselves included, sorted."""
        holders = {holder for _, changed, duration, holder in self._seen.values()
                   if now - changed < duration and holder}
        holders.add(self.me)
        return tuple(sorted(holders))

    def decide(self, now: float) -> tuple[int, int]:
        """(fleet size, our rank) to use now, with the growth/shrink rules of the module docstring."""
        if self.partitioned(now):
            members = self._last_members  # always holds ourselves, as alive() does
            size = max(len(members), self.fallback_members)
        else:
            members = self._last_members = self.alive(now)
            size = len(members)
        return self._apply((size, members.index(self.me)), now)

    def _apply(self, wanted: tuple[int, int], now: float) -> tuple[int, int]:
        current = self._applied
        # Shrinking gives the survivors more at most once per TTL, so a flapping proxy cannot make shares swing.
        if current is not None and wanted[0] < current[0] and now - self._applied_at < self.ttl:
            return current
        if wanted != current:
            self._applied, self._applied_at = wanted, now
        return wanted
