"""ServiceAccount token verification as kube-apiserver does it (``pkg/serviceaccount``), without I/O.

The checks are listed in docs/flowcontrol/tokens.md. Never ``none`` or HMAC. Not checked: that the bound object still
exists; the identity only classifies, and the apiserver still authenticates the untouched token."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from gatekeeper.proxy.identity.auth import AUTHENTICATED_GROUP

SA_USER_PREFIX = "system:serviceaccount:"
SA_ALL_GROUP = "system:serviceaccounts"
SA_NS_GROUP_PREFIX = "system:serviceaccounts:"
EXTRA_POD_NAME = "authentication.kubernetes.io/pod-name"
EXTRA_POD_UID = "authentication.kubernetes.io/pod-uid"
EXTRA_NODE_NAME = "authentication.kubernetes.io/node-name"
EXTRA_NODE_UID = "authentication.kubernetes.io/node-uid"
EXTRA_CREDENTIAL_ID = "authentication.kubernetes.io/credential-id"
LEGACY_ISSUER = "kubernetes/serviceaccount"
DEFAULT_LEEWAY = 60.0
MAX_TOKEN_BYTES = 16 << 10
"""Longer bearer values are not parsed (a real ServiceAccount token is about 1 KiB)."""

_HASHES: dict[str, type[hashes.HashAlgorithm]] = {"256": hashes.SHA256, "384": hashes.SHA384, "512": hashes.SHA512}
_EC_CURVES: dict[str, type[ec.EllipticCurve]] = {"P-256": ec.SECP256R1, "P-384": ec.SECP384R1, "P-521": ec.SECP521R1}


class TokenError(ValueError):
    """The token is not a valid ServiceAccount token of this cluster; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class UnknownKey(TokenError):
    """Signed by a key id the current JWKS does not hold: the keys may have rotated (refresh, retry once)."""

    def __init__(self, kid: str) -> None:
        super().__init__("unknown-kid", kid)


class NotServiceAccount(TokenError):
    """Well formed, but not ours to verify (another issuer, or a legacy token): a job for TokenReview."""


@dataclass(frozen=True)
class Identity:
    """The identity flow control classifies a request as; never sent upstream."""

    name: str
    groups: list[str] = field(default_factory=list)
    extra: dict[str, list[str]] = field(default_factory=dict)
    uid: str = ""
    verified: bool = True
    """False for the shared stand-in of a caller whose token could not be verified."""


def b64url_decode(part: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
    except (binascii.Error, ValueError) as exc:
        raise TokenError("malformed", "bad base64url") from exc


def _b64_int(value: Any) -> int:
    if not isinstance(value, str):
        raise ValueError("expected a base64url string")
    return int.from_bytes(b64url_decode(value), "big")


PublicKey = rsa.RSAPublicKey | ec.EllipticCurvePublicKey


def parse_jwks(doc: Any) -> dict[str, PublicKey]:
    """Public signing keys of a JWKS document by kid (keys without one get a synthetic kid); unusable keys are
    skipped rather than failing the set, as go-jose does."""
    keys: dict[str, PublicKey] = {}
    items = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise ValueError("JWKS document has no 'keys' list")
    for i, jwk in enumerate(items):
        if not isinstance(jwk, dict) or jwk.get("use", "sig") != "sig":
            continue
        try:
            key: PublicKey
            if jwk.get("kty") == "RSA":
                key = rsa.RSAPublicNumbers(_b64_int(jwk.get("e")), _b64_int(jwk.get("n"))).public_key()
            elif jwk.get("kty") == "EC" and jwk.get("crv") in _EC_CURVES:
                x, y = _b64_int(jwk.get("x")), _b64_int(jwk.get("y"))
                key = ec.EllipticCurvePublicNumbers(x, y, _EC_CURVES[jwk["crv"]]()).public_key()
            else:
                continue
        except (ValueError, TokenError):
            continue
        kid = jwk.get("kid")
        keys[kid if isinstance(kid, str) and kid else f"#{i}"] = key
    return keys


def _check_signature(alg: str, key: PublicKey, signing_input: bytes, sig: bytes) -> bool:
    family, bits = alg[:2], alg[2:]
    algo = _HASHES[bits]()
    try:
        if family in ("RS", "PS") and isinstance(key, rsa.RSAPublicKey):
            pad: padding.AsymmetricPadding = (
                padding.PKCS1v15() if family == "RS"
                else padding.PSS(mgf=padding.MGF1(_HASHES[bits]()), salt_length=padding.PSS.DIGEST_LENGTH)
            )
            key.verify(sig, signing_input, pad, algo)
            return True
        if family == "ES" and isinstance(key, ec.EllipticCurvePublicKey):
            size = (key.curve.key_size + 7) // 8
            if len(sig) != 2 * size:
                return False
            r, s = int.from_bytes(sig[:size], "big"), int.from_bytes(sig[size:], "big")
            key.verify(encode_dss_signature(r, s), signing_input, ec.ECDSA(algo))
            return True
    except InvalidSignature:
        return False
    return False


ALGORITHMS = frozenset(f"{f}{b}" for f in ("RS", "PS", "ES") for b in _HASHES)


@dataclass(frozen=True)
class Verified:
    identity: Identity
    expires: float
    """Unix time the token stops being valid (``exp``): cached results go with it."""


def _audiences(claims: Mapping[str, Any]) -> list[str]:
    aud = claims.get("aud")
    if isinstance(aud, str):
        return [aud]
    if isinstance(aud, list) and all(isinstance(a, str) for a in aud):
        return list(aud)
    return []


def _ref(obj: Any, key: str) -> tuple[str, str] | None:
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, dict):
        return None
    name, uid = value.get("name"), value.get("uid")
    return (name if isinstance(name, str) else "", uid if isinstance(uid, str) else "")


def service_account_identity(claims: Mapping[str, Any]) -> Identity:
    """The user kube-apiserver makes of a bound token's claims (``ServiceAccountInfo.UserInfo``)."""
    k8s = claims.get("kubernetes.io")
    if not isinstance(k8s, dict):
        raise TokenError("claims", "no kubernetes.io claims")
    ns = k8s.get("namespace")
    sa = _ref(k8s, "serviceaccount")
    if not isinstance(ns, str) or not ns or sa is None or not sa[0]:
        raise TokenError("claims", "namespace or serviceaccount name missing")
    name = f"{SA_USER_PREFIX}{ns}:{sa[0]}"
    if claims.get("sub") != name:
        raise TokenError("claims", "sub does not name the serviceaccount in kubernetes.io")
    extra: dict[str, list[str]] = {}
    pod = _ref(k8s, "pod")
    if pod is not None and pod[0]:
        extra[EXTRA_POD_NAME], extra[EXTRA_POD_UID] = [pod[0]], [pod[1]]
    node = _ref(k8s, "node")
    if node is not None and node[0]:
        extra[EXTRA_NODE_NAME], extra[EXTRA_NODE_UID] = [node[0]], [node[1]]
    jti = claims.get("jti")
    if isinstance(jti, str) and jti:
        extra[EXTRA_CREDENTIAL_ID] = [f"JTI={jti}"]
    return Identity(
        name=name,
        groups=[SA_ALL_GROUP, SA_NS_GROUP_PREFIX + ns, AUTHENTICATED_GROUP],
        extra=extra,
        uid=sa[1],
    )


@dataclass
class ServiceAccountVerifier:
    """The issuer's keys and audiences, and :meth:`verify`; updated by the fetch edge."""

    issuer: str = ""
    keys: dict[str, PublicKey] = field(default_factory=dict)
    audiences: Sequence[str] = ()
    """Accepted audiences; empty means the issuer alone (kube-apiserver's default --api-audiences)."""
    leeway: float = DEFAULT_LEEWAY

    @property
    def ready(self) -> bool:
        return bool(self.issuer and self.keys)

    def set_keys(self, issuer: str, jwks: Any) -> bool:
        """Install a new key set; returns whether the issuer changed (cached verdicts are then stale)."""
        keys = parse_jwks(jwks)
        if not keys:
            raise ValueError("JWKS document holds no usable signing key")
        changed = issuer != self.issuer
        self.issuer, self.keys = issuer, keys
        return changed

    def verify(self, token: str, now: float) -> Verified:
        """Verify a compact JWS; raises TokenError (or its UnknownKey / NotServiceAccount kinds)."""
        if len(token) > MAX_TOKEN_BYTES:
            raise TokenError("malformed", "too long")
        parts = token.split(".")
        if len(parts) != 3:
            raise TokenError("malformed", "not a compact JWS")
        try:
            header = json.loads(b64url_decode(parts[0]))
            claims = json.loads(b64url_decode(parts[1]))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TokenError("malformed", "header or payload is not JSON") from exc
        except RecursionError:  # ``[[[[...`` 1000 deep fits in a token: json raises this, not JSONDecodeError
            raise TokenError("malformed", "header or payload is nested too deeply") from None
        if not isinstance(header, dict) or not isinstance(claims, dict):
            raise TokenError("malformed", "header or payload is not an object")
        iss = claims.get("iss")
        if iss == LEGACY_ISSUER:
            raise NotServiceAccount("legacy", "secret-based token (needs a Secret lookup)")
        if not self.issuer or iss != self.issuer:
            raise NotServiceAccount("issuer", "not this cluster's service-account issuer")
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in ALGORITHMS:
            raise TokenError("algorithm", f"alg {str(alg)[:16]!r} is not accepted")
        kid = header.get("kid")
        if isinstance(kid, str) and kid:
            key = self.keys.get(kid)
            if key is None:
                raise UnknownKey(kid[:64])
            candidates = [key]
        else:
            candidates = list(self.keys.values())
        signing_input = f"{parts[0]}.{parts[1]}".encode("ascii", "replace")
        sig = b64url_decode(parts[2])
        if not any(_check_signature(alg, k, signing_input, sig) for k in candidates):
            raise TokenError("signature")
        exp, nbf = claims.get("exp"), claims.get("nbf")
        if not isinstance(exp, (int, float)) or isinstance(exp, bool):
            raise TokenError("claims", "no exp")  # upstream's bound tokens always carry one
        if now > exp + self.leeway:
            raise TokenError("expired")
        if isinstance(nbf, (int, float)) and now + self.leeway < nbf:
            raise TokenError("not-yet-valid")
        accepted = self.audiences or [self.issuer]
        if not set(_audiences(claims)) & set(accepted):
            raise TokenError("audience")
        return Verified(service_account_identity(claims), float(exp) + self.leeway)
