"""Local ServiceAccount token verification: signature, issuer, audience, time, and the apiserver's claim mapping."""

from __future__ import annotations

import time

import pytest
import token_kit as kit

from gatekeeper.proxy.identity.tokens.jwt import (
    NotServiceAccount,
    ServiceAccountVerifier,
    TokenError,
    UnknownKey,
    parse_jwks,
)

RSA = kit.rsa_key()
EC = kit.ec_key()
NOW = time.time()


def verifier(*keys: kit.PrivateKey, audiences: tuple[str, ...] = ()) -> ServiceAccountVerifier:
    v = ServiceAccountVerifier(audiences=audiences)
    v.set_keys(kit.ISSUER, kit.jwks(*(keys or (RSA, EC))))
    return v


def reason(v: ServiceAccountVerifier, token: str, now: float = NOW) -> str:
    with pytest.raises(TokenError) as err:
        v.verify(token, now)
    return err.value.reason


def test_rs256_pod_bound_token_maps_to_the_apiservers_user() -> None:
    claims = kit.sa_claims("team-a", "builder", now=NOW, pod=("web-0", "pod-uid"), node=("node-1", "node-uid"))
    got = verifier().verify(kit.sign(claims, RSA), NOW)
    who = got.identity
    assert who.name == "system:serviceaccount:team-a:builder"
    assert who.groups == ["system:serviceaccounts", "system:serviceaccounts:team-a", "system:authenticated"]
    assert who.uid == "uid-team-a-builder"
    assert who.extra == {
        "authentication.kubernetes.io/pod-name": ["web-0"],
        "authentication.kubernetes.io/pod-uid": ["pod-uid"],
        "authentication.kubernetes.io/node-name": ["node-1"],
        "authentication.kubernetes.io/node-uid": ["node-uid"],
        "authentication.kubernetes.io/credential-id": ["JTI=jti-team-a-builder"],
    }
    assert got.expires == claims["exp"] + 60


def test_es256_token_verifies() -> None:
    assert verifier().verify(kit.sign(kit.sa_claims(now=NOW), EC), NOW).identity.verified


def test_token_without_kid_is_tried_against_every_key() -> None:
    assert verifier().verify(kit.sign(kit.sa_claims(now=NOW), EC, kid=None), NOW).identity.name.endswith(":builder")


def test_signature_by_another_key_with_a_known_kid_fails() -> None:
    forged = kit.sign(kit.sa_claims(now=NOW), kit.rsa_key(), kid=kit.jwk(RSA)["kid"])
    assert reason(verifier(), forged) == "signature"


def test_tampered_payload_fails_signature() -> None:
    good = kit.sign(kit.sa_claims(now=NOW), RSA)
    h, _, s = good.split(".")
    other = kit.sign(kit.sa_claims("kube-system", "admin", now=NOW), RSA).split(".")[1]
    assert reason(verifier(), f"{h}.{other}.{s}") == "signature"


def test_unknown_kid_asks_for_a_key_refresh() -> None:
    with pytest.raises(UnknownKey):
        verifier(RSA).verify(kit.sign(kit.sa_claims(now=NOW), kit.rsa_key()), NOW)


@pytest.mark.parametrize("alg", ["none", "HS256", "RS1"])
def test_unaccepted_algorithms_fail(alg: str) -> None:
    tok = kit.sign(kit.sa_claims(now=NOW), RSA, header={"alg": alg})
    assert reason(verifier(), tok) == "algorithm"


def test_expiry_and_not_before_allow_upstreams_60s_leeway() -> None:
    v = verifier()
    tok = kit.sign(kit.sa_claims(now=NOW - 3600, ttl=3600), RSA)
    assert v.verify(tok, NOW + 59).identity.verified
    assert reason(v, tok, NOW + 61) == "expired"
    future = kit.sign(kit.sa_claims(now=NOW + 120), RSA)
    assert reason(v, future) == "not-yet-valid"


def test_audience_must_intersect_the_accepted_ones() -> None:
    tok = kit.sign(kit.sa_claims(now=NOW, aud=["vault"]), RSA)
    assert reason(verifier(), tok) == "audience"
    assert verifier(RSA, audiences=("vault", "api")).verify(tok, NOW).identity.verified


def test_other_issuers_and_legacy_tokens_are_not_ours() -> None:
    other = kit.sign(kit.sa_claims(now=NOW, iss="https://dex.example"), RSA)
    legacy = kit.sign({**kit.sa_claims(now=NOW), "iss": "kubernetes/serviceaccount"}, RSA)
    for tok in (other, legacy):
        with pytest.raises(NotServiceAccount):
            verifier().verify(tok, NOW)


def test_sub_must_name_the_serviceaccount_of_the_private_claims() -> None:
    claims = {**kit.sa_claims(now=NOW), "sub": "system:serviceaccount:kube-system:admin"}
    assert reason(verifier(), kit.sign(claims, RSA)) == "claims"


@pytest.mark.parametrize("token", ["", "a.b", "a.b.c", "!!!.???.***", "x" * 20000, "e30.e30.e30"])
def test_garbage_is_malformed_not_a_crash(token: str) -> None:
    assert reason(verifier(), token) in {"malformed", "issuer"}


@pytest.mark.parametrize("part", [0, 1])
def test_json_nested_too_deeply_is_malformed_not_a_crash(part: int) -> None:
    """3000 levels fit in 8 KB of token (the cap is 16 KiB); json raised RecursionError, which escaped
    classification: the stream was reset INTERNAL_ERROR and logged at WARNING, at every request."""
    parts = [kit.b64(b"{}"), kit.b64(b"{}"), kit.b64(b"sig")]
    parts[part] = kit.b64(b"[" * 3000 + b"]" * 3000)
    assert reason(verifier(), ".".join(parts)) == "malformed"


def test_jwks_skips_unusable_keys_and_keeps_the_rest() -> None:
    doc = {"keys": [{"kty": "oct", "k": "x"}, {"kty": "RSA", "n": 5}, {**kit.jwk(RSA), "use": "enc"}, kit.jwk(EC)]}
    assert list(parse_jwks(doc)) == [kit.jwk(EC)["kid"]]
    with pytest.raises(ValueError):
        ServiceAccountVerifier().set_keys(kit.ISSUER, {"keys": []})


@pytest.mark.parametrize(
    ("header", "claims"),
    [
        ({"alg": ["RS256"]}, {}),
        ({"alg": "RS256", "kid": {"x": 1}}, {}),
        ({"alg": {"a": 1}, "kid": 5}, {"exp": "soon", "aud": {"x": 1}, "nbf": [1]}),
        ({"alg": "RS256"}, {"exp": True, "kubernetes.io": "ns", "sub": 3}),
        ([], []),
        ("x", 7),
    ],
)
def test_hostile_json_shapes_fail_as_token_errors_never_crash(header: object, claims: object) -> None:
    import json

    def part(x: object) -> str:
        return kit.b64(json.dumps(x).encode())

    full = {**kit.sa_claims(now=NOW), **claims} if isinstance(claims, dict) else claims
    token = f"{part(header)}.{part(full)}.{kit.b64(b'sig')}"
    assert reason(verifier(), token) in {"malformed", "algorithm", "signature", "unknown-kid", "claims"}
