"""The proxy benchmark's Caddy reference proxies the sandbox's apiservers as the other two proxies do.

Its figures are only a reference if it does the same job: TLS and HTTP/2 to the client, a token that reaches the
apiserver, and ``X-Remote-*`` headers from the client stripped (Caddy presents the front-proxy certificate, so the
apiserver would believe them). The binary is built from gomod/caddy on first use (minutes, then cached).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gatekeeper.sandbox.state import SandboxState
from loadtest.bench.caddy import start_caddy

pytestmark = pytest.mark.sandbox
REVIEW = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}


@pytest.fixture(scope="module")
def caddy(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        url, _pid = start_caddy(Path(sandbox.certs_dir), tmp_path_factory.mktemp("caddy"), sandbox.apiserver_urls,
                                1, "caddy-test", started)
        yield url
    finally:
        for proc in started:
            proc.terminate()
            proc.wait(20)


def who(url: str, ca: Path, headers: dict[str, str]) -> tuple[str, str]:
    """(HTTP version, the username the apiserver saw) for a SelfSubjectReview sent through ``url``."""
    with httpx.Client(http2=True, verify=str(ca), timeout=30) as c:
        r = c.post(f"{url}/apis/authentication.k8s.io/v1/selfsubjectreviews", json=REVIEW, headers=headers)
    assert r.status_code == 201, r.text
    return r.http_version, r.json()["status"]["userInfo"]["username"]


def test_caddy_carries_a_token_to_the_apiservers_over_http2(caddy: str, sandbox: SandboxState, kubectl,
                                                               namespace: str) -> None:
    token = kubectl("create", "token", "default", "-n", namespace, check=True).stdout.strip()
    version, user = who(caddy, Path(sandbox.certs_dir) / "ca.crt", {"authorization": f"Bearer {token}"})
    assert version == "HTTP/2"
    assert user == f"system:serviceaccount:{namespace}:default"


def test_caddy_strips_remote_user_headers_a_client_sends(caddy: str, sandbox: SandboxState, kubectl,
                                                         namespace: str) -> None:
    token = kubectl("create", "token", "default", "-n", namespace, check=True).stdout.strip()
    forged = {"authorization": f"Bearer {token}", "X-Remote-User": "system:admin", "X-Remote-Group": "system:masters"}
    _, user = who(caddy, Path(sandbox.certs_dir) / "ca.crt", forged)
    assert user == f"system:serviceaccount:{namespace}:default"
