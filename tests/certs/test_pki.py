"""Certificates issued by gatekeeper.certs.pki: chains, usages, SANs, file modes and real TLS handshakes."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gatekeeper.certs.pki import CLUSTER_CA, FRONT_PROXY_CA, PKI, load_cert


@pytest.fixture
def pki(tmp_path: Path) -> PKI:
    p = PKI(tmp_path / "pki")
    p.init()
    return p


def test_init_creates_two_distinct_cas_and_service_account_keys(pki: PKI) -> None:
    ca, fp = load_cert(pki.cert_path(CLUSTER_CA)), load_cert(pki.cert_path(FRONT_PROXY_CA))
    assert ca.subject != fp.subject
    for cert in (ca, fp):
        assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    assert (pki.dir / "sa.key").exists() and (pki.dir / "sa.pub").exists()


def test_init_keeps_existing_cas_unless_forced(pki: PKI) -> None:
    before = pki.cert_path(CLUSTER_CA).read_bytes()
    assert pki.init() == []
    assert pki.cert_path(CLUSTER_CA).read_bytes() == before
    pki.init(force=True)
    assert pki.cert_path(CLUSTER_CA).read_bytes() != before


def test_private_keys_are_written_owner_only(pki: PKI) -> None:
    issued = pki.issue_client("alice", user="alice")
    for key in [pki.key_path(CLUSTER_CA), pki.key_path(FRONT_PROXY_CA), pki.dir / "sa.key", issued.key]:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key


def test_serving_cert_has_sans_server_usage_and_chains_to_cluster_ca(pki: PKI) -> None:
    issued = pki.issue_serving("web", dns=["localhost", "webhook.gk.svc"], ips=["127.0.0.1", "::1"])
    cert, ca = load_cert(issued.cert), load_cert(pki.cert_path(CLUSTER_CA))
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "webhook.gk.svc"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"


def test_client_cert_carries_user_and_groups_and_chains_to_chosen_ca(pki: PKI) -> None:
    issued = pki.issue_client("fp", user="front-proxy-client", groups=["a", "b"], ca=FRONT_PROXY_CA)
    cert = load_cert(issued.cert)
    cert.verify_directly_issued_by(load_cert(pki.cert_path(FRONT_PROXY_CA)))
    with pytest.raises((ValueError, InvalidSignature)):
        cert.verify_directly_issued_by(load_cert(pki.cert_path(CLUSTER_CA)))
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "front-proxy-client"
    assert [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)] == ["a", "b"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_serving_cert_without_any_name_is_refused(pki: PKI) -> None:
    with pytest.raises(ValueError, match="--dns or --ip"):
        pki.issue_serving("nameless")


def test_issue_before_init_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="gatekeeper certs init"):
        PKI(tmp_path / "empty").issue_serving("x", ips=["127.0.0.1"])


async def _handshake(pki: PKI, client_ctx: ssl.SSLContext) -> bytes:
    issued = pki.issue_serving("srv", ips=["127.0.0.1"])
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(issued.cert, issued.key)

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
        data = await reader.read()
        writer.close()
        return data
    finally:
        server.close()
        await server.wait_closed()


async def test_tls_handshake_succeeds_for_client_trusting_the_ca(pki: PKI) -> None:
    ctx = ssl.create_default_context(cafile=str(pki.cert_path(CLUSTER_CA)))
    assert await _handshake(pki, ctx) == b"hello"


async def test_tls_handshake_fails_for_client_trusting_another_ca(pki: PKI) -> None:
    ctx = ssl.create_default_context(cafile=str(pki.cert_path(FRONT_PROXY_CA)))
    with pytest.raises(ssl.SSLCertVerificationError):
        await _handshake(pki, ctx)


def test_ca_bundle_is_base64_of_the_ca_pem(pki: PKI) -> None:
    import base64

    assert base64.b64decode(pki.ca_bundle()) == pki.cert_path(CLUSTER_CA).read_bytes()


def test_check_reports_every_certificate_as_ok(pki: PKI) -> None:
    pki.issue_serving("srv", ips=["127.0.0.1"])
    rows = {r.path.name: r for r in pki.check()}
    assert set(rows) == {"ca.crt", "front-proxy-ca.crt", "srv.crt"}
    assert all(r.state == "ok" and r.days_left and r.days_left > 300 for r in rows.values())


def test_check_flags_certificates_expiring_within_warn_days(pki: PKI) -> None:
    pki.issue_serving("short", ips=["127.0.0.1"], days=5)
    rows = {r.path.name: r for r in pki.check(warn_days=30)}
    assert rows["short.crt"].state == "expiring"


@pytest.mark.parametrize("name", ["bad name", "-lead.example", "a..b", "x" * 64 + ".example", "under_score.io"])
def test_serving_cert_refuses_names_that_are_not_dns_names(pki: PKI, name: str) -> None:
    with pytest.raises(ValueError, match="is not a DNS name"):
        pki.issue_serving("bad", dns=[name])
    assert not pki.cert_path("bad").exists()


def test_serving_cert_accepts_service_and_wildcard_names(pki: PKI) -> None:
    names = ["gatekeeper-webhook.gatekeeper-system.svc", "*.apps.example.com", "localhost"]
    cert = load_cert(pki.issue_serving("ok", dns=names).cert)
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == names


def test_serving_cert_for_a_dns_name_longer_than_a_common_name_is_issued(pki: PKI) -> None:
    long_name = ".".join(["a" * 60, "b" * 60, "svc"])
    cert = load_cert(pki.issue_serving("long", dns=[long_name]).cert)
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == [long_name]
