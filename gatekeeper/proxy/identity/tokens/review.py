"""TokenReview shapes and the per-second review budget (pure).

Tokens the proxy cannot verify (OIDC, webhook, legacy secret-based) may be reviewed, one apiserver round trip per
distinct token per cache lifetime, at most ``reviewsPerSecond``; beyond it a token counts as failed."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gatekeeper.kube.objects import TokenReview, TokenReviewSpec
from gatekeeper.proxy.identity.tokens.jwt import Identity

TOKEN_REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"


def review_request(token: str, audiences: Sequence[str] = ()) -> bytes:
    spec: TokenReviewSpec = {"token": token}
    if audiences:
        spec["audiences"] = list(audiences)
    review: TokenReview = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec}
    return json.dumps(review, separators=(",", ":")).encode()


def parse_review(doc: Any) -> Identity | None:
    """The reviewed identity, or None if not authenticated; ValueError for a response that is not a TokenReview.

    ``doc`` is read as a :class:`~gatekeeper.kube.objects.TokenReview`, every field checked: it is parsed JSON."""
    status = doc.get("status") if isinstance(doc, dict) else None
    if not isinstance(status, dict):
        raise ValueError("TokenReview response has no status")
    if status.get("authenticated") is not True:
        return None
    user = status.get("user")
    if not isinstance(user, dict):
        return None
    name = user.get("username")
    if not isinstance(name, str) or not name:
        return None
    raw_groups = user.get("groups")
    groups = [g for g in raw_groups if isinstance(g, str)] if isinstance(raw_groups, list) else []
    raw_extra = user.get("extra") or {}
    extra = {
        k: [x for x in v if isinstance(x, str)]
        for k, v in (raw_extra.items() if isinstance(raw_extra, dict) else ())
        if isinstance(k, str) and isinstance(v, list)
    }
    uid = user.get("uid")
    return Identity(name=name, groups=groups, extra=extra, uid=uid if isinstance(uid, str) else "")


@dataclass
class Budget:
    """A token bucket: ``rate`` reviews a second, bursts of up to ``burst``."""

    rate: float
    burst: float
    tokens: float = -1.0
    last: float = 0.0

    def take(self, now: float) -> bool:
        if self.tokens < 0:
            self.tokens, self.last = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False
