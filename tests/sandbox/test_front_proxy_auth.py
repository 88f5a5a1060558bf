"""Only a front-proxy-CA client certificate named front-proxy-client may assert X-Remote-User."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest

from gatekeeper.certs.pki import FRONT_PROXY_CA, PKI
from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox

REVIEW = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
HEADERS = {"X-Remote-User": "alice", "X-Remote-Group": "team-a", "X-Remote-Extra-Reason": "test"}


def whoami(state: SandboxState, cert: Path, key: Path, headers: dict[str, str]) -> httpx.Response:
    ctx = ssl.create_default_context(cafile=str(Path(state.certs_dir) / "ca.crt"))
    ctx.load_cert_chain(str(cert), str(key))
    with httpx.Client(verify=ctx, timeout=30) as client:
        return client.post(f"{state.apiserver_urls[0]}/apis/authentication.k8s.io/v1/selfsubjectreviews",
                           json=REVIEW, headers=headers)


def user_info(resp: httpx.Response) -> dict[str, object]:
    assert resp.status_code == 201, resp.text
    info: dict[str, object] = resp.json()["status"]["userInfo"]
    return info


def test_front_proxy_client_cert_stamps_the_user_from_headers(sandbox: SandboxState) -> None:
    fp = sandbox.extra["front_proxy_client"]
    info = user_info(whoami(sandbox, Path(fp["cert"]), Path(fp["key"]), HEADERS))
    assert info["username"] == "alice"
    assert "team-a" in info["groups"]  # type: ignore[operator]
    assert info.get("extra") == {"reason": ["test"]}


def test_cluster_ca_client_cert_cannot_assert_identities_by_header(sandbox: SandboxState) -> None:
    certs = Path(sandbox.certs_dir)
    info = user_info(whoami(sandbox, certs / "admin.crt", certs / "admin.key", HEADERS))
    assert info["username"] == "sandbox-admin"
    assert "team-a" not in info["groups"]  # type: ignore[operator]


def test_front_proxy_ca_cert_with_another_name_is_not_honoured(sandbox: SandboxState, tmp_path: Path) -> None:
    # Signed by the right CA but not in --requestheader-allowed-names: the header must not count.
    pki = PKI(tmp_path)
    for suffix in (".crt", ".key"):
        (tmp_path / f"{FRONT_PROXY_CA}{suffix}").write_bytes(
            (Path(sandbox.certs_dir) / f"{FRONT_PROXY_CA}{suffix}").read_bytes())
    issued = pki.issue_client("impostor", user="not-the-front-proxy", ca=FRONT_PROXY_CA)
    resp = whoami(sandbox, issued.cert, issued.key, HEADERS)
    if resp.status_code == 201:
        assert resp.json()["status"]["userInfo"]["username"] != "alice"
    else:
        assert resp.status_code in (401, 403), resp.text
