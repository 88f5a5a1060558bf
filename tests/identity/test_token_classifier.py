"""Caches and decisions between an Authorization header and the identity flow control uses."""

from __future__ import annotations

import time

import pytest
import token_kit as kit

from gatekeeper.proxy.identity.tokens.classify import UNVERIFIED, TokenClassifier, bearer_token, unverified_flow
from gatekeeper.proxy.identity.tokens.jwt import ServiceAccountVerifier
from gatekeeper.proxy.identity.tokens.review import Budget, parse_review, review_request

RSA = kit.rsa_key()
NOW = time.time()


def classifier(**kw: object) -> TokenClassifier:
    v = ServiceAccountVerifier()
    v.set_keys(kit.ISSUER, kit.jwks(RSA))
    return TokenClassifier(v, **kw)  # type: ignore[arg-type]


def test_bearer_parsing_follows_the_apiserver() -> None:
    """What kube-apiserver v1.37.2 authenticated for each spelling (SelfSubjectReview, checked on the sandbox;
    tests/flowcontrol/test_sandbox_tokens.py repeats the double-space case end to end)."""
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("  bearer abc \t") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer") is None
    assert bearer_token("Bearer ") is None
    # the token is the second space-separated part: an empty one (two spaces) is no token at all ...
    assert bearer_token("bearer   abc ") is None
    assert bearer_token("Bearer  abc") is None
    # ... and anything after the token is ignored upstream
    assert bearer_token("Bearer a b") == "a"
    # a tab is not the separator, and only ASCII white space is trimmed (Go's TrimSpace)
    assert bearer_token("Bearer\tabc") is None
    assert bearer_token("Bearer abc\x1f") == "abc\x1f"
    assert bearer_token("Bearer abc\xa0") == "abc\xa0"


def test_unverified_flows_key_on_the_source_address_not_the_port() -> None:
    assert unverified_flow("10.1.2.3:5555") == unverified_flow("10.1.2.3:6666") == "unverified@10.1.2.3"
    assert unverified_flow("[::1]:443") == "unverified@::1"


def test_verified_token_is_cached_until_it_expires() -> None:
    c = classifier()
    auth = "Bearer " + kit.sign(kit.sa_claims(now=NOW, ttl=600), RSA)
    assert c.cached(auth, NOW) is None
    d = c.decide(auth, NOW)
    assert (d.step, d.outcome, d.identity.name) == ("done", "verified", "system:serviceaccount:team-a:builder")
    hit = c.cached(auth, NOW + 1)
    assert hit is not None and hit.verified
    assert c.cached(auth, NOW + 600 + 61) is None  # gone with the token (plus leeway)


def test_a_connection_memo_skips_rehashing_its_token_but_never_answers_for_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gatekeeper.proxy.identity.tokens import classify

    hashed: list[str] = []
    real = classify.digest
    monkeypatch.setattr(classify, "digest", lambda token: hashed.append(token) or real(token))
    c = classifier()
    good = "Bearer " + kit.sign(kit.sa_claims(now=NOW, ttl=600), RSA)
    other = "Bearer " + kit.sign(kit.sa_claims("team-b", "x", now=NOW, ttl=600), RSA)
    c.decide(good, NOW)
    memo: dict[str, object] = {}
    hashed.clear()
    for _ in range(3):
        hit = c.cached(good, NOW + 1, memo)
        assert hit is not None and hit.name == "system:serviceaccount:team-a:builder"
    assert len(hashed) == 1  # hashed once for the connection, not per request
    assert c.cached(other, NOW + 1, memo) is None  # another token on the same connection: its own (no) verdict
    hit = c.cached(good, NOW + 1, memo)
    assert hit is not None and hit.name == "system:serviceaccount:team-a:builder"
    assert c.cached(good, NOW + 600 + 61, memo) is None  # the memo never outlives the verdict


def test_failed_tokens_are_cached_apart_so_a_flood_cannot_evict_good_ones() -> None:
    c = classifier(cache_entries=4, failed_entries=16)
    good = "Bearer " + kit.sign(kit.sa_claims(now=NOW), RSA)
    c.decide(good, NOW)
    for i in range(500):
        assert c.decide(f"Bearer made-up-{i}", NOW).identity is UNVERIFIED
    assert len(c.failed) == 16
    hit = c.cached(good, NOW)
    assert hit is not None and hit.verified
    assert c.cached("Bearer made-up-499", NOW) is UNVERIFIED


def test_no_keys_yet_asks_for_a_refresh_and_caches_nothing() -> None:
    c = TokenClassifier(ServiceAccountVerifier())
    auth = "Bearer " + kit.sign(kit.sa_claims(now=NOW), RSA)
    assert c.decide(auth, NOW).step == "refresh"
    assert c.cached(auth, NOW) is None


def test_other_tokens_go_to_review_only_when_enabled() -> None:
    dex = "Bearer " + kit.sign(kit.sa_claims(now=NOW, iss="https://dex.example"), RSA)
    assert classifier(review=True).decide(dex, NOW).step == "review"
    off = classifier()
    assert off.decide(dex, NOW).outcome == "issuer"
    assert off.cached(dex, NOW) is UNVERIFIED


def test_token_review_shapes() -> None:
    assert b'"token":"t"' in review_request("t") and b"audiences" not in review_request("t")
    who = parse_review({"status": {"authenticated": True, "user": {
        "username": "alice@example.com", "uid": "1", "groups": ["dev", 3], "extra": {"k": ["v"]}}}})
    assert who is not None and (who.name, who.groups, who.extra) == ("alice@example.com", ["dev"], {"k": ["v"]})
    assert parse_review({"status": {"authenticated": False, "error": "nope"}}) is None
    assert parse_review({"status": {"authenticated": True, "user": ["x"]}}) is None
    odd = parse_review({"status": {"authenticated": True, "user": {"username": "u", "groups": "abc", "extra": 1}}})
    assert odd is not None and (odd.groups, odd.extra) == ([], {})


def test_review_budget_is_a_per_second_token_bucket() -> None:
    b = Budget(rate=2, burst=2)
    assert [b.take(0.0) for _ in range(3)] == [True, True, False]
    assert b.take(0.49) is False and b.take(0.51) is True


def test_with_serviceaccount_verification_off_tokens_go_to_review_or_fail() -> None:
    auth = "Bearer " + kit.sign(kit.sa_claims(now=NOW), RSA)
    assert classifier(review=True, service_accounts=False).decide(auth, NOW).step == "review"
    off = classifier(service_accounts=False)
    assert off.decide(auth, NOW).outcome == "no-verifier" and off.cached(auth, NOW) is UNVERIFIED


async def test_an_unexpected_failure_while_classifying_means_unverified_not_an_error(monkeypatch) -> None:
    from gatekeeper.proxy.identity.tokens.fetch import TokenIdentities
    from gatekeeper.proxy.identity.tokens.settings import TokenSettings

    ti = TokenIdentities(TokenSettings())

    def boom(*_a: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(ti.classifier, "decide", boom)
    assert await ti.resolve("Bearer x") is UNVERIFIED
