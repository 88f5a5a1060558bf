"""The asyncio edge of token identity: issuer keys and TokenReviews through the proxy's own upstream clients.

Key fetches for an unknown key id are rate-limited (``jwksMinRefreshSeconds``), so made-up kids cost one fetch per
period; a failed fetch keeps the previous keys. RBAC and schedule: docs/flowcontrol/tokens.md."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from prometheus_client import Counter, Histogram

from gatekeeper.proxy.identity.tokens.classify import UNVERIFIED, TokenClassifier, TokenDecision, bearer_token, digest
from gatekeeper.proxy.identity.tokens.jwt import Identity, ServiceAccountVerifier
from gatekeeper.proxy.identity.tokens.review import TOKEN_REVIEW_PATH, Budget, parse_review, review_request
from gatekeeper.proxy.identity.tokens.settings import TokenSettings
from gatekeeper.proxy.tally import CounterTally  # before the metrics: its flush collects first

log = logging.getLogger("gatekeeper.proxy.identity.tokens")

DISCOVERY_PATH = "/.well-known/openid-configuration"
JWKS_PATH = "/openid/v1/jwks"
MAX_DOCUMENT_BYTES = 1 << 20

# Names and labels: docs/flowcontrol/tokens.md.
TOKENS = Counter("gatekeeper_identity_tokens", "Bearer-token classifications by outcome.", ["outcome"])
JWKS_REFRESH = Counter("gatekeeper_identity_jwks_refresh", "Issuer discovery and JWKS fetches.", ["result"])
REVIEWS = Counter("gatekeeper_identity_token_reviews", "TokenReviews sent to the apiservers.", ["result"])
VERIFY_SECONDS = Histogram(
    "gatekeeper_identity_verify_seconds",
    "Local ServiceAccount token verification time (cache misses).",
    buckets=(25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 5e-3),
)


class Upstream(Protocol):
    """What the edge needs of ``gatekeeper.proxy.upstream.client.BackendClient``."""

    name: str

    @property
    def ssl_identity(self) -> Any: ...

    async def call(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes | None = None, *,
                   deadline: float, max_bytes: int) -> tuple[int, bytes]: ...


class FetchError(RuntimeError):
    pass


class TokenIdentities:
    """Resolve a token caller's identity for flow control; see the module docstring."""

    def __init__(self, settings: TokenSettings, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.clock = clock
        self.verifier = ServiceAccountVerifier(audiences=tuple(settings.audiences))
        self.classifier = TokenClassifier(
            self.verifier,
            cache_entries=settings.cache_entries,
            failed_entries=settings.failed_cache_entries,
            failed_seconds=settings.failed_cache_seconds,
            review=settings.token_review,
            service_accounts=settings.service_accounts,
        )
        self.budget = Budget(settings.reviews_per_second, max(1.0, settings.reviews_per_second))
        self.upstreams: list[Upstream] = []
        self._refresh: asyncio.Task[bool] | None = None
        self._last_refresh = float("-inf")
        self._loop_task: asyncio.Task[None] | None = None
        self._reviews: dict[bytes, asyncio.Future[Identity]] = {}
        self._counts = {k: CounterTally(TOKENS.labels(k)) for k in ("cached", "failed-cached", "not-bearer")}
        """Counted on every token request, so through tallies (``gatekeeper.proxy.tally``)."""

    # -- wiring -------------------------------------------------------------------------------
    def use_upstream(self, upstreams: Sequence[Upstream]) -> None:
        self.upstreams = list(upstreams)

    async def start(self) -> None:
        if self.settings.service_accounts and self.upstreams and self._loop_task is None:
            await self.refresh(force=True)
            self._loop_task = asyncio.get_running_loop().create_task(self._refresh_loop(), name="gatekeeper-jwks")

    async def close(self) -> None:
        for task in (self._loop_task, self._refresh):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._loop_task = self._refresh = None

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.jwks_refresh_seconds)
            await self.refresh(force=True)

    # -- resolution ---------------------------------------------------------------------------
    def cached(self, authorization: str, memo: dict[str, Any] | None = None) -> Identity | None:
        """The warm path, synchronous: a cached verdict or None (then await :meth:`resolve`)."""
        hit = self.classifier.cached(authorization, self.clock(), memo)
        if hit is not None:
            if hit.verified:
                self._counts["cached"].inc()
            else:  # no token at all, or one whose failure is cached: parsed again only on this path
                self._counts["not-bearer" if bearer_token(authorization) is None else "failed-cached"].inc()
        return hit

    def refused_upstream(self, authorization: str) -> None:
        """The apiserver answered 401 to a token we verified: remember it as failed.

        Local verification cannot see revocation or a deleted bound object; such a token otherwise kept its
        ServiceAccount's flow until it expired (up to a year) while every request was refused."""
        token = bearer_token(authorization)
        if token is None:
            return
        key = digest(token)
        now = self.clock()
        self.classifier.verified.discard(key)
        self.classifier.fail(key, "refused-upstream", now)
        TOKENS.labels("refused-upstream").inc()

    async def resolve(self, authorization: str) -> Identity:
        """The cold path: verify, refresh keys, or review. Never raises (a failure means unverified)."""
        try:
            return await self._resolve(authorization)
        except Exception:  # a bug here must not fail the request: it only classifies it
            log.exception("classifying a token caller failed; treating the caller as unverified")
            TOKENS.labels("error").inc()
            return UNVERIFIED

    async def _resolve(self, authorization: str) -> Identity:
        d = self._decide(authorization)
        if d.step == "refresh" and self.settings.service_accounts and self.upstreams and await self.refresh():
            d = self._decide(authorization)
        if d.step == "review":
            return await self._review(d)
        if d.step != "done":  # keys could not be (re)fetched: do not cache the failure
            TOKENS.labels(d.outcome).inc()
        return d.identity

    def _decide(self, authorization: str) -> TokenDecision:
        t0 = time.perf_counter()
        d = self.classifier.decide(authorization, self.clock())
        if d.outcome == "verified":
            VERIFY_SECONDS.observe(time.perf_counter() - t0)
        if d.step == "done":
            TOKENS.labels(d.outcome).inc()
        return d

    # -- JWKS ---------------------------------------------------------------------------------
    async def refresh(self, force: bool = False) -> bool:
        """Fetch discovery + JWKS (single flight); False if skipped by the rate limit or failed."""
        if self._refresh is not None and not self._refresh.done():
            return await asyncio.shield(self._refresh)
        now = time.monotonic()
        if not force and now - self._last_refresh < self.settings.jwks_min_refresh_seconds:
            JWKS_REFRESH.labels("skipped").inc()
            return False
        self._last_refresh = now
        self._refresh = asyncio.get_running_loop().create_task(self._fetch_keys())
        return await asyncio.shield(self._refresh)

    async def _fetch_keys(self) -> bool:
        try:
            discovery = await self._call("GET", DISCOVERY_PATH)
            issuer = discovery.get("issuer") if isinstance(discovery, dict) else None
            if not isinstance(issuer, str) or not issuer:
                raise FetchError(f"{DISCOVERY_PATH} has no issuer")
            jwks = await self._call("GET", JWKS_PATH)
            if self.verifier.set_keys(issuer, jwks):
                self.classifier.verified.clear()
                self.classifier.failed.clear()
        except (FetchError, ValueError) as exc:
            JWKS_REFRESH.labels("error").inc()
            log.warning("service-account keys not refreshed (keeping %d keys): %s", len(self.verifier.keys), exc)
            return False
        JWKS_REFRESH.labels("ok").inc()
        return True

    # -- TokenReview --------------------------------------------------------------------------
    async def _review(self, d: TokenDecision) -> Identity:
        pending = self._reviews.get(d.key)
        if pending is not None:
            TOKENS.labels("review-joined").inc()  # every classification path is counted
            return await asyncio.shield(pending)
        if not self.budget.take(time.monotonic()):
            TOKENS.labels("budget").inc()
            return UNVERIFIED
        fut: asyncio.Future[Identity] = asyncio.get_running_loop().create_future()
        self._reviews[d.key] = fut
        try:
            identity = await self._send_review(d)
            fut.set_result(identity)
            return identity
        except BaseException as exc:
            fut.set_result(UNVERIFIED)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return UNVERIFIED
        finally:
            del self._reviews[d.key]

    async def _send_review(self, d: TokenDecision) -> Identity:
        now = self.clock()
        try:
            doc = await self._call("POST", TOKEN_REVIEW_PATH, review_request(d.token, self.settings.audiences))
            identity = parse_review(doc)
        except (FetchError, ValueError) as exc:
            REVIEWS.labels("error").inc()
            TOKENS.labels("review-error").inc()
            log.warning("TokenReview failed: %s", exc)
            return UNVERIFIED
        if identity is None:
            REVIEWS.labels("unauthenticated").inc()
            TOKENS.labels("review-unauthenticated").inc()
            self.classifier.fail(d.key, "review-unauthenticated", now, self.settings.review_failed_cache_seconds)
            return UNVERIFIED
        REVIEWS.labels("authenticated").inc()
        TOKENS.labels("reviewed").inc()
        self.classifier.verified.put(d.key, identity, now + self.settings.review_cache_seconds, now)
        return identity

    # -- HTTP ---------------------------------------------------------------------------------
    async def _call(self, method: str, path: str, body: bytes | None = None) -> Any:
        """One JSON call, tried on each backend in turn until one answers 2xx."""
        if not self.upstreams:
            raise FetchError("no upstream apiservers configured")
        errors: list[str] = []
        for up in self.upstreams:
            headers = [("accept", "application/jwk-set+json" if path == JWKS_PATH else "application/json")]
            if body is not None:
                headers.append(("content-type", "application/json"))
            if up.ssl_identity is not None:  # the proxy asserts its own identity with the front-proxy certificate
                headers += [("x-remote-user", self.settings.proxy_user),
                            *(("x-remote-group", g) for g in self.settings.proxy_groups)]
            try:
                status, data = await up.call(method, path, headers, body, deadline=self.settings.fetch_timeout_seconds,
                                             max_bytes=MAX_DOCUMENT_BYTES)
                if not 200 <= status < 300:
                    errors.append(f"{up.name}: {method} {path}: HTTP {status}: {data[:200]!r}")
                    continue
                return json.loads(data)
            except (TimeoutError, OSError, ValueError) as exc:  # JSON and UTF-8 errors are ValueErrors too
                errors.append(f"{up.name}: {method} {path}: {type(exc).__name__}: {exc}")
        raise FetchError("; ".join(errors))
