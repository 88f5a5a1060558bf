"""Which requests may share one upstream call (pure).

Two LISTs are merged only if the apiserver would necessarily answer them
identically: same method and raw target (path and query, so selectors,
``resourceVersion``, ``limit`` and ``continue`` all match), same ``Accept``
(JSON vs protobuf vs Table), same ``Accept-Encoding``, and the same
credentials — the verified client identity for certificate users, the exact
``Authorization`` header for token users, plus any ``Impersonate-*`` headers.
Different identities are never merged even when they would be authorized
alike: authorization is the apiserver's to decide, per caller.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

MERGE_HEADERS = ("accept", "accept-encoding", "authorization")


def identity_key(user_name: str, groups: Sequence[str], source: str, headers: Sequence[tuple[str, str]]) -> str:
    """A digest of everything that decides who the apiserver thinks the caller is."""
    h = hashlib.sha256()
    h.update(f"{source}\x00{user_name}\x00{','.join(groups)}".encode())
    for k, v in sorted(headers):
        if k == "authorization" or k.startswith("impersonate-"):
            h.update(f"\x00{k}:{v}".encode())
    return h.hexdigest()


def coalesce_key(method: str, target: str, headers: Sequence[tuple[str, str]], identity: str) -> tuple[str, ...] | None:
    """The merge key for a request, or None if it must never be merged (only plain GET LISTs merge)."""
    if method != "GET":
        return None
    picked = tuple(f"{k}:{v}" for k, v in sorted(headers) if k in MERGE_HEADERS or k.startswith("impersonate-"))
    return (method, target, identity, *picked)
