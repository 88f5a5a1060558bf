"""Which requests may share one upstream call (pure).

Only requests the apiserver must answer identically: same method and raw target, ``Accept``, ``Accept-Encoding``,
``Accept-Language`` (an aggregated API may vary on it), and the same credentials (verified identity plus
``Authorization``, ``Sec-WebSocket-Protocol`` and ``Impersonate-*`` as sent): authorization is the apiserver's to
decide per caller. Never an ``Upgrade`` request: the apiserver authenticates it by the token in
``Sec-WebSocket-Protocol``, so an anonymous-looking one may be a ServiceAccount's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

MERGE_HEADERS = ("accept", "accept-encoding", "accept-language", "authorization", "sec-websocket-protocol")
CREDENTIAL_HEADERS = ("authorization", "sec-websocket-protocol")


def identity_key(user_name: str, groups: Sequence[str], source: str, headers: Sequence[tuple[str, str]]) -> str:
    """A digest of everything that decides who the apiserver thinks the caller is. NUL-separated (a certificate
    name never holds one), so groups ``["a,b"]`` and ``["a", "b"]`` differ."""
    h = hashlib.sha256()
    h.update("\x00".join([source, user_name, str(len(groups)), *groups]).encode("utf-8", "surrogateescape"))
    for k, v in sorted(headers):
        if k in CREDENTIAL_HEADERS or k.startswith("impersonate-"):
            h.update(f"\x00{k}:{v}".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def coalesce_key(method: str, target: str, headers: Sequence[tuple[str, str]], identity: str) -> tuple[str, ...] | None:
    """The merge key for a request, or None if it must never be merged (the caller asks only for plain GET LISTs
    and watch-lists, whose answer to one identity is the same stream)."""
    if method != "GET" or any(k == "upgrade" for k, _ in headers):
        return None
    picked = tuple(f"{k}:{v}" for k, v in sorted(headers) if k in MERGE_HEADERS or k.startswith("impersonate-"))
    return (method, target, identity, *picked)
