"""Identity attacks: trimming stamped headers with ``Connection``, smuggling names through certificates."""

from __future__ import annotations

import pytest
from edge_kit import bench, body_json, make_pki, status_of

from gatekeeper.certs.pki import PKI
from gatekeeper.proxy.identity import auth


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    pki.issue_client("cr-group", user="mallory", groups=["system:mas\rters"])
    pki.issue_client("nl-user", user="system:ad\nmin")
    pki.issue_client("space-user", user="admin ")
    pki.issue_client("lead-space-group", user="eve", groups=[" system:masters"])
    pki.issue_client("tab-group", user="eve", groups=["system:masters\t"])
    return pki


def stamped(raw: bytes) -> list[tuple[str, str]]:
    return [(k, v) for k, v in body_json(raw)["headers"] if k.startswith("x-remote-")]


async def test_connection_header_cannot_strip_stamped_identity(pki: PKI) -> None:
    async with bench(pki) as b:
        raw = await b.raw(b"GET /api/v1/pods HTTP/1.1\r\nhost: x\r\n"
                          b"connection: close, x-remote-group, x-remote-user, x-forwarded-for\r\n"
                          b"x-remote-group: spoofed\r\n\r\n")
        assert status_of(raw) == 200, raw[:300]
        assert stamped(raw) == [("x-remote-user", "admin"), ("x-remote-group", "system:masters")]
        headers = dict(body_json(raw)["headers"])
        assert headers.get("x-forwarded-for") == "127.0.0.1"


async def test_connection_named_client_header_is_dropped(pki: PKI) -> None:
    async with bench(pki) as b:
        raw = await b.raw(b"GET /api/v1/pods HTTP/1.1\r\nhost: x\r\nconnection: close, x-private\r\n"
                          b"x-private: secret\r\nx-kept: yes\r\n\r\n")
        names = [k for k, _ in body_json(raw)["headers"]]
        assert "x-private" not in names and "x-kept" in names and "connection" not in names


@pytest.mark.parametrize("cert", ["cr-group", "nl-user", "space-user", "lead-space-group", "tab-group"])
async def test_certificate_names_with_control_characters_or_edge_spaces_get_401(pki: PKI, cert: str) -> None:
    async with bench(pki) as b:
        raw = await b.raw(b"GET /api/v1/pods HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", cert=cert)
        assert status_of(raw) == 401, raw[:300]
        status = body_json(raw)
        assert (status["kind"], status["reason"]) == ("Status", "Unauthorized")
        assert b.backend.paths() == [], "a refused identity still reached the backend"


def test_clean_names_pass_the_check() -> None:
    cert = {"subject": ((("commonName", "system:node:gpu-1"),), (("organizationName", "system:nodes"),))}
    assert auth.bad_certificate_names(cert) == ""
    assert "whitespace" in auth.bad_certificate_names({"subject": ((("commonName", "a "),),)})
    assert "U+200B" in auth.bad_certificate_names({"subject": ((("commonName", "adm\u200bin"),),)})


def test_upgrade_survives_connection_header_cleanup() -> None:
    headers = [("connection", "Upgrade, x-remote-user"), ("upgrade", "websocket"), ("x-remote-user", "x")]
    assert auth.drop_connection_named(headers) == [("upgrade", "websocket"), ("connection", "upgrade")]
