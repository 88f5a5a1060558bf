"""What a LIST will make the apiserver read, from the request's shape (pure).

Follows upstream's ``list_work_estimator.go`` and the watch cache's delegation rules (``ShouldDelegateListMeta``)
for storage vs watch cache; a storage LIST with a selector decodes every object to filter it, so it costs the
whole collection (docs/flowcontrol/seats.md).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from gatekeeper.kube.requestinfo import query_values


@dataclass(frozen=True)
class ListShape:
    limit: int = 0
    selector: bool = False
    """A labelSelector or fieldSelector other than an exact metadata.name."""
    resource_version: str = ""
    resource_version_match: str = ""
    continued: bool = False
    """A ``continue`` token: a later page of a paginated LIST."""


FULL = ListShape()
"""A plain LIST: all objects, from the watch cache."""


@functools.lru_cache(maxsize=4096)
def list_shape(target: str) -> ListShape:
    """The LIST options that decide its cost, read by the apiserver's Go query rules (it drops ``limit=1;``)."""
    query = target.partition("?")[2].partition("#")[0]
    if not query:
        return FULL
    q = query_values(query)

    def one(name: str) -> str:
        values = q.get(name)
        return values[0] if values else ""

    try:
        limit = max(0, int(one("limit") or 0))
    except ValueError:
        limit = 0  # the apiserver rejects it; charge it as a full LIST meanwhile
    return ListShape(
        limit=limit,
        selector=bool(one("labelSelector").strip() or one("fieldSelector").strip()),
        resource_version=one("resourceVersion"),
        resource_version_match=one("resourceVersionMatch"),
        continued=bool(one("continue")),
    )


def from_storage(shape: ListShape, storage_only: bool = False) -> bool:
    """Whether the apiserver reads etcd for this LIST rather than its watch cache."""
    if storage_only:
        return True
    match = shape.resource_version_match
    if match == "NotOlderThan":
        return False
    if match:
        return True  # Exact (or anything the cache cannot answer)
    if shape.limit > 0 and shape.resource_version not in ("", "0"):
        return True
    return shape.continued


def list_bytes(shape: ListShape, full: float, per_object: float | None, *, single: bool, storage: bool) -> float:
    """Bytes the apiserver will hold for this LIST, from the learnt collection and per-object (None: unknown) sizes."""
    if single:
        return per_object if per_object is not None else 0.0
    limited = full
    if shape.limit > 0 and per_object is not None:
        limited = min(full, shape.limit * per_object) if full else shape.limit * per_object
    if storage and shape.selector:
        return max(limited, full)
    return limited


_CONTINUE = re.compile(rb'"continue"\s*:\s*"([^"]*)"')


def continued_response(head: bytes, content_type: str) -> bool | None:
    """Whether a LIST response carries a continue token, from its first bytes: JSON puts ``metadata`` before
    ``items``; for protobuf the answer is None (unknown)."""
    if "json" not in content_type:
        return None
    items = head.find(b'"items"')
    m = _CONTINUE.search(head, 0, items if items >= 0 else len(head))
    return bool(m and m.group(1))
