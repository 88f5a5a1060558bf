"""CPU cost of the flow-control middleware per request, in process (no sockets, no backends).

Drives ``gatekeeper.proxy.flowcontrol.edge.middleware.FlowControl`` with the seeds'
policy (``deploy/examples/flowcontrol-seeds.yaml``) the way a protocol adapter
does (call the middleware, read the body, close it, ``finish()`` the response)
against an upstream that answers at once, and in the same run through a no-op
middleware, for four request mixes:

* ``get``: GET a configmap by a certificate user (``workload`` level, queued kind);
* ``admin``: the same by ``system:masters`` (``exempt`` level);
* ``list``: LIST secrets (``secrets-list`` level, 2 seats, coalescing key);
* ``burst``: 64 concurrent secret LISTs by 8 users (the 2-seat level: queues fill
  and drain, and a user's identical queued LISTs coalesce into one upstream call);
* ``sa``: the ``get`` request by a ServiceAccount bearer token (RS256, verified once, then the
  warm path: SHA-256 of the token and a cache lookup per request);
* ``badtok``: the ``get`` request by a made-up token (failed-token cache, shared per-address flow).

Then the cold path alone: µs per local verification of a fresh RS256 and ES256
ServiceAccount token (parse, signature, claims), no cache.

It prints requests/s for each, and flow control's added CPU per request
(``1/rate - 1/noop_rate``) plus the ratio of rates against the no-op
middleware measured alongside (rounds are interleaved; best of ``--rounds``).
To compare two versions of the code, run it with ``PYTHONPATH`` pointing at
each checkout and compare the ratios, never absolute figures across runs.

Run: ``.venv/bin/python loadtest/bench_flowcontrol.py [--requests 20000 --rounds 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from gatekeeper.kube import requestinfo
from gatekeeper.proxy.flowcontrol.edge.defaults import SEEDS_POLICY
from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings
from gatekeeper.proxy.identity.tokens.fetch import TokenIdentities
from gatekeeper.proxy.identity.tokens.settings import TokenSettings
from gatekeeper.proxy.messages import Handler, ProxyRequest, ProxyResponse, UserInfo
from gatekeeper.proxy.pipeline.stages import resolve_token

Middleware = Callable[[ProxyRequest, Handler], Awaitable[ProxyResponse]]
BODY = b'{"kind":"ConfigMap","apiVersion":"v1","metadata":{"name":"x","namespace":"default"}}'


async def upstream(request: ProxyRequest) -> ProxyResponse:
    async def body() -> AsyncIterator[bytes]:
        yield BODY

    return ProxyResponse(status=200, headers=[("content-type", "application/json")], body=body())


async def noop(request: ProxyRequest, next_handler: Handler) -> ProxyResponse:
    return await next_handler(request)


def make_request(target: str, user: UserInfo, headers: list[tuple[str, str]] | None = None) -> ProxyRequest:
    r = ProxyRequest(
        method="GET",
        target=target,
        headers=headers or [("accept", "application/json"), ("user-agent", "bench")],
        body=None,
        protocol="h2",
        peer="10.0.0.7:40000",
    )
    r.user = user
    r.info = requestinfo.parse("GET", target)
    return r


async def one(mw: Middleware, target: str, user: UserInfo, headers: list[tuple[str, str]] | None = None) -> None:
    """What an adapter does with one request: call, stream the body, close it, finish."""
    response = await mw(make_request(target, user, headers), upstream)
    async for _ in response.body:
        pass
    aclose = getattr(response.body, "aclose", None)
    if aclose is not None:
        await aclose()
    response.finish(None)


ALICE = UserInfo(name="alice", groups=["system:authenticated", "dev"], source="x509")
ADMIN = UserInfo(name="admin", groups=["system:masters", "system:authenticated"], source="x509")
USERS = [UserInfo(name=f"user-{i}", groups=["system:authenticated"], source="x509") for i in range(8)]
CM = "/api/v1/namespaces/default/configmaps/x"
SECRETS = "/api/v1/namespaces/default/secrets?limit=500"


def _token_user() -> UserInfo:
    return UserInfo(name="token:bench", source="token")


def _signed_tokens() -> tuple[dict[str, object], str, str, str]:
    """(JWKS, an RS256 token, an ES256 token, the issuer) from the test kit's real signer."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "identity"))
    import token_kit as kit

    rsa_key, ec_key = kit.rsa_key(), kit.ec_key()
    claims = kit.sa_claims("bench", "runner", ttl=86400)
    return kit.jwks(rsa_key, ec_key), kit.sign(claims, rsa_key), kit.sign(claims, ec_key), kit.ISSUER


JWKS, RS_TOKEN, ES_TOKEN, ISSUER = _signed_tokens()
SA_HEADERS = [("accept", "application/json"), ("authorization", f"Bearer {RS_TOKEN}")]
BAD_HEADERS = [("accept", "application/json"), ("authorization", "Bearer made-up-token")]


async def mix(name: str, mw: Middleware, n: int) -> float:
    """Seconds for ``n`` requests of mix ``name``."""
    t0 = time.perf_counter()
    if name == "burst":
        for _ in range(0, n, 64):
            await asyncio.gather(*(one(mw, SECRETS, USERS[j % 8]) for j in range(64)))
    elif name in ("sa", "badtok"):
        headers = SA_HEADERS if name == "sa" else BAD_HEADERS
        for _ in range(n):
            await one(mw, CM, _token_user(), headers)
    else:
        target, user = {"get": (CM, ALICE), "admin": (CM, ADMIN), "list": (SECRETS, ALICE)}[name]
        for _ in range(n):
            await one(mw, target, user)
    return time.perf_counter() - t0


async def main(requests: int, rounds: int) -> None:
    flow = FlowControl(FlowControlSettings(files=[str(SEEDS_POLICY)]))
    identities = TokenIdentities(TokenSettings())
    identities.verifier.set_keys(ISSUER, JWKS)

    async def fc(request: ProxyRequest, next_handler: Handler) -> ProxyResponse:
        """Flow control with what the front stage does for a token caller first (its identity)."""
        if request.user is not None and request.user.source == "token":
            await resolve_token(identities, request)
        return await flow(request, next_handler)

    mixes = ["get", "admin", "list", "burst", "sa", "badtok"]
    best: dict[tuple[str, str], float] = {}
    for name in mixes:  # warm up caches and code paths
        await mix(name, noop, 500)
        await mix(name, fc, 500)
    for _ in range(rounds):
        for name in mixes:
            for label, mw in (("noop", noop), ("fc", fc)):
                s = await mix(name, mw, requests)
                best[(name, label)] = min(best.get((name, label), float("inf")), s)
    print(f"{requests} requests per mix, best of {rounds} interleaved rounds")
    print(f"{'mix':6} {'no-op req/s':>12} {'fc req/s':>10} {'fc/no-op':>9} {'fc CPU us/req':>14}")
    for name in mixes:
        a, b = best[(name, "noop")], best[(name, "fc")]
        print(f"{name:6} {requests / a:12.0f} {requests / b:10.0f} {a / b:9.2f} {(b - a) / requests * 1e6:14.1f}")
    lv = flow.controller.levels
    assert all(x.idle for x in lv.values()), "every request must have given its seats back"
    cold_verify()


def cold_verify(n: int = 2000) -> None:
    """The cache-miss path: one full local verification per call."""
    from gatekeeper.proxy.identity.tokens.jwt import ServiceAccountVerifier

    v = ServiceAccountVerifier()
    v.set_keys(ISSUER, JWKS)
    now = time.time()
    for label, tok in (("RS256", RS_TOKEN), ("ES256", ES_TOKEN)):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(n):
                v.verify(tok, now)
            best = min(best, (time.perf_counter() - t0) / n)
        print(f"cold verify {label}: {best * 1e6:.1f} us per token (no cache)")


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    asyncio.run(main(args.requests, args.rounds))


if __name__ == "__main__":
    cli()
