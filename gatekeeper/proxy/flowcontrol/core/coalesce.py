"""Which requests may share one upstream call (pure).

Two LISTs are merged only if the apiserver would necessarily answer them
identically: same method and raw target (path and query, so selectors,
``resourceVersion``, ``limit`` and ``continue`` all match, spelled the same),
same ``Accept`` (JSON vs protobuf vs Table), ``Accept-Encoding`` and
``Accept-Language`` (an aggregated API server behind kube-apiserver may vary on
it), and the same credentials — the verified client identity for certificate
users, plus every header an apiserver authenticator reads: ``Authorization``
exactly as sent, ``Sec-WebSocket-Protocol`` (its ``base64url.bearer.authorization.k8s.io.``
token) and any ``Impersonate-*`` headers. Different identities are never merged
even when they would be authorized alike: authorization is the apiserver's to
decide, per caller.

A request that asks to switch protocols (an ``Upgrade`` header) is never merged:
kube-apiserver authenticates such a request by the bearer token in its
``Sec-WebSocket-Protocol`` and answers a LIST with an ordinary 200 body, so an
anonymous-looking WebSocket LIST may really be some ServiceAccount's (checked
on v1.37.2), and it is not a plain LIST anyway.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

MERGE_HEADERS = ("accept", "accept-encoding", "accept-language", "authorization", "sec-websocket-protocol")
CREDENTIAL_HEADERS = ("authorization", "sec-websocket-protocol")


def identity_key(user_name: str, groups: Sequence[str], source: str, headers: Sequence[tuple[str, str]]) -> str:
    """A digest of everything that decides who the apiserver thinks the caller is.

    Fields are NUL-separated (a certificate name never holds a NUL: ``auth.bad_certificate_names``), so
    the groups ``["a,b"]`` and ``["a", "b"]`` are different callers.
    """
    h = hashlib.sha256()
    h.update("\x00".join([source, user_name, str(len(groups)), *groups]).encode("utf-8", "surrogateescape"))
    for k, v in sorted(headers):
        if k in CREDENTIAL_HEADERS or k.startswith("impersonate-"):
            h.update(f"\x00{k}:{v}".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def coalesce_key(method: str, target: str, headers: Sequence[tuple[str, str]], identity: str) -> tuple[str, ...] | None:
    """The merge key for a request, or None if it must never be merged (only plain GET LISTs merge)."""
    if method != "GET" or any(k == "upgrade" for k, _ in headers):
        return None
    picked = tuple(f"{k}:{v}" for k, v in sorted(headers) if k in MERGE_HEADERS or k.startswith("impersonate-"))
    return (method, target, identity, *picked)
