"""Request DATA the proxy holds is bounded for the whole process (``maxBufferedRequestBytes``), not per connection.

In memory, on both HTTP/2 engines: two client connections share one
``RequestBodyBudget`` as every connection of a proxy process does.
"""

from __future__ import annotations

import asyncio

from edge_kit import chunks, rejected
from h2.errors import ErrorCodes
from prometheus_client import REGISTRY

from gatekeeper.proxy.listen.body_budget import RequestBodyBudget
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import ProtocolSettings

WINDOW = 16384


class _Gate:
    """Handlers that read their body only once released (a request queued for a flow-control seat)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.bodies: dict[str, bytes] = {}

    async def __call__(self, req: ProxyRequest) -> ProxyResponse:
        await self.release.wait()
        got = b""
        assert req.body is not None
        async for chunk in req.body:
            got += chunk
        self.bodies[req.target] = got
        return ProxyResponse(200, [], chunks(b"ok"))


async def test_past_the_limit_the_connection_over_its_fair_share_is_refused_not_a_small_uploader(h2pair):
    budget = RequestBodyBudget(40_000)
    gate = _Gate()
    settings = ProtocolSettings(stream_window_bytes=WINDOW)
    a = h2pair(gate, settings, body_budget=budget)  # parks bodies (queued requests)
    b = h2pair(gate, settings, body_budget=budget)  # one ordinary upload
    await a.settle()
    await b.settle()
    before = rejected("body_budget")
    held = [a.request("POST", f"/a/{i}", open_body=True) for i in range(2)]
    for sid in held:
        a.client.send_data(sid, b"a" * 15_000, end_stream=True)
        a.pump()
    await a.until(lambda: budget.held == 30_000)
    small = b.request("POST", "/b/small", open_body=True)
    b.client.send_data(small, b"b" * WINDOW, end_stream=True)  # past the limit, but b is under its share
    b.pump()
    await b.until(lambda: budget.held == 30_000 + WINDOW)
    assert b.reset(small) is None and rejected("body_budget") == before
    more = a.request("POST", "/a/more", open_body=True)
    a.client.send_data(more, b"m" * 15_000)  # a holds 30000, over its share of 40000 / 2
    a.pump()
    await a.until(lambda: a.reset(more) is not None)
    assert a.reset(more).error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert budget.held == 30_000 + WINDOW, "the refused DATA is not held, the rest is untouched"
    assert rejected("body_budget") == before + 1
    gate.release.set()
    await a.until(lambda: all(a.ended(s) for s in held) and b.ended(small))
    assert gate.bodies == {"/a/0": b"a" * 15_000, "/a/1": b"a" * 15_000, "/b/small": b"b" * WINDOW}
    assert budget.held == 0 and budget.holders == 0, "every byte taken was given back"


def test_the_budget_never_holds_more_than_twice_its_limit_and_refuses_the_biggest_holder():
    budget = RequestBodyBudget(100_000, gauge=None)
    shares = []
    for _ in range(20):  # each newcomer takes all its share allows: limit, limit/2, limit/3, ...
        share = budget.share()
        shares.append(share)
        while share.take(1_000):
            assert budget.held <= 2 * budget.limit
    assert budget.held == sum(s.held for s in shares) == 2 * budget.limit
    assert shares[0].held == budget.limit and not shares[0].take(1), "the biggest holder is refused"
    for share in shares:
        share.give(share.held)
    assert budget.held == 0 and budget.holders == 0


async def test_cut_and_unread_bodies_give_their_bytes_back_and_the_gauge_follows(h2pair):
    budget = RequestBodyBudget(1 << 20)  # the process gauge, as a proxy process has it

    async def early(req: ProxyRequest) -> ProxyResponse:
        await asyncio.sleep(0.05)  # the body arrives meanwhile and is never read
        return ProxyResponse(429, [("retry-after", "1")], chunks(b"busy"))

    pair = h2pair(early, ProtocolSettings(stream_window_bytes=WINDOW), body_budget=budget)
    await pair.settle()
    answered = pair.request("POST", "/busy", open_body=True)
    pair.client.send_data(answered, b"x" * 10_000)
    pair.pump()
    await pair.until(lambda: budget.held == 10_000)
    assert REGISTRY.get_sample_value("gatekeeper_proxy_buffered_request_bytes") == 10_000
    cut = pair.request("POST", "/cut", open_body=True)
    pair.client.send_data(cut, b"y" * 7_000)
    pair.pump()
    await pair.until(lambda: budget.held == 17_000)
    pair.client.reset_stream(cut, ErrorCodes.CANCEL)
    pair.pump()
    await pair.until(lambda: pair.server.open_streams == 0)
    assert pair.status(answered) == 429
    assert budget.held == 0
    assert REGISTRY.get_sample_value("gatekeeper_proxy_buffered_request_bytes") == 0
