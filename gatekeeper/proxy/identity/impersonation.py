"""Who a trusted impersonator's request is charged to, for flow control only (pure).

kube-apiserver's APF classifies an authorized impersonation as the impersonated identity. The proxy cannot know
who may impersonate, and trusting every caller's headers would let a tenant pick its FlowSchema (an exempt one
included), so only ``flowControl.impersonators`` are trusted (docs/flowcontrol/index.md#impersonating-callers).
:func:`impersonated` builds the identity exactly as upstream's impersonation filter does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gatekeeper.proxy.identity.auth import ANONYMOUS_GROUP as UNAUTHENTICATED
from gatekeeper.proxy.identity.auth import ANONYMOUS_USER as ANONYMOUS
from gatekeeper.proxy.identity.auth import AUTHENTICATED_GROUP as AUTHENTICATED
from gatekeeper.proxy.identity.tokens.jwt import SA_ALL_GROUP, SA_NS_GROUP_PREFIX, SA_USER_PREFIX, Identity

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

TOO_BROAD_GROUPS = frozenset({AUTHENTICATED, UNAUTHENTICATED, SA_ALL_GROUP})
"""Groups every tenant (or every pod) is in: trusting one would let any of them pick its classification."""


@dataclass(frozen=True)
class ImpersonatorSettings:
    """``proxy.flowControl.impersonators``: whose ``Impersonate-*`` requests count as the impersonated identity
    (the headers still go upstream, and the apiserver authorizes them)."""

    users: list[str] = field(default_factory=list)
    """User names, as the apiserver sees them (a ServiceAccount: ``system:serviceaccount:<namespace>:<name>``)."""
    groups: list[str] = field(default_factory=list)
    """Groups; not ``system:authenticated``, ``system:unauthenticated`` or ``system:serviceaccounts``."""

    def validate(self) -> None:
        for name in self.users:
            if not name or name == ANONYMOUS:
                raise ValueError(f"impersonators.users: {name!r} cannot be trusted to impersonate "
                                 "(every unauthenticated caller is that user)")
        for group in self.groups:
            if not group or group in TOO_BROAD_GROUPS:
                raise ValueError(f"impersonators.groups: {group!r} holds every tenant or every pod; trusting it "
                                 "would let any of them choose its own FlowSchema here")

    def __bool__(self) -> bool:
        return bool(self.users or self.groups)

    def trusts(self, name: str, groups: Iterable[str]) -> bool:
        return name in self.users or any(g in self.groups for g in groups)


def _service_account(name: str) -> str | None:
    """The namespace of a valid ServiceAccount user name, else None (the filter then treats it as a plain user)."""
    if not name.startswith(SA_USER_PREFIX):
        return None
    parts = name[len(SA_USER_PREFIX):].split(":")
    if len(parts) != 2:
        return None
    ns, sa = parts
    if len(ns) > 63 or not _DNS_LABEL.fullmatch(ns) or len(sa) > 253 or not _DNS_SUBDOMAIN.fullmatch(sa):
        return None
    return ns


def impersonated(headers: Sequence[tuple[str, str]]) -> Identity | None:
    """The identity the apiserver's impersonation filter makes of these headers, or None when there is none."""
    user: str | None = None
    groups: list[str] = []
    for k, v in headers:
        if not k.startswith("impersonate-"):
            continue
        if k == "impersonate-user":
            if user is None:
                user = v
        elif k == "impersonate-group":
            groups.append(v)
    if not user:
        return None  # no user: no impersonation, or one the filter refuses with a 400
    ns = _service_account(user)
    if ns is not None and not groups:
        groups = [SA_ALL_GROUP, SA_NS_GROUP_PREFIX + ns]
    if user != ANONYMOUS:
        if AUTHENTICATED not in groups and UNAUTHENTICATED not in groups:
            groups.append(AUTHENTICATED)
    elif UNAUTHENTICATED not in groups:
        groups.append(UNAUTHENTICATED)
    return Identity(name=user, groups=groups)
