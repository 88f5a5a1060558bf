"""Differential fuzz: the proxy's FlowSchema pick against the real apiservers' APF pick, request by request.

The cluster gets FlowSchemas that split on verb, resource, subresource, group, scope, non-resource URL and
subject (``diff_fuzz.world_policy``); the proxy gets exactly the cluster's APF objects (a dump of every
FlowSchema and PriorityLevelConfiguration, UIDs included). A few thousand seeded request variants from
tenant identities (client certificates with and without groups, ServiceAccount tokens; never
system:masters) go through the proxy over HTTP/1.1 and HTTP/2. Each answer carries the proxy's pick
(``x-gatekeeper-pf-flowschema``) and, when the apiserver's APF classified the request, the apiserver's
(``X-Kubernetes-PF-FlowSchema-UID``, mapped to a name). The tenants have no RBAC rights: APF runs before
authorization, so every classified request is a cheap 403 and nothing is created or watched.

Answers without an apiserver pick are accounted for (``diff_fuzz.judge``): refused by the proxy itself,
refused by the apiserver before APF, or untracked by APF (long-running, not a watch). Anything else, and
every differing pick, fails the test with the requests that showed it.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import json
import secrets
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import diff_fuzz as fz
import pytest
import storm_kit as kit
import yaml

from gatekeeper.certs.pki import PKI
from gatekeeper.proxy.identity.tokens.settings import TokenSettings
from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox

SEED = 20261202
COUNT = 4000
RBAC = kit.REPO / "deploy" / "examples" / "proxy-identity-rbac.yaml"
Credential = tuple[tuple[str, str] | None, str]
"""(client certificate and key, or None; Authorization header value, or '')."""


def _ok(out: Any) -> str:
    assert out.returncode == 0, out.stderr
    return str(out.stdout)


@pytest.fixture
def world(sandbox: SandboxState, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A namespace with two ServiceAccounts, the fuzz FlowSchemas applied to the cluster, the cluster's whole
    APF policy dumped for the proxy, and the tenants' TLS contexts and tokens."""
    ns = f"fc-df-{secrets.token_hex(3)}"
    group = f"{ns}:tenants"
    policy, names = fz.world_policy(ns, group)
    cluster: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        *({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": ns}}
          for sa in ("builder", "ci")),
    ]
    _ok(kit.kubectl(sandbox, "apply", "-f", "-", input=RBAC.read_text()))
    _ok(kit.kubectl(sandbox, "apply", "-f", "-", input=yaml.safe_dump_all(cluster + policy)))
    try:
        dump = _ok(kit.kubectl(sandbox, "get", "flowschemas,prioritylevelconfigurations", "-o", "yaml"))
        policy_file = tmp_path / "cluster-apf.yaml"
        policy_file.write_text(dump)
        apf = json.loads(_ok(kit.kubectl(sandbox, "get", "flowschemas,prioritylevelconfigurations", "-o", "json")))
        uid_names = {i["metadata"]["uid"]: i["metadata"]["name"] for i in apf["items"]}
        pki = PKI(sandbox.certs_dir)
        creds: dict[str, Credential] = {}
        for who, groups in (("alice", [group]), ("bob", [group]), ("carol", [])):
            issued = pki.issue_client(f"{ns}-{who}", user=f"{ns}-{who}", groups=groups)
            creds[who] = ((str(issued.cert), str(issued.key)), "")
        for sa in ("builder", "ci"):
            token = _ok(kit.kubectl(sandbox, "create", "token", sa, "-n", ns, "--duration=1h")).strip()
            creds[sa] = (None, f"Bearer {token}")
        creds["anon"] = (None, "")
        yield ns, names, uid_names, policy_file, creds
    finally:
        kit.kubectl(sandbox, "delete", "-f", "-", "--ignore-not-found", "--wait=false",
                    input=yaml.safe_dump_all(cluster + policy))


def _lane(proto: str, url: str, ca: str, cred: Credential) -> fz.H1Lane | fz.H2Lane:
    host, port = url.removeprefix("https://").rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=ca)
    if cred[0] is not None:
        ctx.load_cert_chain(*cred[0])
    if proto == "h2":
        ctx.set_alpn_protocols(["h2"])
        return fz.H2Lane(host, int(port), ctx, cred[1])
    return fz.H1Lane(host, int(port), ctx, cred[1])


def _run(cases: list[fz.Case], url: str, creds: dict[str, Credential], ca: str) -> list[tuple[fz.Case, fz.Answer]]:
    """Every case through its (identity, protocol) lane; lanes run side by side, each in order."""
    lanes: dict[tuple[str, str], list[fz.Case]] = collections.defaultdict(list)
    for c in cases:
        lanes[(c.who, c.proto)].append(c)
    results: list[tuple[fz.Case, fz.Answer]] = []
    lock = threading.Lock()

    def drive(key: tuple[str, str], todo: list[fz.Case]) -> None:
        who, proto = key
        lane = _lane(proto, url, ca, creds[who])
        builder = creds["builder"][1]
        encoded = base64.urlsafe_b64encode(builder.removeprefix("Bearer ").encode()).decode().rstrip("=")
        put_in = {fz.TOKEN_OF_BUILDER: builder, fz.WEBSOCKET_OF_BUILDER: fz.WEBSOCKET_OF_BUILDER.replace(
            "@builder", encoded)}
        try:
            for c in todo:
                if any(v in put_in for _, v in c.headers):
                    c = dataclasses.replace(c, headers=tuple((k, put_in.get(v, v)) for k, v in c.headers))
                answer = lane.send(c)
                with lock:
                    results.append((c, answer))
        finally:
            lane.close()

    threads = [threading.Thread(target=drive, args=(k, v)) for k, v in lanes.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def _warm_up(url: str, ca: str, creds: dict[str, Credential], ns: str, uid_names: dict[str, str]) -> None:
    """Wait until every apiserver's APF has the new FlowSchemas and the proxy verifies the ServiceAccount
    tokens (its first key fetch): several answers in a row where both sides pick the expected schema."""
    for who, want in (("alice", f"{ns}-secrets-list"), ("builder", f"{ns}-sa-builder")):
        lane = _lane("h1", url, ca, creds[who])
        probe = fz.Case(who, "h1", "GET", f"/api/v1/namespaces/{ns}/secrets")
        streak = 0
        for _ in range(300):
            answer = lane.send(probe)
            theirs = uid_names.get(answer.headers.get("x-kubernetes-pf-flowschema-uid", ""))
            if theirs == want == answer.headers.get("x-gatekeeper-pf-flowschema"):
                streak += 1
                if streak >= 9:
                    break
            else:
                streak = 0
                time.sleep(0.1)
        lane.close()
        assert streak >= 9, f"never picked {want} on both sides for {who}'s secret LIST: {answer.headers}"


def test_the_proxy_picks_the_apiservers_flow_schema_for_every_fuzzed_request(
    sandbox: SandboxState, tmp_path: Path, world: tuple[str, list[str], dict[str, str], Path, dict[str, Credential]]
) -> None:
    ns, names, uid_names, policy_file, creds = world
    ca = str(SandboxPKI(Path(sandbox.certs_dir)).ca)
    cases = fz.generate(SEED, COUNT, ns)
    fc = {"files": [str(policy_file)], "serverConcurrencyLimit": 600, "reloadIntervalSeconds": 0,
          "tokens": kit._keys(TokenSettings, jwks_min_refresh_seconds=1)}
    with kit.run_proxy(sandbox, tmp_path / "proxy", fc) as proxy:
        _warm_up(proxy.url, ca, creds, ns, uid_names)
        before = kit.metric_sum(proxy.metrics(), "gatekeeper_proxy_rejected_total")
        results = _run(cases, proxy.url, creds, ca)
        rejected = kit.metric_sum(proxy.metrics(), "gatekeeper_proxy_rejected_total") - before
    assert len(results) == len(cases)
    verdicts = [(c, a, *fz.judge(c, a, uid_names)) for c, a in results]
    tally = collections.Counter(v[2] for v in verdicts)
    bad = [v for v in verdicts if v[2] in ("DISAGREE", "NO-STAMP")]
    # one example per distinct verdict (the shortest request showing it) keeps the failure readable
    examples: dict[str, tuple[fz.Case, fz.Answer, str, str]] = {}
    for v in sorted(bad, key=lambda v: len(v[0].show())):
        examples.setdefault(v[3].split(":")[0], v)
    report = "\n".join(f"  {c.show()}\n    -> {a.status}: {detail}" for c, a, _, detail in examples.values())
    assert not bad, f"{len(bad)} of {len(cases)} requests classified differently ({dict(tally)}):\n{report}"
    # the fuzz must reach every schema and every no-pick path, or it proves less than it claims
    # (APF never classifies pods/log, exec/attach/portforward or the proxy verb: those schemas are only ever
    # the proxy's pick for requests the apiserver lets through untracked)
    untracked = {f"{ns}-{s}" for s in ("pods-log", "pods-tunnel", "proxy-verb")}
    agreed = collections.Counter(detail for _, _, outcome, detail in verdicts if outcome == "agree")
    missing = [n for n in [*names, "global-default", "service-accounts", "probes"]
               if n not in untracked and not agreed[n]]
    assert not missing, f"no request agreed on {missing}: {dict(agreed)}"
    passed = {detail for _, _, outcome, detail in verdicts if outcome == "untracked"}
    assert untracked <= passed, (untracked - passed, passed)
    assert tally["agree"] >= len(cases) // 2, dict(tally)
    assert tally["proxy-refused"] and tally["untracked"] and tally["apiserver-before-apf"], dict(tally)
    assert not tally["proxy-throttled"], dict(tally)
    # the proxy's own refusals are counted (a /metrics page it answers itself is not a refusal)
    refused_400 = sum(1 for _, a, outcome, _ in verdicts if outcome == "proxy-refused" and a.status in (0, 400))
    assert rejected >= refused_400 > 0, (rejected, refused_400)


MINIMISED = [
    # (who, method, target, the FlowSchema both must pick): each of these disagreed before its fix
    # a certificate caller is in system:authenticated upstream (the cluster's global-default and probes)
    ("carol", "GET", "/api/v1/namespaces/{ns}/configmaps", "global-default"),
    ("alice", "GET", "/healthz", "probes"),
    ("alice", "GET", "/api/v1/namespaces/{ns}/events", "{ns}-authenticated-events"),
    # the method is read case-sensitively upstream: verb "", not a LIST
    ("alice", "get", "/api/v1/namespaces/{ns}/secrets", "{ns}-secrets-any"),
    # ListOptions that fail to decode: watch is read with ToLower, so fal\u017fe is a watch
    ("alice", "GET", "/api/v1/namespaces/{ns}/secrets?watch=fal%C5%BFe&limit=x", "{ns}-secrets-watch"),
    ("alice", "GET", "/api/v1/namespaces/{ns}/secrets?labelSelector=%21%21&watch=fal%C5%BFe", "{ns}-secrets-watch"),
    # ... and decoded ones with EqualFold: a LIST
    ("alice", "GET", "/api/v1/namespaces/{ns}/secrets?watch=fal%C5%BFe&limit=5", "{ns}-secrets-list"),
]


def test_the_minimised_disagreements_are_classified_alike(
    sandbox: SandboxState, tmp_path: Path, world: tuple[str, list[str], dict[str, str], Path, dict[str, Credential]]
) -> None:
    ns, _, uid_names, policy_file, creds = world
    ca = str(SandboxPKI(Path(sandbox.certs_dir)).ca)
    fc = {"files": [str(policy_file)], "serverConcurrencyLimit": 600, "reloadIntervalSeconds": 0}
    with kit.run_proxy(sandbox, tmp_path / "proxy", fc) as proxy:
        _warm_up(proxy.url, ca, creds, ns, uid_names)
        for proto in ("h1", "h2"):
            for who, method, target, want in MINIMISED:
                case = fz.Case(who, proto, method, target.format(ns=ns))
                lane = _lane(proto, proxy.url, ca, creds[who])
                answer = lane.send(case)
                lane.close()
                theirs = uid_names.get(answer.headers.get("x-kubernetes-pf-flowschema-uid", ""), "")
                ours = answer.headers.get("x-gatekeeper-pf-flowschema", "")
                assert (ours, theirs) == (want.format(ns=ns),) * 2, (case.show(), answer.status)
