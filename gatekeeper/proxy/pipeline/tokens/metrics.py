"""Prometheus counters of token identity (what it costs and what it rejects).

``gatekeeper_identity_tokens_total{outcome}``
    Token classifications: cached, verified, reviewed, reviewed-cached, failed-cached, and every
    reason a token ended up unverified (malformed, signature, expired, audience, issuer,
    unknown-kid, not-bearer, budget, review-error, no-keys...), review-joined (waited for the same
    token's review in flight), and refused-upstream (a token verified here that the apiserver answered
    401: revoked or its bound object deleted; remembered as failed).
``gatekeeper_identity_jwks_refresh_total{result}``
    Discovery + JWKS fetches: ok, error, skipped (an unknown kid within jwksMinRefreshSeconds).
``gatekeeper_identity_token_reviews_total{result}``
    TokenReviews sent: authenticated, unauthenticated, error.
``gatekeeper_identity_verify_seconds``
    Cold-path cost of one local verification (parse + signature + claims).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from gatekeeper.proxy import tally  # noqa: F401  (before the metrics: its flush collects first)

TOKENS = Counter("gatekeeper_identity_tokens", "Bearer-token classifications by outcome.", ["outcome"])
JWKS_REFRESH = Counter("gatekeeper_identity_jwks_refresh", "Issuer discovery and JWKS fetches.", ["result"])
REVIEWS = Counter("gatekeeper_identity_token_reviews", "TokenReviews sent to the apiservers.", ["result"])
VERIFY_SECONDS = Histogram(
    "gatekeeper_identity_verify_seconds",
    "Local ServiceAccount token verification time (cache misses).",
    buckets=(25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 5e-3),
)
