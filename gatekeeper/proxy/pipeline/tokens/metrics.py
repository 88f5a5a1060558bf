"""Prometheus counters of token identity; the names and labels are in docs/flowcontrol/tokens.md."""

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
