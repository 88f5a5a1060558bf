"""Classification mirrors upstream APF's documented matching rules."""

from __future__ import annotations

import pytest
from fc_helpers import Req, User, flow_schema, group, nonres, queued_level, rr, secrets_list_schema, user

from gatekeeper.proxy.flowcontrol.core.policy import build_policy

SA_FOO = "system:serviceaccount:team-a:builder"


def _policy():
    objs = [
        queued_level("workload", 30),
        queued_level("secrets-list", 2),
        secrets_list_schema(),
        # same precedence, name "a-..." sorts first and wins the tie
        flow_schema(
            "b-logs",
            "workload",
            [{"subjects": [user("*")], "resourceRules": [rr(["get"], ["pods/log"])]}],
            600,
        ),
        flow_schema(
            "a-logs",
            "workload",
            [{"subjects": [user("alice")], "resourceRules": [rr(["get"], ["pods/log"])]}],
            600,
        ),
        flow_schema(
            "ns-only",
            "workload",
            [
                {
                    "subjects": [group("devs")],
                    "resourceRules": [rr(["*"], ["configmaps"], namespaces=["dev"], cluster=False)],
                }
            ],
            700,
        ),
        flow_schema(
            "sa-team-a",
            "workload",
            [
                {
                    "subjects": [{"kind": "ServiceAccount", "serviceAccount": {"namespace": "team-a", "name": "*"}}],
                    "resourceRules": [rr(["*"], ["*"], groups=["*"])],
                }
            ],
            800,
        ),
        flow_schema(
            "nonres",
            "workload",
            [
                {
                    "subjects": [group("*")],
                    "nonResourceRules": [{"verbs": ["get"], "nonResourceURLs": ["/openapi/*", "/version"]}],
                }
            ],
            900,
        ),
        flow_schema(
            "apps",
            "workload",
            [{"subjects": [group("*")], "resourceRules": [rr(["list"], ["deployments"], groups=["apps"])]}],
            950,
        ),
    ]
    return build_policy([(f"test[{i}]", o) for i, o in enumerate(objs)], server_concurrency_limit=100)


CASES = [
    # (id, user, request, expected schema)
    ("masters exempt beats everything", User("admin", ["system:masters"]), Req("list", "secrets"), "exempt"),
    ("healthz probes exempt for anyone", User("x"), nonres("get", "/readyz"), "probes"),
    ("list secrets cluster-wide", User("bob", ["devs"]), Req("list", "secrets"), "secrets-list"),
    (
        "list secrets in a namespace",
        User("bob"),
        Req("list", "secrets", namespace="kube-system"),
        "secrets-list",
    ),
    ("get secret is not list", User("bob"), Req("get", "secrets", namespace="x"), "catch-all"),
    ("precedence tie broken by name", User("alice"), Req("get", "pods", "log", "default"), "a-logs"),
    ("user * matches anyone", User("carol"), Req("get", "pods", "log", "default"), "b-logs"),
    (
        "pods rule does not match pods/log",
        User("carol"),
        Req("get", "pods", namespace="default"),
        "catch-all",
    ),
    ("listed namespace matches", User("d", ["devs"]), Req("get", "configmaps", namespace="dev"), "ns-only"),
    (
        "other namespace does not",
        User("d", ["devs"]),
        Req("get", "configmaps", namespace="prod"),
        "catch-all",
    ),
    ("cluster-scoped needs clusterScope", User("d", ["devs"]), Req("list", "configmaps"), "catch-all"),
    ("group must be held", User("d", ["ops"]), Req("get", "configmaps", namespace="dev"), "catch-all"),
    ("serviceaccount * in namespace", User(SA_FOO), Req("create", "pods", namespace="team-a"), "sa-team-a"),
    (
        "serviceaccount other namespace",
        User("system:serviceaccount:team-b:builder"),
        Req("create", "pods", namespace="team-a"),
        "catch-all",
    ),
    (
        "serviceaccount prefix is not a namespace",
        User("system:serviceaccount:team-ab:x"),
        Req("create", "pods", namespace="x"),
        "catch-all",
    ),
    ("nonresource prefix /*", User("e"), nonres("get", "/openapi/v3/apis"), "nonres"),
    ("nonresource exact", User("e"), nonres("get", "/version"), "nonres"),
    ("nonresource verb must match", User("e"), nonres("post", "/version"), "catch-all"),
    (
        "nonresource rule ignores resource requests",
        User("e"),
        Req("get", "version", namespace="x"),
        "catch-all",
    ),
    ("api group must match", User("e"), Req("list", "deployments", api_group="apps", namespace="n"), "apps"),
    ("core group is not apps", User("e"), Req("list", "deployments", namespace="n"), "catch-all"),
]


@pytest.mark.parametrize(("usr", "req", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_classification_follows_upstream_rules(usr, req, expected):
    fs, pl = _policy().classify(usr, req)
    assert fs.name == expected
    assert pl.name == fs.priority_level


def test_schemas_ordered_by_precedence_then_name():
    names = [fs.name for fs in _policy().schemas]
    assert names.index("a-logs") < names.index("b-logs")
    assert names[0] == "exempt" and names[-1] == "catch-all"


def test_nominal_limits_are_shares_of_total():
    p = _policy()
    # Limited levels: workload 30, secrets-list 2, catch-all 5 (built in) -> sum 37
    assert p.limits == {"workload": 82, "secrets-list": 6, "catch-all": 14}


def test_user_object_replaces_builtin_of_same_name():
    objs = [queued_level("catch-all", 98), queued_level("secrets-list", 2)]
    p = build_policy([(str(i), o) for i, o in enumerate(objs)], 100)
    assert not p.levels["catch-all"].reject
    assert p.limits == {"catch-all": 98, "secrets-list": 2}
