"""Expensive LISTs in flight per apiserver: what lands on one apiserver, not what the proxy sends in total.

Seats bound how many LISTs run, but the balancer may put two (or two proxies') on one apiserver and exhaust its
memory. Slots are dealt over the apiservers eligible now: a down one's slots are not handed to the others, which
would be the seeds' cascade (docs/flowcontrol/index.md#expensive-lists-per-apiserver).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gatekeeper.proxy.flowcontrol.core.fleet import FleetShare


class BackendCap:
    """Per-apiserver slots for expensive LISTs; a ``nominal`` of 0 turns the cap off."""

    def __init__(self, nominal: int = 0, min_bytes: int = 8 << 20) -> None:
        self.nominal = nominal
        """The configured cap per apiserver (fleet-wide when the fleet is on)."""
        self.min_bytes = max(1, min_bytes)
        self.fleet: FleetShare | None = None
        self.names: tuple[str, ...] = ()
        """Every apiserver, in the configured order (a worker's ledger row is the place in it)."""
        self.limits: dict[str, int] = {}
        """This proxy's slots on each apiserver, dealt over ``_dealt_over``."""
        self._dealt_over: frozenset[str] | None = None
        self.in_flight: dict[str, int] = {}
        self.held_total = 0
        """LISTs that found every eligible apiserver at its limit (each counted once)."""
        self.picked_limit = 0
        """The limit :meth:`pick` checked its choice against (the ledger checks the same one under its lock)."""
        self.candidates: Callable[[], Sequence[str]] = lambda: ()
        """Eligible apiservers, least loaded first (the balancer's view, wired by the proxy)."""
        self.count: Callable[[str], int] = lambda name: self.in_flight.get(name, 0)
        """Expensive LISTs in flight on an apiserver; worker processes read every worker's (``ledger.py``)."""

    def configure(self, nominal: int, min_bytes: int, fleet: FleetShare | None,
                  names: Sequence[str] | None = None) -> None:
        self.nominal, self.min_bytes, self.fleet = nominal, max(1, min_bytes), fleet
        if names is not None:
            self.names = tuple(names)
        self._deal(frozenset(self.names))

    def _deal(self, eligible: frozenset[str]) -> None:
        self._dealt_over = eligible
        if self.fleet is None or not self.nominal:
            self.limits = dict.fromkeys(self.names, self.nominal)
            return
        # In the configured order, the same in every proxy, so their deals fit together.
        dealt = self.fleet.backend_slots(self.nominal, [n for n in self.names if n in eligible])
        self.limits = {n: dealt.get(n, 0) for n in self.names}

    def expensive(self, list_bytes: int, unsized: bool = False) -> bool:
        return self.nominal > 0 and (list_bytes >= self.min_bytes or unsized)

    def pick(self) -> str | None:
        """The eligible apiserver with the fewest expensive LISTs, if one is below this proxy's limit there."""
        candidates = self.candidates()
        if self.fleet is not None and frozenset(candidates) != self._dealt_over:
            self._deal(frozenset(candidates))
        best: str | None = None
        least = 0
        for name in candidates:
            limit = self.limits.get(name, 0)
            n = self.count(name)
            if n < limit and (best is None or n < least):
                best, least, self.picked_limit = name, n, limit
        return best

    def take(self, name: str) -> None:
        self.in_flight[name] = self.in_flight.get(name, 0) + 1

    def give(self, name: str) -> None:
        left = self.in_flight.get(name, 0) - 1
        if left > 0:
            self.in_flight[name] = left
        else:
            self.in_flight.pop(name, None)
