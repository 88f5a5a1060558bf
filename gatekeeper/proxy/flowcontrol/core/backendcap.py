"""Expensive LISTs in flight per apiserver: what lands on one apiserver, not what the proxy sends in total.

A priority level's seats bound how many LISTs run at once, but the balancer places each on any apiserver: two
of them, or two proxies' ones, can land on the same apiserver and together hold its memory. With a cap, a LIST
whose estimated response reaches ``minBytes`` starts only when some eligible apiserver has fewer than the
cap in flight; flow control reserves that apiserver for it and the dispatcher sends it there. It waits in its
queue until then (the queue's wait bound and 429 apply), and its slot goes back when the apiserver has sent
the last byte, as its seats do. In a fleet the cap is divided as seats are (``fleet.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

LEVEL = "expensive-lists-per-backend"
"""The name the fleet's rounding salts this cap's share with (``fleet.share``)."""


class BackendCap:
    """Per-apiserver slots for expensive LISTs; ``limit`` 0 turns the cap off."""

    def __init__(self, limit: int, min_bytes: int) -> None:
        self.nominal = limit
        """The configured cap (fleet-wide when the fleet is on)."""
        self.limit = limit
        """This proxy's part of it."""
        self.min_bytes = max(1, min_bytes)
        self.names: tuple[str, ...] = ()
        """Every apiserver, in the configured order (a worker's ledger row is the place in it)."""
        self.in_flight: dict[str, int] = {}
        self.held_total = 0
        """LISTs that found every eligible apiserver at the cap (each counted once)."""
        self.candidates: Callable[[], Sequence[str]] = lambda: ()
        """Eligible apiservers, least loaded first (the balancer's view, wired by the proxy)."""
        self.count: Callable[[str], int] = lambda name: self.in_flight.get(name, 0)
        """Expensive LISTs in flight on an apiserver; worker processes read every worker's (``ledger.py``)."""

    def expensive(self, list_bytes: int) -> bool:
        return self.limit > 0 and list_bytes >= self.min_bytes

    def pick(self) -> str | None:
        """The eligible apiserver with the fewest expensive LISTs, if one is below the cap."""
        best: str | None = None
        least = self.limit
        for name in self.candidates():
            n = self.count(name)
            if n < least:
                best, least = name, n
        return best

    def take(self, name: str) -> None:
        self.in_flight[name] = self.in_flight.get(name, 0) + 1

    def give(self, name: str) -> None:
        left = self.in_flight.get(name, 0) - 1
        if left > 0:
            self.in_flight[name] = left
        else:
            self.in_flight.pop(name, None)
