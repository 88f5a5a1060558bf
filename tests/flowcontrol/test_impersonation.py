"""Requests of a trusted impersonator are classified as whom they impersonate; everyone else's as themselves.

kube-apiserver authorizes the impersonation and only then runs APF on the impersonated identity, so an
authenticating proxy (Pinniped, Teleport) that sends all its users' traffic under its own identity is
charged per end user upstream. ``flowControl.impersonators`` names such callers; the identity is built as
the apiserver's impersonation filter builds it. The sandbox test is
``test_sandbox_impersonation.py``.
"""

from __future__ import annotations

import asyncio

import pytest
from fc_helpers import flow_schema, group, queued_level, rr, user

from gatekeeper.base.config import ConfigError
from gatekeeper.kube import requestinfo
from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings
from gatekeeper.proxy.identity import auth
from gatekeeper.proxy.identity.impersonation import ImpersonatorSettings, impersonated
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import load_section

SECRETS = "/api/v1/namespaces/team-a/secrets"


def _identity(*headers: tuple[str, str]) -> tuple[str, list[str]] | None:
    who = impersonated(list(headers))
    return None if who is None else (who.name, who.groups)


def test_the_impersonated_identity_is_built_as_the_apiservers_filter_builds_it() -> None:
    assert _identity(("impersonate-user", "alice")) == ("alice", ["system:authenticated"])
    # every Impersonate-Group field is one group, commas and all; system:authenticated is added after them
    assert _identity(("impersonate-user", "alice"), ("impersonate-group", "a, b"), ("impersonate-group", "c")) \
        == ("alice", ["a, b", "c", "system:authenticated"])
    # ...unless a group names it or system:unauthenticated
    assert _identity(("impersonate-user", "alice"), ("impersonate-group", "system:unauthenticated")) \
        == ("alice", ["system:unauthenticated"])
    # a ServiceAccount gets its two groups when none is given, and only then
    assert _identity(("impersonate-user", "system:serviceaccount:team-a:builder")) == (
        "system:serviceaccount:team-a:builder",
        ["system:serviceaccounts", "system:serviceaccounts:team-a", "system:authenticated"])
    assert _identity(("impersonate-user", "system:serviceaccount:team-a:builder"), ("impersonate-group", "g")) \
        == ("system:serviceaccount:team-a:builder", ["g", "system:authenticated"])
    # a name that only looks like one (namespace not a DNS label, three parts) is a plain user
    for name in ("system:serviceaccount:Team-A:builder", "system:serviceaccount:a:b:c", "system:serviceaccount::b"):
        assert _identity(("impersonate-user", name)) == (name, ["system:authenticated"])
    # anonymous gets system:unauthenticated
    assert _identity(("impersonate-user", "system:anonymous")) == ("system:anonymous", ["system:unauthenticated"])
    # the first Impersonate-User counts (Go's Header.Get)
    assert _identity(("impersonate-user", "alice"), ("impersonate-user", "bob")) == ("alice", ["system:authenticated"])
    # no user: no impersonation (with groups, extras or a UID the apiserver answers 400 before APF)
    assert _identity(("impersonate-group", "system:masters")) is None
    assert _identity(("impersonate-user", ""), ("impersonate-uid", "1")) is None
    assert _identity(("authorization", "Bearer x")) is None


def test_too_broad_or_anonymous_impersonators_are_refused_when_the_config_loads() -> None:
    for section, words in (
        ({"impersonators": {"groups": ["system:authenticated"]}}, "every tenant"),
        ({"impersonators": {"groups": ["system:serviceaccounts"]}}, "every tenant or every pod"),
        ({"impersonators": {"users": ["system:anonymous"]}}, "unauthenticated"),
    ):
        with pytest.raises(ConfigError, match=words):
            load_section({"backends": [{"name": "a", "url": "https://127.0.0.1:1"}], "flowControl": section},
                         "cfg.yaml", "proxy")
    loaded = load_section({"backends": [{"name": "a", "url": "https://127.0.0.1:1"}],
                           "flowControl": {"impersonators": {"users": ["system:serviceaccount:auth:pinniped"],
                                                             "groups": ["auth-proxies"]}}}, "cfg.yaml", "proxy")
    assert loaded.flow_control.impersonators == ImpersonatorSettings(
        users=["system:serviceaccount:auth:pinniped"], groups=["auth-proxies"])


def _cert(cn: str, *orgs: str) -> dict:
    return {"subject": ((("commonName", cn),), *((("organizationName", o),) for o in orgs))}


def _request(cn: str, orgs: tuple[str, ...], headers: list[tuple[str, str]], target: str = SECRETS) -> ProxyRequest:
    r = ProxyRequest(method="GET", target=target, headers=headers, body=None, protocol="h2")
    r.connection_memo = {}
    r.user = auth.identify(_cert(cn, *orgs), r.headers, r.connection_memo)
    r.info = requestinfo.parse(r.method, r.target)
    return r


def _settings(impersonators: ImpersonatorSettings) -> FlowControlSettings:
    every = [rr(["*"], ["*"])]
    return FlowControlSettings(
        server_concurrency_limit=100,
        priority_level_configurations=[queued_level("tenants", 10), queued_level("gateway", 10),
                                       queued_level("catch-all", 80)],
        flow_schemas=[
            flow_schema("tenants", "tenants", [{"subjects": [group("tenants")], "resourceRules": every}],
                        precedence=100, by="ByUser"),
            flow_schema("alice", "tenants", [{"subjects": [user("alice")], "resourceRules": every}], precedence=90),
            flow_schema("gateway", "gateway", [{"subjects": [user("gateway"), user("other-gateway")],
                                                "resourceRules": every}], precedence=200),
        ],
        impersonators=impersonators,
    )


async def _ok(request: ProxyRequest) -> ProxyResponse:
    return ProxyResponse(status=200, headers=[])


def _picks(settings: FlowControlSettings, requests: list[ProxyRequest]) -> list[tuple[str, str]]:
    async def scenario() -> list[tuple[str, str]]:
        fc = FlowControl(settings)
        out = []
        for r in requests:
            response = await fc(r, _ok)
            out.append((dict(response.headers)["x-gatekeeper-pf-flowschema"], r.caller))
            response.finish(None)
        return out

    return asyncio.run(scenario())


def test_a_trusted_impersonators_requests_are_classified_and_capped_as_whom_it_impersonates() -> None:
    acting = [("impersonate-user", "bob"), ("impersonate-group", "tenants")]
    picks = _picks(_settings(ImpersonatorSettings(users=["gateway"])), [
        _request("gateway", (), acting),
        _request("gateway", (), [("impersonate-user", "alice")]),
        _request("gateway", (), []),  # its own requests stay its own
    ])
    assert picks == [("tenants", "bob"), ("alice", "alice"), ("gateway", "")]


def test_a_caller_trusted_by_group_is_classified_as_whom_it_impersonates() -> None:
    picks = _picks(_settings(ImpersonatorSettings(groups=["auth-proxies"])),
                   [_request("gateway", ("auth-proxies",), [("impersonate-user", "alice")])])
    assert picks == [("alice", "alice")]


def test_an_untrusted_caller_is_classified_as_itself_whatever_it_impersonates() -> None:
    """It cannot pick its own FlowSchema here; if the apiserver lets it impersonate, the two classify apart
    (docs/flowcontrol/index.md says so), and if not, the apiserver answers 403 before its APF."""
    acting = [("impersonate-user", "bob"), ("impersonate-group", "tenants")]
    for impersonators in (ImpersonatorSettings(), ImpersonatorSettings(users=["gateway"])):
        picks = _picks(_settings(impersonators), [_request("other-gateway", (), acting)])
        assert picks == [("gateway", "")], impersonators
