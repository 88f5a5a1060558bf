"""Work estimates: how many seats a request occupies, learnt from real response sizes.

Upstream APF charges a LIST ``ceil(objects / 100)`` seats (capped at 10) from
object counts in its storage. The proxy cannot count objects, but it sees every
response byte, and bytes are what blow up an apiserver's memory (decode from
etcd, convert, encode: several copies of the response at once). So:

    non-LIST request:  seats = 1
    WATCH:             seats = 1, held only until the first response body bytes arrive
                       (at most watchInitSeconds after the response head)
    LIST:              est   = estimate[(resource, namespace)]
                             (if unseen: estimate[(resource, "")], the cluster-wide LIST,
                              else 0), then refined by the LIST's shape (``listcost.py``):
                             limit=N costs N * perObject[resource] (learnt from paginated
                             responses), a selector LIST read from storage the whole est,
                             a metadata.name LIST one object
                       seats = clamp(ceil(est / bytesPerSeat), 1, maxSeats)
                       then, in the level, at most the level's own maximum
                       (queueset.level_max_seats, upstream's rule for queuing levels):
                           max(1, min(ceil(0.15 * levelLimit), levelLimit // handSize))
                       or the whole levelLimit for a Reject level.

    after each LIST response of ``b`` bytes (complete, status 200):
        estimate = b                          if b >= estimate   (grow at once: safety)
        estimate = 0.8 * estimate + 0.2 * b   otherwise          (shrink slowly)

A LIST is dispatched only if, in addition to seats, the estimated bytes of all
LISTs executing in limited levels stay within ``listBytesCap``
(``sum(est of executing LISTs) + est <= cap``), unless no LIST is executing
(so one oversized LIST still runs, alone). Seats share a level by size in
big levels (600-seat default total: a 60 MiB LIST costs 8 of a 588-seat level's
seats, a 1 MiB one costs 1); in small levels the per-level maximum keeps a
wide LIST from taking the whole level, and the byte cap is what keeps big
LISTs apart: with the defaults (1 GiB cap) two 1 GiB LISTs never run together
while twenty 1 MiB LISTs can. In the seeds' 2-seat level every LIST costs 1
seat, so exactly two secret LISTs run at once whatever their size (within the
byte cap), never more.
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
        """Learn from a complete 200 LIST response of ``nbytes``. ``continued``: the response carried a
        continue token (True), none (False), or it could not be told (None, e.g. protobuf)."""
        if shape is not None and shape.limit > 0 and continued:  # a full page: exactly ``limit`` objects
            self._blend(self.per_object, resource, nbytes / shape.limit)
            return
        # no continue token (or an encoding where it cannot be seen, e.g. protobuf: as before, the
        # response counts as the whole collection; the estimate only shrinks slowly on smaller ones)
        if shape is not None and (shape.selector or shape.continued):
            return  # a filtered or later page says nothing about the whole collection
        self._blend(self.sizes, (resource, namespace), nbytes)

    @staticmethod
    def _blend(table: dict[Any, float], key: Any, value: float) -> None:
        old = table.get(key)
        if old is None or value >= old:
            table[key] = float(value)
        else:
            table[key] = DECAY * old + (1 - DECAY) * value
