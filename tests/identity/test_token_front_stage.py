"""Who a token caller is gets decided once, in the front stage, whether flow control runs or not.

Before, flow control resolved tokens: with ``flowControl.enabled: false`` a ServiceAccount's requests were not
verified, so they took the HTTP/1.1 upstream instead of the multiplexed one and their watches counted against
the token's text instead of the ServiceAccount. Flow control now only decides.
"""

from __future__ import annotations

import asyncio

import token_kit as kit

from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings
from gatekeeper.proxy.identity.tokens.fetch import TokenIdentities
from gatekeeper.proxy.identity.tokens.settings import TokenSettings
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.pipeline.stages import chain, front_for

RSA = kit.rsa_key()
SA = "system:serviceaccount:team-a:builder"


def identities() -> TokenIdentities:
    ids = TokenIdentities(TokenSettings())
    ids.verifier.set_keys(kit.ISSUER, kit.jwks(RSA))
    return ids


def token_request(token: str) -> ProxyRequest:
    return ProxyRequest(method="GET", target="/api/v1/namespaces/team-a/configmaps?watch=1",
                        headers=[("authorization", f"Bearer {token}")], body=None, protocol="h2",
                        peer="10.0.0.7:5000")


class Seen:
    """The dispatcher's place: what it would route on."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.requests: list[tuple[bool, str]] = []

    async def __call__(self, request: ProxyRequest) -> ProxyResponse:
        self.requests.append((request.token_verified, request.caller))
        return ProxyResponse(status=self.status, headers=[])


def test_a_serviceaccount_is_routed_the_same_with_flow_control_on_and_off() -> None:
    token = kit.sign(kit.sa_claims("team-a", "builder"), RSA)

    async def go() -> None:
        for with_flow_control in (False, True):
            seen = Seen()
            stages = [front_for([], identities=identities())]
            if with_flow_control:
                stages.append(FlowControl(FlowControlSettings()))
            resp = await chain(stages, seen)(token_request(token))
            resp.finish(None)
            assert seen.requests == [(True, SA)], (with_flow_control, seen.requests)
    asyncio.run(go())


def test_an_unverifiable_token_counts_as_its_address_with_flow_control_off_too() -> None:
    async def go() -> None:
        seen = Seen()
        await chain([front_for([], identities=identities())], seen)(token_request("made-up"))
        assert seen.requests == [(False, "unverified@10.0.0.7")]
    asyncio.run(go())


def test_a_token_the_apiserver_refuses_is_unverified_from_then_on() -> None:
    """Verified here (signature, expiry), refused upstream (revoked, or its pod is gone): the front stage
    remembers, so its next requests share the unverified flow instead of the ServiceAccount's."""
    token = kit.sign(kit.sa_claims("team-a", "builder"), RSA)

    async def go() -> None:
        ids = identities()
        refused = Seen(status=401)
        await chain([front_for([], identities=ids)], refused)(token_request(token))
        seen = Seen()
        await chain([front_for([], identities=ids)], seen)(token_request(token))
        assert refused.requests == [(True, SA)] and seen.requests == [(False, "unverified@10.0.0.7")]
    asyncio.run(go())
