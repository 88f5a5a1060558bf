"""Typed ``proxy.flowControl.tokens`` section: how flow control learns who a token caller is."""

from __future__ import annotations

from dataclasses import dataclass, field

from gatekeeper.base.config import require


@dataclass(frozen=True)
class TokenSettings:
    """Identity of bearer-token callers, for classification and fair queuing only (tokens pass upstream untouched)."""

    service_accounts: bool = True
    """Verify ServiceAccount tokens locally with the keys the apiservers publish (/openid/v1/jwks)."""
    audiences: list[str] = field(default_factory=list)
    """Accepted token audiences (the apiservers' --api-audiences); empty = the discovered issuer."""
    jwks_refresh_seconds: float = 300.0
    """How often the issuer discovery document and the JWKS are fetched again."""
    jwks_min_refresh_seconds: float = 10.0
    """A token signed by an unknown key id triggers a refresh at most this often."""
    fetch_timeout_seconds: float = 5.0
    """Timeout of one discovery, JWKS or TokenReview call to an apiserver."""
    cache_entries: int = 10000
    """Verified tokens remembered (keyed by SHA-256 of the token, kept until the token expires)."""
    failed_cache_entries: int = 10000
    """Tokens that failed verification remembered, in a separate cache (a flood cannot evict good entries)."""
    failed_cache_seconds: float = 60.0
    """How long a failed token is remembered as failed."""
    token_review: bool = False
    """Send other bearer tokens (OIDC, webhook, legacy) to the apiservers as TokenReviews."""
    reviews_per_second: float = 20.0
    """Most TokenReviews sent per second (bursts up to the same number); beyond it tokens count as unverified."""
    review_cache_seconds: float = 120.0
    """How long an authenticated TokenReview result is reused."""
    review_failed_cache_seconds: float = 30.0
    """How long a not-authenticated TokenReview result is reused."""
    proxy_user: str = "system:gatekeeper-proxy"
    """User the proxy asserts (front-proxy certificate) for its own discovery, JWKS and TokenReview calls."""
    proxy_groups: list[str] = field(default_factory=lambda: ["system:authenticated"])
    """Groups asserted with ``proxyUser``."""

    def validate(self) -> None:
        require(self, "tokens.", at_least_one=("cache_entries", "failed_cache_entries"), positive=(
            "jwks_refresh_seconds", "jwks_min_refresh_seconds", "fetch_timeout_seconds", "failed_cache_seconds",
            "reviews_per_second", "review_cache_seconds", "review_failed_cache_seconds"))
