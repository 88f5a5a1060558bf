"""The I/O edge against a local HTTP apiserver stand-in: key discovery, refresh limits, TokenReview budget.

The real apiservers are exercised in tests/flowcontrol/test_sandbox_tokens.py; this one
checks the defences that are hard to provoke there (key rotation, floods of unknown key
ids, the review budget) deterministically.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import token_kit as kit
from aiohttp import web
from prometheus_client import REGISTRY

from gatekeeper.proxy import tally
from gatekeeper.proxy.identity.tokens.fetch import TokenIdentities
from gatekeeper.proxy.identity.tokens.settings import TokenSettings

KEY_A, KEY_B = kit.rsa_key(), kit.rsa_key()


class FakeApiserver:
    def __init__(self) -> None:
        self.keys: list[kit.PrivateKey] = [KEY_A]
        self.hits = {"discovery": 0, "jwks": 0, "review": 0}
        self.remote_users: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/.well-known/openid-configuration", self.discovery)
        app.router.add_get("/openid/v1/jwks", self.jwks)
        app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", self.review)
        return app

    async def discovery(self, request: web.Request) -> web.Response:
        self.hits["discovery"] += 1
        return web.json_response({"issuer": kit.ISSUER, "jwks_uri": kit.ISSUER + "/openid/v1/jwks"})

    async def jwks(self, request: web.Request) -> web.Response:
        self.hits["jwks"] += 1
        assert request.headers["Accept"] == "application/jwk-set+json"
        return web.Response(text=json.dumps(kit.jwks(*self.keys)), content_type="application/jwk-set+json")

    async def review(self, request: web.Request) -> web.Response:
        self.hits["review"] += 1
        token = (await request.json())["spec"]["token"]
        await asyncio.sleep(0.01)
        if token.startswith("oidc-"):
            user = {"username": f"https://dex.example#{token}", "groups": ["oidc:dev", "system:authenticated"]}
            return web.json_response({"status": {"authenticated": True, "user": user}})
        return web.json_response({"status": {"authenticated": False, "error": "invalid"}})


class Upstream:
    """The slice of BackendClient the edge uses (``call``), over plain HTTP to the stand-in."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.name, self.url, self.session = "fake", url, session
        self.ssl_identity = None

    async def call(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes | None = None, *,
                   deadline: float, max_bytes: int) -> tuple[int, bytes]:
        async with self.session.request(method, self.url + path, headers=headers, data=body,
                                        timeout=aiohttp.ClientTimeout(total=deadline)) as resp:
            data = await resp.content.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise ValueError(f"{path} is larger than {max_bytes} bytes")
            return resp.status, data


@pytest.fixture
async def world() -> AsyncIterator[tuple[FakeApiserver, Any]]:
    fake = FakeApiserver()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    session = aiohttp.ClientSession()

    def identities(**kw: Any) -> TokenIdentities:
        ti = TokenIdentities(TokenSettings(**kw))
        ti.use_upstream([Upstream(f"http://127.0.0.1:{port}", session)])
        return ti

    try:
        yield fake, identities
    finally:
        await session.close()
        await runner.cleanup()


async def test_keys_are_fetched_at_start_and_refreshed_when_a_token_names_a_new_key(world) -> None:  # type: ignore[no-untyped-def]
    fake, identities = world
    ti = identities(jwks_min_refresh_seconds=0.05)
    await ti.start()
    try:
        assert fake.hits["jwks"] == 1 and ti.verifier.issuer == kit.ISSUER
        old = "Bearer " + kit.sign(kit.sa_claims("a", "x"), KEY_A)
        assert (await ti.resolve(old)).name == "system:serviceaccount:a:x"
        fake.keys = [KEY_A, KEY_B]  # the apiservers rotated in a new signing key
        await asyncio.sleep(0.06)
        rotated = "Bearer " + kit.sign(kit.sa_claims("b", "y"), KEY_B)
        assert ti.cached(rotated) is None
        who = await ti.resolve(rotated)
        assert who.verified and who.name == "system:serviceaccount:b:y"
        assert fake.hits["jwks"] == 2
    finally:
        await ti.close()


async def test_a_flood_of_unknown_key_ids_costs_one_fetch_per_period(world) -> None:  # type: ignore[no-untyped-def]
    fake, identities = world
    ti = identities(jwks_min_refresh_seconds=60)
    await ti.start()
    try:
        forged = ["Bearer " + kit.sign(kit.sa_claims(), KEY_A, kid=f"made-up-{i}") for i in range(200)]
        results = await asyncio.gather(*(ti.resolve(t) for t in forged))
        assert not any(r.verified for r in results)
        assert fake.hits["jwks"] == 1  # only the start-up fetch: within the period every refresh is skipped
    finally:
        await ti.close()


async def test_token_review_is_cached_single_flight_and_budgeted(world) -> None:  # type: ignore[no-untyped-def]
    fake, identities = world
    ti = identities(service_accounts=False, token_review=True, reviews_per_second=2)
    joined = REGISTRY.get_sample_value("gatekeeper_identity_tokens_total", {"outcome": "review-joined"}) or 0
    who = await asyncio.gather(*(ti.resolve("Bearer oidc-alice") for _ in range(10)))
    assert {w.name for w in who} == {"https://dex.example#oidc-alice"} and fake.hits["review"] == 1
    # the nine that waited for the one review are counted too
    assert REGISTRY.get_sample_value("gatekeeper_identity_tokens_total", {"outcome": "review-joined"}) == joined + 9
    cached = ti.cached("Bearer oidc-alice")
    assert cached is not None and cached.groups == ["oidc:dev", "system:authenticated"]
    # one review left in this second's budget: a burst of new tokens gets one review, the rest wait as unverified
    burst = await asyncio.gather(*(ti.resolve(f"Bearer oidc-{i}") for i in range(6)))
    assert sum(w.verified for w in burst) == 1 and fake.hits["review"] == 2
    assert not (await ti.resolve("Bearer nonsense")).verified
    assert ti.cached("Bearer nonsense") is None  # refused by the budget: not remembered, a later request may ask
    await asyncio.sleep(0.6)  # the bucket refills one review
    assert not (await ti.resolve("Bearer nonsense")).verified and fake.hits["review"] == 3
    negative = ti.cached("Bearer nonsense")  # the apiserver's "not authenticated" is remembered
    assert negative is not None and not negative.verified
    await ti.resolve("Bearer nonsense")
    assert fake.hits["review"] == 3


def _tokens_total(outcome: str) -> float:
    tally.flush()
    return REGISTRY.get_sample_value("gatekeeper_identity_tokens_total", {"outcome": outcome}) or 0


async def test_a_header_that_is_no_bearer_token_counts_as_not_bearer_on_the_warm_path(world) -> None:  # type: ignore[no-untyped-def]
    _, identities = world
    ti = identities(service_accounts=False)
    before = {k: _tokens_total(k) for k in ("not-bearer", "failed-cached", "cached")}
    for _ in range(3):
        hit = ti.cached("Basic YWxpY2U6c2VjcmV0")
        assert hit is not None and not hit.verified
    after = {k: _tokens_total(k) for k in before}
    assert after["not-bearer"] - before["not-bearer"] == 3
    assert after["failed-cached"] == before["failed-cached"] and after["cached"] == before["cached"]
