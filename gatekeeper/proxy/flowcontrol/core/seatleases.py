"""Seat Leases: a small level's L seats shared by a fleet of N > L proxies, exactly (pure, the clock passed in).

Dividing L seats among N proxies leaves N - L of them with none, which would 429 the clients pinned to them by
long-lived connections; the static shares therefore give every proxy at least one, and a level of 2 seats behind 3
proxies runs 3 at once. Where that rounding raises a level (L < N), its seats become L Lease objects instead
(``gatekeeper-seat-<fleet>-<level>-<i>``): a proxy (each worker process, in fact) runs as many requests of the level
as it holds seat Leases, takes a free one with a compare-and-swap when it has requests waiting, and gives it back
when it has none, so every proxy can serve the level and the fleet never holds more than L.

A seat is free when its holder is empty, or when its renewTime has not changed for its duration by the local clock
(a crashed holder), as client-go's leader election judges Leases: clocks of different nodes are never compared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from gatekeeper.proxy.flowcontrol.core.fleet import LeaseView

SEAT_LABEL = "gatekeeper.dev/seat-of"
"""Label on every seat Lease: ``<fleet>.<level>`` (hashed when too long for a label value)."""


def _dns(text: str, limit: int) -> str:
    clean = "".join(c if c.isalnum() or c in "-." else "-" for c in text.lower()).strip("-.")
    if len(clean) <= limit:
        return clean
    return clean[: limit - 11].rstrip("-.") + "-" + hashlib.sha256(text.encode()).hexdigest()[:10]


def seat_name(fleet: str, level: str, index: int) -> str:
    """The Lease of seat ``index`` of ``level``: a DNS subdomain name whatever the level is called."""
    return f"gatekeeper-seat-{_dns(f'{fleet}.{level}', 200)}-{index}"


def seat_label(fleet: str, level: str) -> str:
    return _dns(f"{fleet}.{level}", 63)


class SeatPool:
    """One level's seat Leases as one holder sees them."""

    def __init__(self, me: str, fleet: str, level: str, seats: int) -> None:
        self.me = me
        self.fleet = fleet
        self.level = level
        self.seats = seats
        self.held: dict[str, str] = {}
        """Seat Lease name -> its resourceVersion after our last write."""
        self.held_since: dict[str, float] = {}
        self.retiring: set[str] = set()
        """Held seats to give back once nothing runs on them (taking turns): no longer counted as ours to use."""
        self._seen: dict[str, tuple[str, float, float, str, str]] = {}
        """Name -> (renewTime as last read, local time it last changed, duration, holder, resourceVersion)."""
        self.listed = False
        self._last_seen = 0.0

    def names(self) -> list[str]:
        return [seat_name(self.fleet, self.level, i) for i in range(self.seats)]

    def observe(self, views: Iterable[LeaseView], now: float) -> None:
        """One listing of the level's seat Leases (the only source of what other holders do)."""
        seen: dict[str, tuple[str, float, float, str, str]] = {}
        for v in views:
            before = self._seen.get(v.name)
            changed = now if before is None or before[0] != v.renew_time or before[3] != v.holder else before[1]
            seen[v.name] = (v.renew_time, changed, v.duration_seconds, v.holder, v.version)
        self._seen = seen
        self.listed = True
        self._last_seen = now

    def free(self, now: float) -> list[tuple[str, str]]:
        """Seats we may try to take, as (name, resourceVersion); an empty version: the Lease does not exist yet."""
        out = []
        for name in self.names():
            if name in self.held:
                continue
            seen = self._seen.get(name)
            if seen is None:
                out.append((name, ""))
                continue
            _, changed, duration, holder, version = seen
            if not holder or holder == self.me or now - changed >= duration:
                out.append((name, version))
        return out

    @property
    def contended(self) -> bool:
        """At the last listing every seat had a live holder: another proxy may be waiting for one (with a seat
        free, nobody is, and taking turns would only cost writes)."""
        return not self.listed or not self.free(self._last_seen)

    def acquired(self, name: str, version: str, now: float) -> None:
        self.held[name] = version
        self.held_since.setdefault(name, now)

    def renewed(self, name: str, version: str) -> None:
        if name in self.held:
            self.held[name] = version

    def usable(self) -> int:
        """Seats this holder may run requests on now."""
        return len(self.held) - len(self.retiring)

    def released(self, name: str) -> None:
        self.held.pop(name, None)
        self.held_since.pop(name, None)
        self.retiring.discard(name)
        self._seen.pop(name, None)  # whatever it says now, we wrote it last: list again before taking it

    def surplus(self) -> list[str]:
        """Held seats beyond the level's current size (it shrank): given back first."""
        wanted = set(self.names())
        return [n for n in self.held if n not in wanted]

    def oldest(self) -> str | None:
        """The seat held longest (taking turns gives it back first)."""
        return min(self.held_since, key=self.held_since.__getitem__, default=None)

    def to_give_back(self) -> str | None:
        """The seat to give back when one is not in use: a retiring one, one the level lost, else the oldest."""
        return next(iter(sorted(self.retiring)), None) or next(iter(self.surplus()), None) or self.oldest()


def wanted_seats(executing_seats: int, waiting_seats: int, seats: int) -> int:
    """How many seat Leases a holder needs now: what runs plus what waits, at most the level's seats."""
    return min(seats, executing_seats + waiting_seats)
