"""What a LIST will make the apiserver read, from the request's shape (pure).

Follows upstream's ``list_work_estimator.go`` and the watch cache's delegation rules (``ShouldDelegateListMeta``)
for storage vs watch cache; a storage LIST with a selector decodes every object to filter it, so it costs the
whole collection (docs/flowcontrol/seats.md).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from gatekeeper.kube.requestinfo import query_flag, query_values


@dataclass(frozen=True)
class ListShape:
    limit: int = 0
    selector: bool = False
    """A labelSelector or fieldSelector other than an exact metadata.name."""
    resource_version: str = ""
    resource_version_match: str = ""
    continued: bool = False
    """A ``continue`` token: a later page of a paginated LIST."""
    initial_events: bool = False
    """``sendInitialEvents``: on a watch, a watch-list (KEP-3157), which streams the collection as a LIST would."""
    timeout: int = 0
    """``timeoutSeconds`` (0: none): when the apiserver ends a watch (it ignores ``timeout`` for watches); client-go
    picks a random one per watch."""

    @property
    def resumes(self) -> bool:
        """A watch from a given resourceVersion: it sends no objects that exist already, only later changes. The
        apiserver reads the version with ``strconv.ParseUint``, so ``00`` is 0 ("any": the current state first)."""
        rv = self.resource_version
        return not self.initial_events and rv.isascii() and rv.isdigit() and 0 < int(rv) < 1 << 64

    def watched(self) -> ListShape:
        """This shape as a watch that sends the current state first is costed: a watch ignores ``limit`` and
        ``continue`` (it streams every object whatever they say)."""
        return replace(self, limit=0, continued=False) if self.limit or self.continued else self


FULL = ListShape()
"""A plain LIST: all objects, from the watch cache."""

MEMO_TARGET_CHARS = 2048
"""Longest target whose shape is memoized. A target may be as long as the header-list limit (1 MiB): memoized,
4096 distinct ones would keep 4 GiB. Longer ones are parsed each time (docs/proxy/memory.md)."""


class _ShortTargets:
    """``shape`` memoized (4096 entries) for targets of at most ``MEMO_TARGET_CHARS``."""

    def __init__(self, shape: Callable[[str], ListShape]) -> None:
        self.shape = shape
        self.memo = functools.lru_cache(maxsize=4096)(shape)
        functools.update_wrapper(self, shape)

    def __call__(self, target: str) -> ListShape:
        return self.memo(target) if len(target) <= MEMO_TARGET_CHARS else self.shape(target)

    def cache_info(self) -> functools._CacheInfo:
        return self.memo.cache_info()


@_ShortTargets
def list_shape(target: str) -> ListShape:
    """The LIST options that decide its cost, read by the apiserver's Go query rules (it drops ``limit=1;``); for a
    watch, also whether it is a watch-list."""
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
    try:
        timeout = max(0, int(one("timeoutSeconds") or 0))
    except ValueError:  # the apiserver answers 400
        timeout = 0
    return ListShape(
        limit=limit,
        selector=bool(one("labelSelector").strip() or one("fieldSelector").strip()),
        resource_version=one("resourceVersion"),
        resource_version_match=one("resourceVersionMatch"),
        continued=bool(one("continue")),
        initial_events=query_flag(q.get("sendInitialEvents")),
        timeout=timeout,
    )


def without_timeout(target: str) -> str:
    """``target`` without its ``timeoutSeconds`` and ``timeout`` pairs: identical watch-lists of one identity
    differ only there (client-go randomizes them per watch); the apiserver ignores ``timeout`` on a watch, and each
    client's own ``timeoutSeconds`` is kept by ending its share then. Only the exact spellings go: a key spelled
    otherwise keeps two targets apart, which never merges too much."""
    path, sep, query = target.partition("?")
    if not sep or "timeout" not in query:
        return target
    kept = [pair for pair in query.split("&") if pair.partition("=")[0] not in ("timeoutSeconds", "timeout")]
    return f"{path}?{'&'.join(kept)}"


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
