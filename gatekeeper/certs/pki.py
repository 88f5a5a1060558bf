"""Certificate authority and leaf certificates for the control plane and gatekeeper.

Two CAs, because Kubernetes keeps them apart on purpose: the *cluster* CA signs
serving certificates and ordinary client certificates (``--client-ca-file``),
while the *front-proxy* CA signs only the certificate a front proxy uses to
stamp ``X-Remote-User`` (``--requestheader-client-ca-file``). A client cert from
the cluster CA must never be able to assert identities through headers.

Everything is written with ``cryptography``; keys are ECDSA P-256 by default
and are created with mode 0600 before any key byte is written.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CLUSTER_CA = "ca"
FRONT_PROXY_CA = "front-proxy-ca"
SERVICE_ACCOUNT_KEY = "sa"

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


@dataclass(frozen=True)
class Issued:
    """Paths of a certificate and its key on disk."""

    cert: Path
    key: Path


def _key_usage(*, ca: bool, key_encipherment: bool) -> x509.KeyUsage:
    """Digital signature always; certificate and CRL signing for a CA; key encipherment for RSA leaves
    (TLS key exchange with an RSA key encrypts to it; ECDSA keys only sign)."""
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=key_encipherment,
        data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
        encipher_only=False, decipher_only=False,
    )

def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_key(algorithm: str = "ecdsa") -> PrivateKey:
    if algorithm == "ecdsa":
        return ec.generate_private_key(ec.SECP256R1())
    if algorithm == "rsa":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    raise ValueError(f"unknown key algorithm {algorithm!r}; expected 'ecdsa' or 'rsa'")


def _write_private(path: Path, data: bytes) -> None:
    """Create with 0600 first so the key is never world-readable, even briefly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, 0o600)


def write_key(path: Path, key: PrivateKey) -> None:
    _write_private(
        path,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def write_cert(path: Path, cert: x509.Certificate) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


def load_key(path: Path) -> PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        raise ValueError(f"{path}: unsupported key type {type(key).__name__}")
    return key


def _name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def make_ca(common_name: str, days: int = 3650, algorithm: str = "ecdsa") -> tuple[x509.Certificate, PrivateKey]:
    key = new_key(algorithm)
    name = _name(common_name)
    now = _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True, key_encipherment=False), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$", re.IGNORECASE)


def _check_dns_name(name: str) -> None:
    """RFC 1123 host name, optionally ``*.`` wildcard: clients reject anything else at handshake time."""
    labels = name[2:].split(".") if name.startswith("*.") else name.split(".")
    if len(name) > 253 or not all(_DNS_LABEL.match(label) for label in labels):
        raise ValueError(f"--dns {name!r} is not a DNS name (letters, digits and '-' in dot-separated "
                         "labels, optionally starting with '*.')")


def _parse_sans(dns: Iterable[str], ips: Iterable[str]) -> list[x509.GeneralName]:
    sans: list[x509.GeneralName] = []
    for d in dns:
        _check_dns_name(d)
        sans.append(x509.DNSName(d))
    for ip in ips:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(ip)))
        except ValueError:
            raise ValueError(f"--ip {ip!r} is not an IP address") from None
    return sans


def make_leaf(
    ca_cert: x509.Certificate,
    ca_key: PrivateKey,
    *,
    common_name: str,
    organizations: Sequence[str] = (),
    dns: Sequence[str] = (),
    ips: Sequence[str] = (),
    server: bool = False,
    client: bool = False,
    days: int = 365,
    algorithm: str = "ecdsa",
) -> tuple[x509.Certificate, PrivateKey]:
    if not (server or client):
        raise ValueError("a leaf certificate must be for server use, client use, or both")
    sans = _parse_sans(dns, ips)  # first: a bad --dns/--ip is the user's error, reported as such
    key = new_key(algorithm)
    now = _now()
    usages = []
    if server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    is_rsa = isinstance(key, rsa.RSAPrivateKey)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False, key_encipherment=is_rsa), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    elif server:
        raise ValueError("a serving certificate needs at least one --dns or --ip")
    return builder.sign(ca_key, hashes.SHA256()), key


class PKI:
    """A directory of CAs and issued certificates, laid out as ``NAME.crt`` / ``NAME.key``."""

    def __init__(self, directory: Path | str) -> None:
        self.dir = Path(directory)

    def cert_path(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key_path(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    def init(self, *, force: bool = False, algorithm: str = "ecdsa") -> list[Path]:
        """Create the cluster CA, the front-proxy CA and the service-account key pair.

        Existing material is kept unless ``force``: regenerating a CA silently
        would invalidate every certificate already handed out.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        made: list[Path] = []
        for name, cn in ((CLUSTER_CA, "gatekeeper-cluster-ca"), (FRONT_PROXY_CA, "gatekeeper-front-proxy-ca")):
            if force or not self.cert_path(name).exists():
                cert, key = make_ca(cn, algorithm=algorithm)
                write_key(self.key_path(name), key)
                write_cert(self.cert_path(name), cert)
                made += [self.cert_path(name), self.key_path(name)]
        sa_key, sa_pub = self.dir / f"{SERVICE_ACCOUNT_KEY}.key", self.dir / f"{SERVICE_ACCOUNT_KEY}.pub"
        if force or not sa_key.exists():
            # kube-apiserver signs service-account tokens with RS256 by default.
            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            _write_private(
                sa_key,
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                    serialization.NoEncryption(),
                ),
            )
            sa_pub.write_bytes(
                key.public_key().public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
                )
            )
            made += [sa_key, sa_pub]
        return made

    def _ca(self, ca: str) -> tuple[x509.Certificate, PrivateKey]:
        cert_path = self.cert_path(ca)
        if not cert_path.exists():
            raise FileNotFoundError(f"{cert_path} does not exist; run `gatekeeper certs init --dir {self.dir}` first")
        return load_cert(cert_path), load_key(self.key_path(ca))

    def issue_serving(
        self, name: str, *, dns: Sequence[str] = (), ips: Sequence[str] = (), ca: str = CLUSTER_CA,
        days: int = 365, algorithm: str = "ecdsa",
    ) -> Issued:
        ca_cert, ca_key = self._ca(ca)
        cn = dns[0] if dns else (ips[0] if ips else name)
        if len(cn) > 64:  # X.520 caps a CN at 64 characters; clients match SANs, the CN is a label
            cn = name[:64]
        cert, key = make_leaf(ca_cert, ca_key, common_name=cn, dns=dns, ips=ips, server=True,
                              days=days, algorithm=algorithm)
        return self._store(name, cert, key)

    def issue_client(
        self, name: str, *, user: str, groups: Sequence[str] = (), ca: str = CLUSTER_CA,
        days: int = 365, algorithm: str = "ecdsa",
    ) -> Issued:
        ca_cert, ca_key = self._ca(ca)
        cert, key = make_leaf(ca_cert, ca_key, common_name=user, organizations=groups, client=True,
                              days=days, algorithm=algorithm)
        return self._store(name, cert, key)

    def _store(self, name: str, cert: x509.Certificate, key: PrivateKey) -> Issued:
        write_key(self.key_path(name), key)
        write_cert(self.cert_path(name), cert)
        return Issued(self.cert_path(name), self.key_path(name))

    def ca_bundle(self, ca: str = CLUSTER_CA) -> str:
        """base64 of the CA PEM, the form ``clientConfig.caBundle`` and kubeconfigs take."""
        path = self.cert_path(ca)
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist; run `gatekeeper certs init --dir {self.dir}` first")
        return base64.b64encode(path.read_bytes()).decode()

    def check(self, warn_days: int = 30) -> list[CertStatus]:
        out = []
        for path in sorted(self.dir.glob("*.crt")):
            try:
                cert = load_cert(path)
            except ValueError as exc:
                out.append(CertStatus(path, "?", None, None, f"unreadable: {exc}"))
                continue
            left = cert.not_valid_after_utc - _now()
            days = left.days
            state = "EXPIRED" if left.total_seconds() <= 0 else ("expiring" if days < warn_days else "ok")
            out.append(CertStatus(path, cert.subject.rfc4514_string(), cert.not_valid_after_utc, days, state))
        return out


@dataclass(frozen=True)
class CertStatus:
    """Expiry report for one certificate file."""

    path: Path
    subject: str
    not_after: dt.datetime | None
    days_left: int | None
    state: str
