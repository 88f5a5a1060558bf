"""The proxy that `gatekeeper sandbox up --with-proxy` starts can see who a ServiceAccount token caller is.

The add-on applies the proxy identity's RBAC (package data ``proxy/identity/rbac.yaml``, the same file
as ``deploy/examples/proxy-identity-rbac.yaml``) before the proxy starts; without it the issuer's keys
cannot be fetched and every token caller is classified as unverified.
"""

from __future__ import annotations

import re
import ssl
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

from gatekeeper.sandbox import kubectl
from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.with_proxy import IDENTITY_RBAC

REPO = Path(__file__).resolve().parents[2]


def test_the_packaged_identity_rbac_is_the_deploy_example() -> None:
    assert IDENTITY_RBAC.read_bytes() == (REPO / "deploy" / "examples" / "proxy-identity-rbac.yaml").read_bytes()


def _tokens(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as m:
        text = m.read().decode()
    return {o: float(v) for o, v in re.findall(r'^gatekeeper_identity_tokens_total\{outcome="([^"]+)"\} (\S+)$',
                                                text, re.M)}


@pytest.mark.sandbox
def test_sandbox_proxy_verifies_a_real_service_account_token(sandbox: SandboxState, namespace: str) -> None:
    if "proxy" not in sandbox.extra:
        pytest.fail("the session sandbox runs without the proxy add-on (GATEKEEPER_SANDBOX_ADDONS?)", pytrace=False)
    token = kubectl.run(sandbox.kubeconfig, "-n", namespace, "create", "token", "default", check=True).stdout.strip()
    metrics_url = sandbox.extra["proxy"]["metricsUrl"]
    before = _tokens(metrics_url)
    ctx = ssl.create_default_context(cafile=str(SandboxPKI(Path(sandbox.certs_dir)).ca))
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=sandbox.extra["proxy"]["url"], verify=ctx, timeout=30,
                      headers={"Authorization": f"Bearer {token}"}) as c:
        while True:
            r = c.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default")
            # the token went upstream untouched: the apiserver authenticated it (403 = known SA without RBAC)
            assert r.status_code in (200, 403), r.text
            assert "system:anonymous" not in r.text
            after = _tokens(metrics_url)
            verified = after.get("verified", 0) - before.get("verified", 0)
            if verified >= 1 or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert verified >= 1, f"token outcomes before {before}, after {after}"
