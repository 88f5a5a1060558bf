"""From an ``Authorization`` header to the identity flow control uses (pure, time passed in).

The decision order is in docs/flowcontrol/tokens.md. An unverified caller's flow is its source address, so inventing
tokens buys no extra queues; it is never exempt. Verdicts are cached by the token's SHA-256 digest, verified and failed
tokens in separate caches: eviction is by insertion order, so a flood of new keys only pushes out its own kind."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from gatekeeper.proxy.identity.tokens.jwt import (
    Identity,
    NotServiceAccount,
    ServiceAccountVerifier,
    TokenError,
    UnknownKey,
)

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

    def discard(self, key: bytes) -> None:
        self._items.pop(key, None)

    def clear(self) -> None:
        self._items.clear()


UNVERIFIED = Identity(name="system:anonymous", groups=["system:unauthenticated"], verified=False)
"""Stand-in identity of a token caller the proxy could not verify."""

Step = Literal["done", "refresh", "review"]


_GO_SPACE = " \t\n\v\f\r"
"""ASCII white space, which Go's ``strings.TrimSpace`` trims (Python's ``strip()`` also trims \\x1c-\\x1f, NBSP...)."""


def bearer_token(authorization: str) -> str | None:
    """The token the apiserver's bearer authenticator reads from ``authorization``, or None.

    As ``request/bearertoken``: the token is the second of at most three space-split parts, so ``Bearer <token>`` (two
    spaces) carries none; reading it as the token classified an anonymous request as the token's ServiceAccount."""
    parts = authorization.strip(_GO_SPACE).split(" ", 2)
    if len(parts) < 2 or parts[0].lower() != "bearer":
        return None
    return parts[1] or None


def source_host(peer: str) -> str:
    """The address part of ``host:port`` / ``[v6]:port`` (flows of unverified callers key on it)."""
    if peer.startswith("[") and "]" in peer:
        return peer[1 : peer.index("]")]
    if peer.count(":") == 1:
        return peer.split(":", 1)[0]
    return peer


def unverified_flow(peer: str) -> str:
    return "unverified@" + source_host(peer)


@dataclass(frozen=True)
class TokenDecision:
    """What :meth:`TokenClassifier.decide` concluded, and what the edge should do next."""

    step: Step
    identity: Identity
    """The identity to use now (``UNVERIFIED`` until a pending step says otherwise)."""
    outcome: str
    """Metric label: cached, verified, reviewed-cached, failed-cached, not-bearer, or a TokenError reason."""
    token: str = ""
    key: bytes = b""


class TokenClassifier:
    """The verifier plus the caches; the edge owns key fetching and TokenReview calls."""

    def __init__(
        self,
        verifier: ServiceAccountVerifier,
        *,
        cache_entries: int = 10000,
        failed_entries: int = 10000,
        failed_seconds: float = 60.0,
        review: bool = False,
        service_accounts: bool = True,
    ) -> None:
        self.verifier = verifier
        self.service_accounts = service_accounts
        self.verified: ExpiringCache[Identity] = ExpiringCache(cache_entries)
        self.failed: ExpiringCache[str] = ExpiringCache(failed_entries)
        self.failed_seconds = failed_seconds
        self.review = review

    def cached(self, authorization: str, now: float, memo: dict[str, Any] | None = None) -> Identity | None:
        """The warm path: the identity if this token's verdict is cached, else None (``memo``: the connection's)."""
        token = bearer_token(authorization)
        if token is None:
            return UNVERIFIED
        last = memo.get("token_digest") if memo is not None else None
        if last is not None and last[0] == token:
            key = last[1]
        else:
            key = digest(token)
            if memo is not None:
                memo["token_digest"] = (token, key)
        hit = self.verified.get(key, now)
        if hit is not None:
            return hit
        return UNVERIFIED if self.failed.get(key, now) is not None else None

    def decide(self, authorization: str, now: float) -> TokenDecision:
        token = bearer_token(authorization)
        if token is None:
            return TokenDecision("done", UNVERIFIED, "not-bearer")
        key = digest(token)
        hit = self.verified.get(key, now)
        if hit is not None:
            return TokenDecision("done", hit, "cached")
        if self.failed.get(key, now) is not None:
            return TokenDecision("done", UNVERIFIED, "failed-cached")
        if not self.service_accounts or not self.verifier.ready:
            if self.review:
                return TokenDecision("review", UNVERIFIED, "review", token, key)
            if self.service_accounts:  # no keys yet: nothing is cached as failed before the first JWKS
                return TokenDecision("refresh", UNVERIFIED, "no-keys", token, key)
            self.fail(key, "no-verifier", now)
            return TokenDecision("done", UNVERIFIED, "no-verifier")
        try:
            v = self.verifier.verify(token, now)
        except UnknownKey:
            return TokenDecision("refresh", UNVERIFIED, "unknown-kid", token, key)
        except NotServiceAccount as exc:
            if self.review:
                return TokenDecision("review", UNVERIFIED, exc.reason, token, key)
            self.fail(key, exc.reason, now)
            return TokenDecision("done", UNVERIFIED, exc.reason)
        except TokenError as exc:
            self.fail(key, exc.reason, now)
            return TokenDecision("done", UNVERIFIED, exc.reason)
        self.verified.put(key, v.identity, v.expires, now)
        return TokenDecision("done", v.identity, "verified")

    def fail(self, key: bytes, reason: str, now: float, seconds: float | None = None) -> None:
        self.failed.put(key, reason, now + (self.failed_seconds if seconds is None else seconds), now)
