"""Header blocks in progress (HEADERS without END_HEADERS, CONTINUATION trickled) count in the request buffer budget.

The codec counts them, as frames arrive, in the same per-process budget as unread request
DATA (``maxBufferedRequestBytes``): a connection over its share is ended with GOAWAY
ENHANCE_YOUR_CALM, reason ``body_budget``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import hpack
from edge_kit import rejected
from h2.errors import ErrorCodes
from hyperframe.frame import ContinuationFrame, HeadersFrame, SettingsFrame

from gatekeeper.proxy.listen.body_budget import RequestBodyBudget
from gatekeeper.proxy.listen.h2_codec import EV_REQUEST, H2ServerCodec
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import ProtocolSettings

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize()


async def _ok(req: ProxyRequest) -> ProxyResponse:
    async def body() -> AsyncIterator[bytes]:
        yield b"ok"
    return ProxyResponse(200, [], body())


def _partial(sid: int, size: int) -> bytes:
    """HEADERS without END_HEADERS: its block is not decoded until the block ends, so any bytes do."""
    return HeadersFrame(sid, data=b"\x00" * size).serialize()


def _more(sid: int, size: int) -> bytes:
    return ContinuationFrame(sid, data=b"\x00" * size).serialize()


def test_a_header_block_is_held_while_in_progress_and_given_back_when_it_ends():
    budget = RequestBodyBudget(1 << 20, gauge=None)
    conn = H2ServerCodec(header_budget=budget.share(), max_header_list=1 << 16)
    conn.initiate_connection()
    conn.receive_data(PREFACE)
    block = hpack.Encoder().encode([(":method", "GET"), (":scheme", "https"), (":path", "/api/v1/pods"),
                                    (":authority", "proxy.test"), ("x-pad", "p" * 300)])
    first, rest = block[:200], block[200:]
    assert conn.receive_data(HeadersFrame(1, data=first, flags={"END_STREAM"}).serialize()) == []
    assert budget.held == len(first)
    events = conn.receive_data(ContinuationFrame(1, data=rest, flags={"END_HEADERS"}).serialize())
    assert [e[0] for e in events] == [EV_REQUEST]
    assert budget.held == 0 and budget.holders == 0


async def test_a_connection_trickling_header_blocks_past_its_share_is_ended_and_gives_everything_back(h2pair):
    budget = RequestBodyBudget(40_000)
    a = h2pair(_ok, ProtocolSettings(), body_budget=budget)
    b = h2pair(_ok, ProtocolSettings(), body_budget=budget)
    await a.settle()
    await b.settle()
    before = rejected("body_budget")
    a.server.data_received(_partial(1, 16_000) + _more(1, 14_000))
    b.server.data_received(_partial(1, 16_000))  # past the limit, but b is under its share (40000 / 2)
    await a.settle()
    assert budget.held == 46_000 and not b.transport_closed.is_set()
    a.server.data_received(_more(1, 5_000))  # a holds 30000, over its share
    await a.until(lambda: a.transport_closed.is_set())
    assert a.goaways and a.goaways[-1].error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert rejected("body_budget") == before + 1
    assert budget.held == 16_000, "the ended connection's block is given back, the other's stays"
    assert not b.transport_closed.is_set()
    b.server.connection_lost()
    assert budget.held == 0 and budget.holders == 0


async def test_a_finished_header_block_gives_its_bytes_back_through_the_adapter(h2pair):
    budget = RequestBodyBudget(1 << 20)
    pair = h2pair(_ok, ProtocolSettings(), body_budget=budget)
    await pair.settle()
    block = hpack.Encoder().encode([(":method", "GET"), (":scheme", "https"), (":path", "/api/v1/pods"),
                                    (":authority", "proxy.test"), ("x-pad", "p" * 300)])
    first, rest = block[:200], block[200:]
    pair.server.data_received(HeadersFrame(1, data=first, flags={"END_STREAM"}).serialize())
    assert budget.held == len(first)
    pair.server.data_received(ContinuationFrame(1, data=rest, flags={"END_HEADERS"}).serialize())
    assert budget.held == 0 and budget.holders == 0
    await pair.settle()
    assert not pair.transport_closed.is_set()
