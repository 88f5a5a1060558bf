"""Sign ServiceAccount-shaped JWTs the way kube-apiserver does, for tests (RS256/ES256, real keys)."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

ISSUER = "https://kubernetes.default.svc.cluster.local"

PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _int(n: int, size: int | None = None) -> str:
    return b64(n.to_bytes(size or (n.bit_length() + 7) // 8, "big"))


def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())



def kid_of(public_key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey) -> str:
    """The key id kube-apiserver publishes: base64url(sha256(DER SubjectPublicKeyInfo)), unpadded."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.urlsafe_b64encode(hashlib.sha256(der).digest()).rstrip(b"=").decode()


def jwk(key: PrivateKey, kid: str | None = None) -> dict[str, Any]:
    pub = key.public_key()
    kid = kid if kid is not None else kid_of(pub)
    if isinstance(pub, rsa.RSAPublicKey):
        nums = pub.public_numbers()
        return {"use": "sig", "kty": "RSA", "kid": kid, "alg": "RS256", "n": _int(nums.n), "e": _int(nums.e)}
    enums = pub.public_numbers()
    return {"use": "sig", "kty": "EC", "kid": kid, "alg": "ES256", "crv": "P-256",
            "x": _int(enums.x, 32), "y": _int(enums.y, 32)}


def jwks(*keys: PrivateKey) -> dict[str, Any]:
    return {"keys": [jwk(k) for k in keys]}


def sign(claims: dict[str, Any], key: PrivateKey, *, alg: str | None = None, kid: str | None = "",
         header: dict[str, Any] | None = None) -> str:
    if alg is None:
        alg = "RS256" if isinstance(key, rsa.RSAPrivateKey) else "ES256"
    h: dict[str, Any] = {"alg": alg}
    if kid is not None:
        h["kid"] = kid or kid_of(key.public_key())
    h.update(header or {})
    signing_input = f"{b64(json.dumps(h).encode())}.{b64(json.dumps(claims).encode())}".encode()
    if isinstance(key, rsa.RSAPrivateKey):
        sig = key.sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
    else:
        r, s = decode_dss_signature(key.sign(signing_input, ec.ECDSA(hashes.SHA256())))
        sig = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    return f"{signing_input.decode()}.{b64(sig)}"


def sa_claims(ns: str = "team-a", name: str = "builder", *, now: float | None = None, ttl: int = 3600,
              aud: list[str] | None = None, pod: tuple[str, str] | None = None,
              node: tuple[str, str] | None = None, iss: str = ISSUER) -> dict[str, Any]:
    now = time.time() if now is None else now
    k8s: dict[str, Any] = {"namespace": ns, "serviceaccount": {"name": name, "uid": f"uid-{ns}-{name}"}}
    if pod:
        k8s["pod"] = {"name": pod[0], "uid": pod[1]}
    if node:
        k8s["node"] = {"name": node[0], "uid": node[1]}
    return {
        "aud": aud if aud is not None else [ISSUER],
        "exp": int(now) + ttl,
        "iat": int(now),
        "nbf": int(now),
        "iss": iss,
        "jti": f"jti-{ns}-{name}",
        "kubernetes.io": k8s,
        "sub": f"system:serviceaccount:{ns}:{name}",
    }
