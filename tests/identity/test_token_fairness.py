"""Token callers through the flow-control middleware: real identities match, made-up tokens share one flow.

The ServiceAccount tokens here are signed with real keys and verified by the
proxy's verifier (the keys are installed directly instead of fetched; the
fetch path is covered against real apiservers in test_tokens_sandbox.py).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
import token_kit as kit

from gatekeeper.kube import requestinfo
from gatekeeper.proxy.flowcontrol.core.policy import flow_schema_object
from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings
from gatekeeper.proxy.identity.tokens.fetch import TokenIdentities
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse, UserInfo
from gatekeeper.proxy.pipeline import stages as front_stage
from gatekeeper.proxy.pipeline.stages import resolve_token

RSA = kit.rsa_key()
CM = "/api/v1/namespaces/team-a/configmaps/x"
ATTACKER = "10.0.0.9"


def level(name: str, shares: int, queues: int = 16, hand: int = 2, qlen: int = 10) -> dict[str, Any]:
    return {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "PriorityLevelConfiguration",
        "metadata": {"name": name},
        "spec": {"type": "Limited", "limited": {"nominalConcurrencyShares": shares, "limitResponse": {
            "type": "Queue", "queuing": {"queues": queues, "handSize": hand, "queueLengthLimit": qlen}}}},
    }


EVERYTHING = {"resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "namespaces": ["*"],
                                 "clusterScope": True}]}


def settings(schemas: list[dict[str, Any]], levels: list[dict[str, Any]]) -> FlowControlSettings:
    return FlowControlSettings(server_concurrency_limit=100, flow_schemas=schemas, priority_level_configurations=levels)


_IDENTITIES: dict[int, TokenIdentities] = {}
"""The front stage's token identities for each flow control under test (by id)."""


def with_keys(fc: FlowControl) -> FlowControl:
    identities = TokenIdentities(fc.settings.tokens)
    identities.verifier.set_keys(kit.ISSUER, kit.jwks(RSA))
    _IDENTITIES[id(fc)] = identities
    return fc


def token_request(token: str, peer: str, target: str = CM) -> ProxyRequest:
    r = ProxyRequest(method="GET", target=target, headers=[("authorization", f"Bearer {token}")], body=None,
                     protocol="h2", peer=peer)
    r.user = UserInfo(name="token:whatever", source="token")
    r.info = requestinfo.parse("GET", target)
    return r


WHO = {1: "garbage", 2: "sa"}
"""The test's label of a request, by the stream id it gives it."""


class Gate:
    """A fake apiserver that holds every request until ``open`` and records who was dispatched, in order."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.order: list[str] = []
        self.seen: list[ProxyRequest] = []

    async def __call__(self, request: ProxyRequest) -> ProxyResponse:
        self.order.append(WHO.get(request.stream_id, ""))
        self.seen.append(request)
        await self.open.wait()

        async def body():  # type: ignore[no-untyped-def]
            yield b"{}"

        return ProxyResponse(status=200, headers=[], body=body())


async def call(fc: FlowControl, r: ProxyRequest, up: Gate) -> int:
    identities = _IDENTITIES.get(id(fc))
    if identities is not None and r.user is not None and r.user.source == "token":
        await resolve_token(identities, r)  # what the front stage does before flow control
    resp = await fc(r, up)
    async for _ in resp.body:
        pass
    resp.finish(None)
    return resp.status


async def until(cond: Any, rounds: int = 2000) -> None:
    for _ in range(rounds):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


async def flood_then_serviceaccount(fc: FlowControl) -> tuple[list[int], list[str]]:
    """2,000 made-up tokens from one address fill the level; then 10 requests of one real ServiceAccount."""
    up = Gate()
    lv = fc.controller.levels["tenants"]
    garbage = []
    for i in range(2000):
        r = token_request(f"made-up-{i}.{i}.{i}", f"{ATTACKER}:{1024 + i}")
        r.stream_id = 1  # WHO: garbage
        garbage.append(asyncio.ensure_future(call(fc, r, up)))
    await until(lambda: lv.waiting + lv.executing_requests + sum(t.done() for t in garbage) == 2000)
    sa = kit.sign(kit.sa_claims("team-a", "builder"), RSA)
    mine = []
    for _ in range(10):
        r = token_request(sa, f"{ATTACKER}:999")  # same address: the verified identity is what counts
        r.stream_id = 2  # WHO: sa
        mine.append(asyncio.ensure_future(call(fc, r, up)))
    await until(lambda: all(t.done() for t in mine) or lv.waiting >= 10 + sum(not t.done() for t in garbage) - 2)
    up.open.set()
    statuses = await asyncio.gather(*mine)
    await asyncio.gather(*garbage)
    return statuses, up.order


def tenants_policy() -> FlowControl:
    schema = flow_schema_object("tenants", 500, "tenants", [{"subjects": [{"kind": "Group", "group": {"name": "*"}}],
                                                             **EVERYTHING}], by="ByUser")
    return with_keys(FlowControl(settings([schema], [level("tenants", 2), level("catch-all", 98)])))


async def test_made_up_tokens_share_one_flow_and_a_serviceaccount_keeps_its_fair_share() -> None:
    fc = tenants_policy()
    assert fc.controller.levels["tenants"].limit == 2
    statuses, order = await flood_then_serviceaccount(fc)
    assert statuses == [200] * 10, "the ServiceAccount was rejected while made-up tokens filled the level"
    sa_positions = [i for i, who in enumerate(order) if who == "sa"]
    # the flood holds 2 queues (one hand) and the 2 seats; the ServiceAccount's queue is served in turn
    # with those two, so its 10 requests run within the first 2 + 3 * 10 dispatches
    assert sa_positions[-1] < 2 + 3 * 10, sa_positions
    assert order.count("garbage") <= 2 + 2 * 10


async def test_without_the_shared_flow_made_up_tokens_would_starve_the_serviceaccount(monkeypatch) -> None:
    """The same flood with one flow per token (what the defence prevents) does lock the ServiceAccount out."""
    fresh = itertools.count()
    monkeypatch.setattr(front_stage, "unverified_flow", lambda peer: f"per-token-{next(fresh)}")
    statuses, _ = await flood_then_serviceaccount(tenants_policy())
    assert statuses.count(429) >= 5


async def test_serviceaccount_and_namespace_group_subjects_match_token_callers() -> None:
    by_sa = flow_schema_object("builder", 100, "tenants", [{"subjects": [
        {"kind": "ServiceAccount", "serviceAccount": {"namespace": "team-a", "name": "builder"}}], **EVERYTHING}])
    by_ns = flow_schema_object("team-b", 200, "tenants", [{"subjects": [
        {"kind": "Group", "group": {"name": "system:serviceaccounts:team-b"}}], **EVERYTHING}])
    fc = with_keys(FlowControl(settings([by_sa, by_ns], [level("tenants", 2), level("catch-all", 98)])))
    up = Gate()
    up.open.set()
    cases = {
        kit.sign(kit.sa_claims("team-a", "builder"), RSA): "builder",
        kit.sign(kit.sa_claims("team-b", "ci"), RSA): "team-b",
        kit.sign(kit.sa_claims("team-c", "x"), RSA): "catch-all",
        "not-a-jwt": "catch-all",
    }
    for token, schema in cases.items():
        r = token_request(token, "10.0.0.1:5000")
        assert await call(fc, r, up) == 200
        assert r.flow_schema == schema
    # classification only: the caller's header and request.user go on untouched
    assert all(r.headers == [("authorization", f"Bearer {t}")] for r, t in zip(up.seen, cases, strict=True))
    assert all(r.user is not None and r.user.name == "token:whatever" for r in up.seen)


@pytest.mark.parametrize("token_ok", [False, True])
async def test_an_unverifiable_token_is_never_exempt(token_ok: bool) -> None:
    exempt_anon = flow_schema_object("let-anonymous-in", 50, "exempt", [{"subjects": [
        {"kind": "Group", "group": {"name": "system:unauthenticated"}},
        {"kind": "Group", "group": {"name": "system:serviceaccounts"}}], **EVERYTHING}])
    fc = with_keys(FlowControl(settings([exempt_anon], [level("catch-all", 98)])))
    up = Gate()
    up.open.set()
    token = kit.sign(kit.sa_claims(), RSA) if token_ok else "garbage"
    r = token_request(token, "10.0.0.1:5000")
    assert await call(fc, r, up) == 200
    # a verified ServiceAccount may be exempted by policy; a token nobody could verify may not
    assert r.flow_schema == ("let-anonymous-in" if token_ok else "catch-all")
