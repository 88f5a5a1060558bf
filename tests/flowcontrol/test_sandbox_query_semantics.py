"""Query spellings the apiserver reads differently from Python's ``parse_qs``, through a real proxy.

``?watch=1;``, ``?watch=1%zz`` and ``?watch=fal%C5%BFe`` make kube-apiserver serve a full LIST (Go's
``url.ParseQuery`` drops a pair holding ';' or a bad escape; ``EqualFold`` folds U+017F to 's'). The
proxy must classify them as that LIST too: a "watch" frees its seats at the first bytes and skips the
LIST byte budget. Two FlowSchemas tell the verbs apart (watch vs list) for a tenant certificate user,
and the answer's ``x-gatekeeper-pf-flowschema`` shows which one the proxy picked; the body shows what
the apiserver executed.
"""

from __future__ import annotations

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

from gatekeeper.certs.pki import PKI
from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox

V1 = "flowcontrol.apiserver.k8s.io/v1"


def _level(name: str) -> dict[str, Any]:
    return {"apiVersion": V1, "kind": "PriorityLevelConfiguration", "metadata": {"name": name},
            "spec": {"type": "Limited", "limited": {"nominalConcurrencyShares": 5, "limitResponse": {
                "type": "Queue", "queuing": {"queues": 8, "handSize": 2, "queueLengthLimit": 50}}}}}


def _schema(name: str, precedence: int, verb: str, group: str) -> dict[str, Any]:
    return {"apiVersion": V1, "kind": "FlowSchema", "metadata": {"name": name},
            "spec": {"matchingPrecedence": precedence, "priorityLevelConfiguration": {"name": name},
                     "distinguisherMethod": {"type": "ByUser"},
                     "rules": [{"subjects": [{"kind": "Group", "group": {"name": group}}],
                                "resourceRules": [{"verbs": [verb], "apiGroups": ["*"], "resources": ["*"],
                                                   "namespaces": ["*"], "clusterScope": True}]}]}}


def _get(url: str, target: str, ctx: ssl.SSLContext) -> tuple[int, dict[str, str], bytes]:
    """One GET with the target sent byte for byte (http.client does not re-encode it)."""
    u = urlsplit(url)
    conn = http.client.HTTPSConnection(u.hostname or "127.0.0.1", u.port, context=ctx, timeout=30)
    try:
        conn.request("GET", target, headers={"accept": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@pytest.fixture
def tenant(sandbox: SandboxState, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A namespace with two Secrets, a tenant user (client certificate) who may list/watch them, a policy."""
    ns = f"fc-q-{secrets.token_hex(3)}"
    group = f"{ns}:tenants"
    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        *({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": n, "namespace": ns},
           "stringData": {"k": "v"}} for n in ("s1", "s2")),
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "read", "namespace": ns},
         "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "read", "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read"},
         "subjects": [{"kind": "Group", "name": group, "apiGroup": "rbac.authorization.k8s.io"}]},
    ]
    applied = kit.kubectl(sandbox, "apply", "-f", "-", input=yaml.safe_dump_all(objs))
    assert applied.returncode == 0, applied.stderr
    issued = PKI(sandbox.certs_dir).issue_client(f"{ns}-alice", user=f"{ns}-alice", groups=[group])
    ctx = ssl.create_default_context(cafile=str(SandboxPKI(Path(sandbox.certs_dir)).ca))
    ctx.load_cert_chain(issued.cert, issued.key)
    policy = [_level(f"{ns}-watches"), _level(f"{ns}-lists"), _level("catch-all"),
              _schema(f"{ns}-watches", 100, "watch", group), _schema(f"{ns}-lists", 200, "list", group)]
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump_all(policy))
    try:
        yield ns, ctx, policy_file
    finally:
        kit.kubectl(sandbox, "delete", "namespace", ns, "--wait=false")


def test_query_spellings_the_apiserver_serves_as_a_list_are_classified_as_a_list(
    sandbox: SandboxState, tmp_path: Path, tenant: tuple[str, ssl.SSLContext, Path]
) -> None:
    ns, ctx, policy_file = tenant
    base = f"/api/v1/namespaces/{ns}/secrets"
    fc = {"files": [str(policy_file)], "serverConcurrencyLimit": 20}
    with kit.run_proxy(sandbox, tmp_path / "proxy", fc) as proxy:
        # RBAC informers take a moment to see the new binding
        for _ in range(100):
            status, _, body = _get(proxy.url, base, ctx)
            if status != 403:
                break
            time.sleep(0.1)
        assert status == 200, body[:300]
        # the control: a real watch (ended by the apiserver after 1 s) is the watch schema's
        status, headers, body = _get(proxy.url, f"{base}?watch=1&timeoutSeconds=1", ctx)
        assert status == 200 and headers["x-gatekeeper-pf-flowschema"] == f"{ns}-watches", body[:300]
        for query in ("watch=1;", "watch=1%zz", "watch=fal%C5%BFe", "watch=1;&timeoutSeconds=1"):
            status, headers, body = _get(proxy.url, f"{base}?{query}", ctx)
            doc = json.loads(body)
            # what the apiserver executed: a LIST of every Secret in the namespace ...
            assert status == 200 and doc["kind"] == "SecretList", (query, body[:300])
            assert {i["metadata"]["name"] for i in doc["items"]} == {"s1", "s2"}
            # ... and what the proxy classified it as
            assert headers["x-gatekeeper-pf-flowschema"] == f"{ns}-lists", query
        # a fieldSelector the apiserver drops lists the whole collection, not one object
        status, _, body = _get(proxy.url, f"{base}?fieldSelector=metadata.name%3Ds1;", ctx)
        assert status == 200 and {i["metadata"]["name"] for i in json.loads(body)["items"]} == {"s1", "s2"}
