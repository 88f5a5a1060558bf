"""Two requests share one upstream LIST only when the apiserver must answer them identically.

The key is checked pairwise against a base request (each variant must get its own key), and end to end
through the middleware for the case that leaked: an anonymous LIST joined a WebSocket-upgrade LIST that
kube-apiserver authenticates by the token in ``Sec-WebSocket-Protocol`` (v1.37.2 answers it with the
token's 200 SecretList), so the anonymous caller got a ServiceAccount's secrets.
"""

from __future__ import annotations

import asyncio

import pytest
from test_middleware import Upstream, call, req, seeds_settings, until

from gatekeeper.proxy.flowcontrol.core.coalesce import coalesce_key, identity_key
from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl
from gatekeeper.proxy.messages import UserInfo

TARGET = "/api/v1/namespaces/ns/secrets?limit=500&labelSelector=a%3Db"
BASE_HEADERS = [("accept", "application/json"), ("authorization", "Bearer abc")]
WS = [("connection", "upgrade"), ("upgrade", "websocket"),
      ("sec-websocket-protocol", "base64url.bearer.authorization.k8s.io.dG9rZW4, v4.channel.k8s.io")]


def key(target: str = TARGET, headers: list[tuple[str, str]] | None = None, name: str = "token:1",
        groups: tuple[str, ...] = (), source: str = "token") -> tuple[str, ...] | None:
    hs = BASE_HEADERS if headers is None else headers
    return coalesce_key("GET", target, hs, identity_key(name, list(groups), source, hs))


VARIANTS = {
    "another token": dict(headers=[("accept", "application/json"), ("authorization", "Bearer xyz")]),
    "another authorization scheme": dict(headers=[("accept", "application/json"), ("authorization", "bearer abc")]),
    "a second authorization header": dict(headers=[*BASE_HEADERS, ("authorization", "Bearer xyz")]),
    "impersonating a user": dict(headers=[*BASE_HEADERS, ("impersonate-user", "eve")]),
    "impersonating a group": dict(headers=[*BASE_HEADERS, ("impersonate-group", "system:masters")]),
    "impersonating a uid": dict(headers=[*BASE_HEADERS, ("impersonate-uid", "1")]),
    "impersonating extra": dict(headers=[*BASE_HEADERS, ("impersonate-extra-scopes", "x")]),
    "protobuf": dict(headers=[("accept", "application/vnd.kubernetes.protobuf"), ("authorization", "Bearer abc")]),
    "a Table": dict(headers=[("accept", "application/json;as=Table;v=v1;g=meta.k8s.io"),
                             ("authorization", "Bearer abc")]),
    "gzip": dict(headers=[*BASE_HEADERS, ("accept-encoding", "gzip")]),
    "another language": dict(headers=[*BASE_HEADERS, ("accept-language", "de")]),
    "a websocket token": dict(headers=[*BASE_HEADERS, ("sec-websocket-protocol",
                                                       "base64url.bearer.authorization.k8s.io.dG9rZW4")]),
    "query order": dict(target="/api/v1/namespaces/ns/secrets?labelSelector=a%3Db&limit=500"),
    "a duplicated parameter": dict(target=TARGET + "&limit=500"),
    "a resourceVersion": dict(target=TARGET + "&resourceVersion=0"),
    "a continue token": dict(target=TARGET + "&continue=abc"),
    "a fieldSelector": dict(target=TARGET + "&fieldSelector=type%3Dopaque"),
    "another namespace's path": dict(target="/api/v1/secrets?limit=500&labelSelector=a%3Db"
                                            "&fieldSelector=metadata.namespace%3Dns"),
    "another user name": dict(name="token:2"),
    "another source": dict(source="x509"),
}


def test_identical_requests_share_a_key() -> None:
    assert key() is not None and key() == key()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_difference_the_apiserver_could_answer_differently_splits_the_key(variant: str) -> None:
    assert key(**VARIANTS[variant]) != key()  # type: ignore[arg-type]


def test_certificate_groups_cannot_be_spelled_to_collide() -> None:
    """CN alice with O="a,b" is not CN alice with O=a and O=b (RBAC binds groups by exact name)."""
    hs = [("accept", "application/json")]
    assert identity_key("alice", ["a,b"], "x509", hs) != identity_key("alice", ["a", "b"], "x509", hs)
    assert identity_key("alice", ["a"], "x509", hs) != identity_key("alice\x00a", [], "x509", hs)


def test_protocol_switch_requests_are_never_merged() -> None:
    assert key(headers=[*BASE_HEADERS, *WS]) is None
    assert key(headers=[*BASE_HEADERS, ("upgrade", "SPDY/3.1")]) is None


async def test_an_anonymous_list_never_joins_a_websocket_authenticated_list() -> None:
    fc = FlowControl(seeds_settings())
    up = Upstream(body=b'{"kind":"SecretList","items":["victim"]}', chunks=2)
    up.gate.clear()
    blockers = [asyncio.create_task(call(fc, req(target=f"/api/v1/namespaces/n{i}/secrets"), up)) for i in range(2)]
    await until(lambda: up.calls == 2, "two blockers to hold both seats")

    def anonymous(headers: list[tuple[str, str]]):  # type: ignore[no-untyped-def]
        r = req(headers=[("accept", "application/json"), *headers])
        r.user = UserInfo(name="system:anonymous", groups=["system:unauthenticated"], source="anonymous")
        return r

    victim = asyncio.create_task(call(fc, anonymous(WS), up))
    attacker = asyncio.create_task(call(fc, anonymous([]), up))
    level = fc.controller.levels["secrets-list"]
    await until(lambda: level.waiting == 2, "both LISTs to queue")
    up.gate.set()
    await asyncio.gather(*blockers, victim, attacker)
    assert up.calls == 4, "the anonymous LIST was answered from the WebSocket caller's upstream call"
