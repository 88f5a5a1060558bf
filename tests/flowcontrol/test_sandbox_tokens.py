"""Real ServiceAccount token callers (``kubectl create token``) through a real proxy and real apiservers.

The proxy fetches the issuer's keys from the apiservers with its own identity
(``deploy/examples/proxy-identity-rbac.yaml``), verifies the tokens locally, and
classifies them with FlowSchemas that name a ServiceAccount and a
``system:serviceaccounts:<ns>`` group. The same FlowSchemas are applied to the
apiservers, whose own APF stamps ``X-Kubernetes-PF-FlowSchema-UID`` on each
response and counts ``apiserver_flowcontrol_dispatched_requests_total``: the two
must agree on which schema each caller matched.
"""

from __future__ import annotations

import asyncio
import secrets
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
import storm_kit as kit
import yaml

from gatekeeper.proxy.identity.tokens.settings import TokenSettings
from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox

RBAC = kit.REPO / "deploy" / "examples" / "proxy-identity-rbac.yaml"
V1 = "flowcontrol.apiserver.k8s.io/v1"
EVERYTHING = {"resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "namespaces": ["*"],
                                 "clusterScope": True}]}


def _level(name: str, shares: int) -> dict[str, Any]:
    return {"apiVersion": V1, "kind": "PriorityLevelConfiguration", "metadata": {"name": name},
            "spec": {"type": "Limited", "limited": {"nominalConcurrencyShares": shares, "limitResponse": {
                "type": "Queue", "queuing": {"queues": 8, "handSize": 2, "queueLengthLimit": 50}}}}}


def _schema(name: str, precedence: int, subject: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": V1, "kind": "FlowSchema", "metadata": {"name": name},
            "spec": {"matchingPrecedence": precedence, "priorityLevelConfiguration": {"name": name},
                     "distinguisherMethod": {"type": "ByUser"}, "rules": [{"subjects": [subject], **EVERYTHING}]}}


def _objects(ns: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(objects for the apiservers, the proxy's policy); the proxy's adds a big catch-all so each level gets 1 seat."""
    sa_fs, ns_fs = f"{ns}-builder", f"{ns}-group"
    policy = [
        _level(sa_fs, 1), _level(ns_fs, 1),
        _schema(sa_fs, 300, {"kind": "ServiceAccount", "serviceAccount": {"namespace": ns, "name": "builder"}}),
        _schema(ns_fs, 400, {"kind": "Group", "group": {"name": f"system:serviceaccounts:{ns}"}}),
    ]
    cluster: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}]
    for sa in ("builder", "ci"):
        cluster.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": ns}})
        cluster.append({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": f"{sa}-view", "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
        })
    return cluster + policy, [*policy, _level("catch-all", 98)]


def _dump(objs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objs, sort_keys=False)


def _token(state: SandboxState, ns: str, sa: str) -> str:
    out = kit.kubectl(state, "create", "token", sa, "-n", ns, "--duration=1h")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _uid(state: SandboxState, name: str) -> str:
    out = kit.kubectl(state, "get", "flowschema", name, "-o", "jsonpath={.metadata.uid}")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _client(state: SandboxState, url: str) -> httpx.AsyncClient:
    ctx = ssl.create_default_context(cafile=str(SandboxPKI(Path(state.certs_dir)).ca))
    return httpx.AsyncClient(base_url=url, verify=ctx, timeout=60, limits=httpx.Limits(max_connections=64))


async def _until_allowed(c: httpx.AsyncClient, path: str, token: str) -> httpx.Response:
    for _ in range(100):  # RBAC informers pick the new RoleBindings up within moments
        r = await c.get(path, headers={"authorization": f"Bearer {token}"})
        if r.status_code != 403:
            return r
        await asyncio.sleep(0.1)
    return r


def _identity_lines(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.startswith("gatekeeper_identity_"))


def _apiserver_dispatched(texts: list[str], fs: str) -> float:
    return sum(kit.metric_sum(t, "apiserver_flowcontrol_dispatched_requests_total", flow_schema=fs) for t in texts)


@pytest.fixture
def token_world(sandbox: SandboxState, tmp_path: Path):  # type: ignore[no-untyped-def]
    ns = f"fc-tok-{secrets.token_hex(3)}"
    cluster, policy = _objects(ns)
    for doc in (RBAC.read_text(), _dump(cluster)):
        applied = kit.kubectl(sandbox, "apply", "-f", "-", input=doc)
        assert applied.returncode == 0, applied.stderr
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(_dump(policy))
    try:
        yield ns, policy_file
    finally:
        kit.kubectl(sandbox, "delete", "-f", "-", "--ignore-not-found", "--wait=false", input=_dump(cluster))


def _fc(policy_file: Path, **tokens: Any) -> dict[str, Any]:
    return {"files": [str(policy_file)], "serverConcurrencyLimit": 20,
            "tokens": kit._keys(TokenSettings, jwks_min_refresh_seconds=1, **tokens)}


def test_serviceaccount_token_callers_match_their_flow_schemas_like_the_apiservers_and_are_limited(
    sandbox: SandboxState, tmp_path: Path, token_world: tuple[str, Path]
) -> None:
    ns, policy_file = token_world
    builder, ci = _token(sandbox, ns, "builder"), _token(sandbox, ns, "ci")
    expected = {builder: f"{ns}-builder", ci: f"{ns}-group"}
    uids = {fs: _uid(sandbox, fs) for fs in expected.values()}
    path = f"/api/v1/namespaces/{ns}/configmaps"

    async def scenario(url: str) -> tuple[list[httpx.Response], httpx.Response, list[str], list[str]]:
        before = await kit.apiserver_metrics(sandbox)
        async with _client(sandbox, url) as c:
            for tok in (builder, ci):
                assert (await _until_allowed(c, path, tok)).status_code == 200
            burst = await asyncio.gather(*(
                c.get(path, headers={"authorization": f"Bearer {tok}"}) for tok in (builder, ci) for _ in range(12)
            ))
            bogus = await c.get(path, headers={"authorization": "Bearer made-up"})
        return list(burst), bogus, before, await kit.apiserver_metrics(sandbox)

    with kit.run_proxy(sandbox, tmp_path / "proxy", _fc(policy_file)) as proxy:
        burst, bogus, before, after = asyncio.run(scenario(proxy.url))
        text = proxy.metrics()
    for r in burst:
        tok = r.request.headers["authorization"].split(" ", 1)[1]
        assert r.status_code == 200, r.text
        assert r.headers["x-gatekeeper-pf-flowschema"] == expected[tok], _identity_lines(text)
        # the apiserver's own APF classified the same request into the same FlowSchema
        assert r.headers["x-kubernetes-pf-flowschema-uid"] == uids[expected[tok]]
    for fs in expected.values():
        # every upstream call the proxy dispatched for this schema, the apiservers dispatched for it too
        # (identical queued LISTs of one caller are coalesced into one call, so calls <= requests)
        dispatched = kit.metric_sum(text, "gatekeeper_flowcontrol_dispatched_requests_total", flow_schema=fs)
        coalesced = kit.metric_sum(text, "gatekeeper_flowcontrol_coalesced_requests_total", flow_schema=fs)
        assert _apiserver_dispatched(after, fs) - _apiserver_dispatched(before, fs) == dispatched
        assert dispatched + coalesced >= 13
        # one seat per level (20 seats * 1 share / 100): the 12 concurrent LISTs ran one at a time
        assert kit.metric_sum(text, "gatekeeper_flowcontrol_nominal_limit_seats", priority_level=fs) == 1
        assert kit.metric_sum(text, "gatekeeper_flowcontrol_peak_executing_requests", priority_level=fs) == 1
    assert bogus.status_code == 401 and bogus.headers["x-gatekeeper-pf-flowschema"] == "catch-all"
    assert kit.metric_sum(text, "gatekeeper_identity_jwks_refresh_total", result="ok") >= 1
    assert kit.metric_sum(text, "gatekeeper_identity_tokens_total", outcome="verified") >= 2
    assert kit.metric_sum(text, "gatekeeper_identity_tokens_total", outcome="cached") >= 20


def test_token_review_identifies_tokens_the_proxy_does_not_verify_itself(
    sandbox: SandboxState, tmp_path: Path, token_world: tuple[str, Path]
) -> None:
    ns, policy_file = token_world
    builder = _token(sandbox, ns, "builder")
    path = f"/api/v1/namespaces/{ns}/configmaps"

    async def scenario(url: str) -> list[httpx.Response]:
        async with _client(sandbox, url) as c:
            first = await _until_allowed(c, path, builder)
            return [first, *[await c.get(path, headers={"authorization": f"Bearer {builder}"}) for _ in range(5)]]

    fc = _fc(policy_file, service_accounts=False, token_review=True)
    with kit.run_proxy(sandbox, tmp_path / "proxy", fc) as proxy:
        responses = asyncio.run(scenario(proxy.url))
        text = proxy.metrics()
    assert [r.status_code for r in responses] == [200] * 6
    assert {r.headers["x-gatekeeper-pf-flowschema"] for r in responses} == {f"{ns}-builder"}
    assert kit.metric_sum(text, "gatekeeper_identity_token_reviews_total", result="authenticated") >= 1
    assert kit.metric_sum(text, "gatekeeper_identity_jwks_refresh_total") == 0
    # later requests reuse the review (403s while RBAC propagated may each have cost one more)
    assert kit.metric_sum(text, "gatekeeper_identity_tokens_total", outcome="cached") >= 5


def test_a_bearer_value_the_apiserver_reads_as_no_token_is_not_classified_as_the_token(
    sandbox: SandboxState, tmp_path: Path, token_world: tuple[str, Path]
) -> None:
    """``Bearer  <token>`` (two spaces): upstream's bearer authenticator takes the empty second part, so the
    apiserver sees no token and answers as ``system:anonymous``. The proxy must not give that request the
    token's ServiceAccount schema; ``Bearer <token> extra`` is the token upstream, and here too."""
    ns, policy_file = token_world
    builder = _token(sandbox, ns, "builder")
    path = f"/api/v1/namespaces/{ns}/configmaps"

    async def scenario(url: str) -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with _client(sandbox, url) as c:
            good = await _until_allowed(c, path, builder)
            spaced = await c.get(path, headers={"authorization": f"Bearer  {builder}"})
            trailing = await c.get(path, headers={"authorization": f"Bearer {builder} extra"})
        return good, spaced, trailing

    with kit.run_proxy(sandbox, tmp_path / "proxy", _fc(policy_file)) as proxy:
        good, spaced, trailing = asyncio.run(scenario(proxy.url))
    assert good.status_code == 200 and good.headers["x-gatekeeper-pf-flowschema"] == f"{ns}-builder"
    # the apiserver: anonymous, who may not list configmaps there
    assert spaced.status_code == 403 and "system:anonymous" in spaced.text, spaced.text
    assert spaced.headers["x-gatekeeper-pf-flowschema"] == "catch-all"
    assert trailing.status_code == 200 and trailing.headers["x-gatekeeper-pf-flowschema"] == f"{ns}-builder"


def test_a_token_the_apiserver_refuses_loses_its_serviceaccount_classification(
    sandbox: SandboxState, tmp_path: Path, token_world: tuple[str, Path]
) -> None:
    """A token bound to a Secret still verifies locally (signature, expiry) after the Secret is deleted,
    but the apiserver refuses it (401). It must not keep its ServiceAccount's schema and flow."""
    ns, policy_file = token_world
    made = kit.kubectl(sandbox, "create", "secret", "generic", "binding", "-n", ns, "--from-literal=k=v")
    assert made.returncode == 0, made.stderr
    out = kit.kubectl(sandbox, "create", "token", "builder", "-n", ns, "--duration=1h",
                      "--bound-object-kind=Secret", "--bound-object-name=binding")
    assert out.returncode == 0, out.stderr
    bound = out.stdout.strip()
    path = f"/api/v1/namespaces/{ns}/configmaps"

    async def scenario(url: str) -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with _client(sandbox, url) as c:
            good = await _until_allowed(c, path, bound)
            gone = kit.kubectl(sandbox, "delete", "secret", "binding", "-n", ns)
            assert gone.returncode == 0, gone.stderr
            # Each apiserver caches a token it authenticated for 10 s before it sees the deletion, and the
            # proxy balances over all of them: wait until three answers in a row are 401s.
            answers: list[httpx.Response] = []
            for _ in range(300):
                answers.append(await c.get(path, headers={"authorization": f"Bearer {bound}"}))
                if [a.status_code for a in answers[-3:]] == [401] * 3:
                    break
                await asyncio.sleep(0.1)
            refused = next(a for a in answers if a.status_code == 401)
            after = answers[-1]
        return good, refused, after

    with kit.run_proxy(sandbox, tmp_path / "proxy", _fc(policy_file)) as proxy:
        good, refused, after = asyncio.run(scenario(proxy.url))
        text = proxy.metrics()
    assert good.status_code == 200 and good.headers["x-gatekeeper-pf-flowschema"] == f"{ns}-builder"
    # the first refusal still ran as the ServiceAccount (nothing here could know) ...
    assert refused.status_code == 401 and refused.headers["x-gatekeeper-pf-flowschema"] == f"{ns}-builder"
    # ... the later ones are an unverified caller's
    assert after.status_code == 401 and after.headers["x-gatekeeper-pf-flowschema"] == "catch-all"
    assert kit.metric_sum(text, "gatekeeper_identity_tokens_total", outcome="refused-upstream") >= 1


def test_a_websocket_callers_protocol_token_is_classified_like_the_apiserver_authenticates_it(
    sandbox: SandboxState, tmp_path: Path, token_world: tuple[str, Path]
) -> None:
    """A WebSocket request (a browser cannot set Authorization) carries its token in Sec-WebSocket-Protocol;
    kube-apiserver authenticates it from there and answers a LIST as that ServiceAccount. The proxy
    took it for anonymous: wrong schema, and one shared anonymous flow for every such caller."""
    import base64
    import http.client

    ns, policy_file = token_world
    builder = _token(sandbox, ns, "builder")
    path = f"/api/v1/namespaces/{ns}/configmaps"
    proto = base64.urlsafe_b64encode(builder.encode()).decode().rstrip("=")
    websocket = {"accept": "application/json", "connection": "Upgrade", "upgrade": "websocket",
                 "sec-websocket-version": "13", "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
                 "sec-websocket-protocol": f"base64url.bearer.authorization.k8s.io.{proto}, v4.channel.k8s.io"}

    async def ready(url: str) -> httpx.Response:
        async with _client(sandbox, url) as c:
            return await _until_allowed(c, path, builder)

    with kit.run_proxy(sandbox, tmp_path / "proxy", _fc(policy_file)) as proxy:
        assert asyncio.run(ready(proxy.url)).status_code == 200
        ctx = ssl.create_default_context(cafile=str(SandboxPKI(Path(sandbox.certs_dir)).ca))
        conn = http.client.HTTPSConnection("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]), context=ctx, timeout=30)
        try:
            conn.request("GET", path, headers=websocket)
            r = conn.getresponse()
            status, schema, body = r.status, r.getheader("x-gatekeeper-pf-flowschema"), r.read()
        finally:
            conn.close()
    assert status == 200 and b"ConfigMapList" in body, body[:300]  # the apiserver: it is builder
    assert schema == f"{ns}-builder"
