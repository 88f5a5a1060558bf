"""An anonymous LIST must never be answered from another caller's coalesced upstream call (real apiservers).

kube-apiserver authenticates a request that asks for a WebSocket upgrade by the bearer token in its
``Sec-WebSocket-Protocol`` (``base64url.bearer.authorization.k8s.io.<token>``) and answers a LIST with a
plain 200 list. Through the proxy such a request carries no ``Authorization`` header, so it looked
anonymous; an anonymous LIST of the same path queued next to it got the same coalescing key and was
served the ServiceAccount's Secrets. Here a silent watch holds the only seat of the level for
``watchInitSeconds`` while the two LISTs queue; when it lets go, both are dispatched.
"""

from __future__ import annotations

import base64
import concurrent.futures
import http.client
import json
import secrets
import ssl
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import storm_kit as kit
import yaml

from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox

V1 = "flowcontrol.apiserver.k8s.io/v1"


def _request(url: str, target: str, headers: dict[str, str], ca: Path) -> tuple[int, bytes]:
    u = urlsplit(url)
    ctx = ssl.create_default_context(cafile=str(ca))
    conn = http.client.HTTPSConnection(u.hostname or "127.0.0.1", u.port, context=ctx, timeout=60)
    try:
        conn.request("GET", target, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _policy() -> list[dict[str, Any]]:
    def level(name: str) -> dict[str, Any]:
        return {"apiVersion": V1, "kind": "PriorityLevelConfiguration", "metadata": {"name": name},
                "spec": {"type": "Limited", "limited": {"nominalConcurrencyShares": 1, "limitResponse": {
                    "type": "Queue", "queuing": {"queues": 4, "handSize": 1, "queueLengthLimit": 50}}}}}

    everyone = {"apiVersion": V1, "kind": "FlowSchema", "metadata": {"name": "one-seat"},
                "spec": {"matchingPrecedence": 100, "priorityLevelConfiguration": {"name": "one-seat"},
                         "distinguisherMethod": {"type": "ByUser"},
                         "rules": [{"subjects": [{"kind": "Group", "group": {"name": "*"}}],
                                    "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                                       "namespaces": ["*"], "clusterScope": True}]}]}}
    return [level("one-seat"), level("catch-all"), everyone]


def test_an_anonymous_list_is_not_served_a_websocket_callers_secrets(sandbox: SandboxState, tmp_path: Path) -> None:
    ns = f"fc-ws-{secrets.token_hex(3)}"
    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "bob", "namespace": ns}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "bobs-secret", "namespace": ns},
         "stringData": {"k": "v"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "read", "namespace": ns},
         "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "read", "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read"},
         "subjects": [{"kind": "ServiceAccount", "name": "bob", "namespace": ns}]},
    ]
    applied = kit.kubectl(sandbox, "apply", "-f", "-", input=yaml.safe_dump_all(objs))
    assert applied.returncode == 0, applied.stderr
    try:
        out = kit.kubectl(sandbox, "create", "token", "bob", "-n", ns, "--duration=1h")
        assert out.returncode == 0, out.stderr
        token = out.stdout.strip()
        ca = SandboxPKI(Path(sandbox.certs_dir)).ca
        policy_file = tmp_path / "policy.yaml"
        policy_file.write_text(yaml.safe_dump_all(_policy()))
        path = f"/api/v1/namespaces/{ns}/secrets"
        bearer = {"authorization": f"Bearer {token}", "accept": "application/json"}
        proto = base64.urlsafe_b64encode(token.encode()).decode().rstrip("=")
        websocket = {"accept": "application/json", "connection": "Upgrade", "upgrade": "websocket",
                     "sec-websocket-version": "13", "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
                     "sec-websocket-protocol": f"base64url.bearer.authorization.k8s.io.{proto}, v4.channel.k8s.io"}
        fc = {"files": [str(policy_file)], "serverConcurrencyLimit": 2, "watchInitSeconds": 4,
              "queueWaitSeconds": 30}
        with kit.run_proxy(sandbox, tmp_path / "proxy", fc) as proxy, \
                concurrent.futures.ThreadPoolExecutor(4) as pool:
            for _ in range(100):  # RBAC informers pick the new binding up within moments
                status, body = _request(proxy.url, path, bearer, ca)
                if status != 403:
                    break
                time.sleep(0.1)
            assert status == 200, body[:300]
            rv = json.loads(body)["metadata"]["resourceVersion"]
            # a watch from "now" that sees no event: it holds the one seat for watchInitSeconds
            blocker = pool.submit(_request, proxy.url, f"{path}?watch=1&resourceVersion={rv}&timeoutSeconds=6",
                                  bearer, ca)
            time.sleep(1.0)
            victim = pool.submit(_request, proxy.url, path, websocket, ca)
            time.sleep(0.3)
            attacker = pool.submit(_request, proxy.url, path, {"accept": "application/json"}, ca)
            v_status, v_body = victim.result(60)
            a_status, a_body = attacker.result(60)
            blocker.result(60)
        # the apiserver answers the WebSocket LIST as bob (what makes the merge a leak) ...
        assert v_status == 200 and b"bobs-secret" in v_body, v_body[:300]
        # ... and the anonymous caller gets its own answer: 403, not bob's Secrets
        assert b"bobs-secret" not in a_body, "an anonymous LIST was served bob's Secrets"
        assert a_status == 403 and b"system:anonymous" in a_body, a_body[:300]
    finally:
        kit.kubectl(sandbox, "delete", "namespace", ns, "--wait=false")
