"""Bounded caches keyed by a token's SHA-256 digest, each entry expiring at its own time (pure, time passed in).

Insertion-order eviction: a flood of new keys only pushes out entries of the same cache, which is why verified and
failed tokens live in separate caches."""

from __future__ import annotations

import hashlib
from typing import Generic, TypeVar

V = TypeVar("V")


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class ExpiringCache(Generic[V]):
    """At most ``max_entries`` values; :meth:`get` never returns one past its expiry."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max(1, max_entries)
        self._items: dict[bytes, tuple[V, float]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: bytes, now: float) -> V | None:
        hit = self._items.get(key)
        if hit is None:
            return None
        if hit[1] <= now:
            del self._items[key]
            return None
        return hit[0]

    def put(self, key: bytes, value: V, expires: float, now: float) -> None:
        if expires <= now:
            return
        items = self._items
        if key not in items and len(items) >= self.max_entries:
            del items[next(iter(items))]
        items[key] = (value, expires)

    def discard(self, key: bytes) -> bool:
        """Forget ``key``; whether it was there."""
        return self._items.pop(key, None) is not None

    def clear(self) -> None:
        self._items.clear()
