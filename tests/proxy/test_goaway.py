"""Graceful GOAWAY on the HTTP/2 adapter (in memory) and the goawayChance decision."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
from h2.errors import ErrorCodes
from prometheus_client import REGISTRY

from gatekeeper.proxy.adapter import ClientGone
from gatekeeper.proxy.listen.goaway import GoawayDecider, should_goaway
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import ProtocolSettings


def _metric(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


# ---------------------------------------------------------------- the decision


def test_goaway_decision_is_deterministic_with_seeded_rng():
    a = GoawayDecider(0.3, random.Random(42).random)
    b = GoawayDecider(0.3, random.Random(42).random)
    seq_a = [a.decide() for _ in range(200)]
    assert seq_a == [b.decide() for _ in range(200)]
    assert 30 <= sum(seq_a) <= 90  # ~0.3 of 200, and not all-or-nothing


def test_goaway_decision_compares_draw_with_chance():
    assert should_goaway(0.02, 0.0199)
    assert not should_goaway(0.02, 0.02)
    assert not should_goaway(0.0, 0.0)
    draws = iter([0.5, 0.001])
    d = GoawayDecider(0.01, lambda: next(draws))
    assert [d.decide(), d.decide()] == [False, True]


def test_disabled_chance_never_draws():
    def boom() -> float:
        raise AssertionError("rng must not be consulted when goawayChance is 0")

    assert GoawayDecider(0.0, boom).decide() is False


def test_goaway_chance_above_limit_needs_test_override():
    with pytest.raises(ValueError, match=r"0\.02"):
        ProtocolSettings(goaway_chance=0.5).validate()
    ProtocolSettings(goaway_chance=0.5, allow_unsafe_goaway_chance=True).validate()


# ---------------------------------------------------------------- graceful GOAWAY (h2)


async def test_inflight_stream_completes_after_goaway(h2pair):
    release = asyncio.Event()
    finishes: list[BaseException | None] = []

    async def handler(req: ProxyRequest) -> ProxyResponse:
        await release.wait()
        resp = ProxyResponse(200, [], _chunks(b"part1-", b"part2"))
        resp.on_complete.append(finishes.append)
        return resp

    pair = h2pair(handler)
    s1 = pair.request()
    s3 = pair.request()
    await pair.until(lambda: pair.server.open_streams == 2)
    pair.server.goaway("shutdown")
    assert len(pair.goaways) == 1
    assert pair.goaways[0].last_stream_id == s3 and pair.goaways[0].error_code == 0
    await pair.settle()
    assert not pair.transport_closed.is_set(), "closed while streams were in flight"
    release.set()
    await pair.until(lambda: pair.transport_closed.is_set())
    for sid in (s1, s3):
        assert pair.status(sid) == 200 and pair.body(sid) == b"part1-part2" and pair.ended(sid)
        assert pair.reset(sid) is None
    assert finishes == [None, None]
    # the final GOAWAY (the codec's close_connection) repeats the same last stream id
    assert [g.last_stream_id for g in pair.goaways] == [s3, s3]
    assert pair.bytes_after_close == 0


async def test_new_stream_above_last_id_is_refused(h2pair):
    release = asyncio.Event()
    served: list[str] = []

    async def handler(req: ProxyRequest) -> ProxyResponse:
        served.append(req.target)
        await release.wait()
        return ProxyResponse(200, [], _chunks(b"ok"))

    before = _metric("gatekeeper_proxy_refused_streams_total")
    pair = h2pair(handler)
    s1 = pair.request("GET", "/first")
    await pair.until(lambda: served == ["/first"])
    pair.server.goaway("chance")
    late = pair.request("GET", "/late")  # the client had not seen our GOAWAY yet
    await pair.until(lambda: pair.reset(late) is not None)
    reset = pair.reset(late)
    assert reset is not None and reset.error_code == ErrorCodes.REFUSED_STREAM
    assert served == ["/first"]
    assert _metric("gatekeeper_proxy_refused_streams_total") == before + 1
    release.set()
    await pair.until(lambda: pair.ended(s1))
    assert pair.body(s1) == b"ok"


async def test_long_running_stream_is_cut_at_drain_deadline(h2pair):
    finishes: list[BaseException | None] = []

    async def watch() -> AsyncIterator[bytes]:
        while True:
            yield b'{"type":"ADDED"}\n'
            await asyncio.sleep(0.01)

    async def handler(req: ProxyRequest) -> ProxyResponse:
        resp = ProxyResponse(200, [], watch())
        resp.on_complete.append(finishes.append)
        return resp

    pair = h2pair(handler, ProtocolSettings(drain_timeout_seconds=0.3))
    sid = pair.request("GET", "/api/v1/pods?watch=true")
    await pair.until(lambda: len(pair.body(sid)) > 0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    pair.server.goaway("chance")
    await asyncio.sleep(0.15)
    assert not pair.transport_closed.is_set()
    grown = len(pair.body(sid))
    await pair.until(lambda: pair.transport_closed.is_set())
    assert loop.time() - started >= 0.3
    assert grown > 0 and len(pair.body(sid)) >= grown  # the watch kept streaming during the drain
    assert len(finishes) == 1 and isinstance(finishes[0], ClientGone)
    # cut by closing the connection (final GOAWAY), not by resetting the stream: client-go
    # reads that as a probable EOF and re-watches quietly
    assert pair.reset(sid) is None and not pair.ended(sid)
    assert len(pair.goaways) == 2 and pair.goaways[1].last_stream_id == sid


async def test_goaway_chance_fires_after_response_completes(h2pair):
    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(200, [], _chunks(b"a", b"b"))

    before = _metric("gatekeeper_proxy_goaway_sent_total", {"reason": "chance"})
    settings = ProtocolSettings(goaway_chance=0.5, allow_unsafe_goaway_chance=True)
    draws = iter([0.9, 0.1])  # first response: no; second: yes
    pair = h2pair(handler, settings, rng=lambda: next(draws))
    s1 = pair.request()
    await pair.until(lambda: pair.ended(s1))
    await pair.settle()
    assert pair.goaways == []
    s3 = pair.request()
    await pair.until(lambda: pair.transport_closed.is_set())
    assert pair.ended(s3) and pair.body(s3) == b"ab"
    assert pair.goaways[0].last_stream_id == s3 and pair.goaways[0].error_code == 0
    assert _metric("gatekeeper_proxy_goaway_sent_total", {"reason": "chance"}) == before + 1


async def test_second_goaway_only_shortens_the_deadline(h2pair):
    async def watch() -> AsyncIterator[bytes]:
        while True:
            yield b"."
            await asyncio.sleep(0.01)

    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(200, [], watch())

    pair = h2pair(handler, ProtocolSettings(drain_timeout_seconds=60))
    sid = pair.request()
    await pair.until(lambda: len(pair.body(sid)) > 0)
    pair.server.goaway("chance")
    pair.server.goaway("shutdown", drain_timeout=0.1)  # SIGTERM while draining a chance GOAWAY
    await pair.until(lambda: pair.transport_closed.is_set(), limit=3)
    assert len(pair.goaways) == 2  # one graceful, one final; no duplicate graceful frame


async def test_stream_above_last_id_already_reset_by_client_keeps_connection(h2pair):
    """Go cancels streams above a GOAWAY's last id itself; HEADERS+RST then arrive together."""
    release = asyncio.Event()

    async def handler(req: ProxyRequest) -> ProxyResponse:
        await release.wait()
        return ProxyResponse(200, [], _chunks(b"done"))

    pair = h2pair(handler)
    s1 = pair.request()
    await pair.until(lambda: pair.server.open_streams == 1)
    pair.server.goaway("chance")
    late = pair.client.get_next_available_stream_id()
    pair.client.send_headers(late, [(":method", "GET"), (":path", "/late"), (":scheme", "https"),
                                    (":authority", "p")], end_stream=True)
    pair.client.reset_stream(late, ErrorCodes.CANCEL)
    pair.pump()
    await pair.settle()
    assert not pair.transport_closed.is_set()
    release.set()
    await pair.until(lambda: pair.transport_closed.is_set())
    assert pair.body(s1) == b"done" and pair.ended(s1)
