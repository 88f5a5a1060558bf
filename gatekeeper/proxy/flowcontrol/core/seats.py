"""Work estimates: how many seats a request occupies, learnt from real response sizes (docs/flowcontrol/seats.md).

Upstream charges a LIST by object count; the proxy cannot count objects but sees every byte, and bytes are what
blow up an apiserver's memory (several copies of the response at once). An estimate grows at once (safety) and
shrinks slowly (``0.8 * est + 0.2 * b``). ``listBytesCap`` keeps huge LISTs apart in small levels, where the
per-level maxSeats makes every LIST cost 1 seat; one oversized LIST still runs alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gatekeeper.proxy.flowcontrol.core.listcost import FULL, ListShape, from_storage
from gatekeeper.proxy.flowcontrol.core.listcost import list_bytes as shaped_bytes

DECAY = 0.8


@dataclass(frozen=True)
class Estimate:
    """What a request is expected to cost."""

    seats: int
    list_bytes: int = 0
    """Estimated response bytes for a LIST (0 for other verbs); counts against the LIST bytes cap."""


ONE_SEAT = Estimate(seats=1)
"""Every request but a LIST (shared: an Estimate is never changed)."""


@dataclass
class SizeEstimator:
    """Per (resource, namespace) observed LIST response sizes, per-object sizes, and the seat formula above."""

    bytes_per_seat: int = 8 << 20
    max_seats: int = 10
    sizes: dict[tuple[str, str], float] = field(default_factory=dict)
    """Size of the whole collection: complete responses of LISTs without a selector."""
    per_object: dict[str, float] = field(default_factory=dict)
    """Bytes per object by resource: a page of a paginated LIST (limit=N, continue token set) holds N objects."""
    storage_only: frozenset[str] = frozenset()
    """Resources whose LISTs always read storage (no watch cache on the apiservers)."""
    max_entries: int = 20_000
    """Learned sizes kept; past it the oldest namespace's goes. Any caller can LIST a made-up namespace (a 200 with
    no objects), so the table is bounded; a forgotten namespace falls back to the whole collection's size."""

    def list_bytes(self, resource: str, namespace: str) -> int:
        est = self.sizes.get((resource, namespace))
        if est is None and namespace:
            est = self.sizes.get((resource, ""))
        return int(est or 0)

    def estimate(
        self, verb: str, resource: str, namespace: str, shape: ListShape | None = None, single: bool = False
    ) -> Estimate:
        """Seats for one request; a LIST's bytes follow its shape (``listcost.py``) when one is given."""
        if verb != "list":
            return ONE_SEAT
        b = self.list_bytes(resource, namespace)
        if shape is not None and (shape is not FULL or single):
            storage = from_storage(shape, resource in self.storage_only)
            b = int(shaped_bytes(shape, b, self.per_object.get(resource), single=single, storage=storage))
        seats = max(1, min(self.max_seats, math.ceil(b / self.bytes_per_seat)))
        return Estimate(seats=seats, list_bytes=b)

    def observe(
        self, resource: str, namespace: str, nbytes: int, shape: ListShape | None = None,
        continued: bool | None = False,
    ) -> None:
        """Learn from a complete 200 LIST of ``nbytes``; ``continued``: a continue token (True), none, or unknown."""
        if shape is not None and shape.limit > 0 and continued:  # a full page: exactly ``limit`` objects
            self._blend(self.per_object, resource, nbytes / shape.limit)
            return
        # no continue token, or one that cannot be seen (protobuf): counts as the whole collection
        if shape is not None and (shape.selector or shape.continued):
            return  # a filtered or later page says nothing about the whole collection
        self._blend(self.sizes, (resource, namespace), nbytes)

    def _blend(self, table: dict[Any, float], key: Any, value: float) -> None:
        old = table.get(key)
        if old is None and table is self.sizes and len(table) >= self.max_entries:
            # the oldest namespace's: a whole collection's ((resource, "")) is what a forgotten one falls back to
            oldest = next((k for k in table if k[1]), None)
            if oldest is not None:
                del table[oldest]
        if old is None or value >= old:
            table[key] = float(value)
        else:
            table[key] = DECAY * old + (1 - DECAY) * value
