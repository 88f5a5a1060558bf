"""A client-certificate caller is classified with the groups kube-apiserver gives it, ``system:authenticated``
included (its AuthenticatedGroupAdder wraps the requestheader authenticator the proxy's stamp goes through).

Without it the cluster's own ``global-default`` and ``probes`` FlowSchemas (subject Group
``system:authenticated``) never matched a certificate caller here, which went to ``catch-all`` while the
apiserver charged ``global-default``; a FlowSchema limiting every authenticated caller did not limit them
in the proxy at all (found by test_sandbox_classification_fuzz.py).
"""

from __future__ import annotations

import asyncio

from fc_helpers import flow_schema, group, queued_level, rr

from gatekeeper.kube import requestinfo
from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings
from gatekeeper.proxy.identity import auth
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse, UserInfo


def _cert(cn: str, *orgs: str) -> dict:
    return {"subject": ((("commonName", cn),), *((("organizationName", o),) for o in orgs))}


def _request(peer_cert: dict, target: str = "/api/v1/namespaces/a/configmaps") -> ProxyRequest:
    r = ProxyRequest(method="GET", target=target, headers=[], body=None, protocol="h2")
    r.connection_memo = {}
    r.user = auth.identify(peer_cert, r.headers, r.connection_memo)
    r.info = requestinfo.parse(r.method, r.target)
    return r


async def _ok(request: ProxyRequest) -> ProxyResponse:
    return ProxyResponse(status=200, headers=[])


def test_certificate_callers_match_a_schema_for_every_authenticated_user() -> None:
    settings = FlowControlSettings(
        server_concurrency_limit=100,
        priority_level_configurations=[queued_level("authenticated", 10), queued_level("catch-all", 90)],
        flow_schemas=[flow_schema("authenticated", "authenticated",
                                  [{"subjects": [group("system:authenticated")], "resourceRules": [rr(["*"], ["*"])]}],
                                  precedence=9900)],
    )

    async def scenario() -> list[str]:
        fc = FlowControl(settings)
        picks = []
        for cert in (_cert("alice", "team-a"), _cert("carol"), _cert("dave", "team-a", "team-b")):
            response = await fc(_request(cert), _ok)
            picks.append(dict(response.headers)["x-gatekeeper-pf-flowschema"])
            response.finish(None)
        return picks

    assert asyncio.run(scenario()) == ["authenticated"] * 3


def test_the_apiserver_view_adds_system_authenticated_as_the_authenticated_group_adder_does() -> None:
    seen = auth.as_apiserver_sees(auth.identify(_cert("alice", "team-a"), []))
    assert (seen.name, seen.groups, seen.source) == ("alice", ["team-a", "system:authenticated"], "x509")
    # not for system:anonymous, nor when either of the two groups is already there
    for cert in (_cert("system:anonymous", "x"), _cert("bob", "system:authenticated"),
                 _cert("bob", "system:unauthenticated")):
        user = auth.identify(cert, [])
        assert auth.as_apiserver_sees(user).groups == user.groups
    # token and anonymous callers are the apiserver's (or the token verifier's) to name
    for user in (UserInfo(name="token:abc", source="token"), auth.identify(None, [])):
        assert auth.as_apiserver_sees(user) is user


def test_the_stamped_identity_stays_the_certificates_own() -> None:
    user = auth.identify(_cert("alice", "team-a"), [])
    auth.as_apiserver_sees(user, {})
    assert auth.identity_headers(user) == [("x-remote-user", "alice"), ("x-remote-group", "team-a")]


def test_a_connections_kept_view_is_never_given_to_a_user_with_other_groups() -> None:
    memo: dict = {}
    first = auth.as_apiserver_sees(auth.identify(_cert("alice", "team-a"), []), memo)
    assert auth.as_apiserver_sees(auth.identify(_cert("alice", "team-a"), []), memo) is first
    other = auth.as_apiserver_sees(auth.identify(_cert("alice", "admins"), []), memo)
    assert other.groups == ["admins", "system:authenticated"]
