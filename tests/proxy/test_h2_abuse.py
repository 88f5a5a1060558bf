"""HTTP/2 abuse limits, in memory: floods end in GOAWAY ENHANCE_YOUR_CALM, resets cannot outrun the stream cap.

Hostile frames are written by hand with hyperframe where the client-side h2
would refuse to send them. Limits are set low so each test is fast; the
defaults (far higher) are what a real cluster runs with.
"""

from __future__ import annotations

import asyncio

from edge_kit import chunks, rejected
from h2.errors import ErrorCodes
from hyperframe.frame import ContinuationFrame, DataFrame, HeadersFrame, PingFrame, RstStreamFrame, SettingsFrame

from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import ProtocolSettings

REQ = [(":method", "GET"), (":scheme", "https"), (":path", "/api/v1/pods"), (":authority", "proxy.test")]


async def _ok(req: ProxyRequest) -> ProxyResponse:
    return ProxyResponse(200, [], chunks(b"ok"))


def _calm(pair) -> bool:
    return any(g.error_code == ErrorCodes.ENHANCE_YOUR_CALM for g in pair.goaways)


async def test_ping_flood_gets_goaway_enhance_your_calm_and_close(h2pair):
    before = rejected("h2_flood_ping")
    pair = h2pair(_ok, ProtocolSettings(h2_max_pings_per_interval=20))
    await pair.settle()
    flood = b"".join(PingFrame(0, opaque_data=i.to_bytes(8, "big")).serialize() for i in range(200))
    pair.server.data_received(flood)
    await pair.until(lambda: pair.transport_closed.is_set())
    assert _calm(pair)
    assert rejected("h2_flood_ping") == before + 1


async def test_settings_flood_gets_goaway_enhance_your_calm(h2pair):
    pair = h2pair(_ok, ProtocolSettings(h2_max_settings_per_interval=10))
    await pair.settle()
    pair.server.data_received(SettingsFrame(0, settings={4: 65535}).serialize() * 100)
    await pair.until(lambda: pair.transport_closed.is_set())
    assert _calm(pair)


async def test_pings_under_the_limit_are_answered(h2pair):
    pair = h2pair(_ok, ProtocolSettings(h2_max_pings_per_interval=20))
    await pair.settle()
    for i in range(10):
        pair.client.ping(i.to_bytes(8, "big"))
    pair.pump()
    sid = pair.request()
    await pair.until(lambda: pair.ended(sid))
    assert pair.goaways == [] and not pair.transport_closed.is_set()


async def test_rapid_reset_is_cut_and_starts_few_handlers(h2pair):
    """CVE-2023-44487: HEADERS+RST_STREAM pairs must not each start upstream work."""
    started = 0

    async def handler(req: ProxyRequest) -> ProxyResponse:
        nonlocal started
        started += 1
        await asyncio.sleep(0.01)
        return ProxyResponse(200, [], chunks(b"ok"))

    pairs = 5000
    pair = h2pair(handler, ProtocolSettings(h2_max_resets_per_interval=500, max_concurrent_streams=100))
    await pair.settle()
    sent = 0
    for i in range(pairs):
        if pair.transport_closed.is_set():
            break
        sid = 1 + 2 * i
        raw = HeadersFrame(sid, data=pair.client.encoder.encode(REQ), flags=["END_HEADERS", "END_STREAM"])
        raw_rst = RstStreamFrame(sid, error_code=ErrorCodes.CANCEL)
        pair.server.data_received(raw.serialize() + raw_rst.serialize())
        sent += 1
        if i % 50 == 0:
            await asyncio.sleep(0)  # let handlers that did start run, as a real event loop would
    await pair.until(lambda: pair.transport_closed.is_set())
    assert _calm(pair)
    assert sent <= 600, f"connection still open after {sent} HEADERS+RST pairs"
    assert started < sent // 2, f"{started} handlers started for {sent} reset streams"


async def test_reset_stream_keeps_its_slot_until_its_handler_finished(h2pair):
    release = asyncio.Event()
    unwinding = 0
    started: list[int | None] = []

    async def handler(req: ProxyRequest) -> ProxyResponse:
        nonlocal unwinding
        started.append(req.stream_id)
        if len(started) > 2:
            return ProxyResponse(200, [], chunks(b"ok"))
        try:
            await asyncio.Event().wait()
        finally:
            unwinding += 1
            await asyncio.shield(release.wait())  # cleanup (closing an upstream, a seat) still running
        raise AssertionError("unreachable")

    pair = h2pair(handler, ProtocolSettings(max_concurrent_streams=2))
    await pair.settle()
    a, b = pair.request(), pair.request()
    await pair.settle()
    pair.client.reset_stream(a, ErrorCodes.CANCEL)
    pair.client.reset_stream(b, ErrorCodes.CANCEL)
    pair.pump()
    await pair.until(lambda: unwinding == 2)
    c = pair.request()
    await pair.until(lambda: pair.reset(c) is not None)
    assert pair.reset(c).error_code == ErrorCodes.REFUSED_STREAM
    release.set()
    await pair.until(lambda: pair.server.open_streams == 0)
    d = pair.request()
    await pair.until(lambda: pair.ended(d))
    assert pair.status(d) == 200 and started == [a, b, d]


async def test_zero_length_data_frames_do_not_pile_up_in_the_inbox(h2pair):
    gate = asyncio.Event()

    async def handler(req: ProxyRequest) -> ProxyResponse:
        await gate.wait()  # the pipeline is busy and does not read the body yet
        return ProxyResponse(200, [], chunks(b"ok"))

    pair = h2pair(handler, ProtocolSettings(h2_max_empty_frames_per_interval=10_000))
    await pair.settle()
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, [(":method", "POST"), *REQ[1:]])
    pair.pump()
    pair.server.data_received(DataFrame(sid, data=b"").serialize() * 2000)
    await pair.settle()
    stream = pair.server._streams[sid]
    assert len(stream.inbox) == 0
    gate.set()


async def test_empty_data_flood_gets_goaway(h2pair):
    pair = h2pair(_ok, ProtocolSettings(h2_max_empty_frames_per_interval=100))
    await pair.settle()
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, [(":method", "POST"), *REQ[1:]])
    pair.pump()
    pair.server.data_received(DataFrame(sid, data=b"").serialize() * 1000)
    await pair.until(lambda: pair.transport_closed.is_set())
    assert _calm(pair)


async def test_frames_on_closed_streams_flood_gets_goaway(h2pair):
    before = rejected("h2_flood_closed_stream")
    pair = h2pair(_ok, ProtocolSettings(h2_max_closed_stream_frames_per_interval=50,
                                        h2_max_resets_per_interval=10_000))
    await pair.settle()
    sid = pair.request()
    await pair.until(lambda: pair.ended(sid))
    # Each RST_STREAM on the finished stream would otherwise cost a dispatch, forever.
    pair.server.data_received(RstStreamFrame(sid, error_code=0).serialize() * 500)
    await pair.until(lambda: pair.transport_closed.is_set())
    assert _calm(pair)
    assert rejected("h2_flood_closed_stream") == before + 1


async def test_continuation_flood_is_bounded(h2pair):
    """CVE-2024-27316: endless CONTINUATION frames for one header block end the connection."""
    pair = h2pair(_ok)
    await pair.settle()
    block = pair.client.encoder.encode(REQ)
    flood = HeadersFrame(1, data=block[:4]).serialize()
    flood += b"".join(ContinuationFrame(1, data=b"").serialize() for _ in range(5000))
    pair.server.data_received(flood)
    await pair.until(lambda: pair.transport_closed.is_set())
    assert pair.goaways and pair.goaways[-1].error_code in (ErrorCodes.PROTOCOL_ERROR, ErrorCodes.ENHANCE_YOUR_CALM)


async def test_window_zero_client_gets_stream_reset_after_stall_timeout(h2pair):
    finished: list[BaseException | None] = []

    async def handler(req: ProxyRequest) -> ProxyResponse:
        resp = ProxyResponse(200, [], chunks(b"x" * 1000))
        resp.on_complete.append(finished.append)
        return resp

    before = rejected("response_stall")
    pair = h2pair(handler, ProtocolSettings(response_stall_timeout_seconds=0.3), client_window=0)
    await pair.settle()
    loop = asyncio.get_running_loop()
    start = loop.time()
    sid = pair.request()
    await pair.until(lambda: pair.reset(sid) is not None, limit=5)
    assert pair.reset(sid).error_code == ErrorCodes.CANCEL
    assert 0.25 <= loop.time() - start < 3
    await pair.until(lambda: len(finished) == 1)
    assert finished[0] is not None, "the pipeline must learn the response was cut (seat, upstream released)"
    await pair.until(lambda: pair.server.open_streams == 0)
    assert rejected("response_stall") == before + 1
