"""HTTP/2 adapter driven in memory by a client ``H2Connection`` (no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
from h2.errors import ErrorCodes
from h2.events import DataReceived
from prometheus_client import REGISTRY

from gatekeeper.proxy.adapter import ClientGone
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import ProtocolSettings


def _finished(response: ProxyResponse) -> list[BaseException | None]:
    calls: list[BaseException | None] = []
    response.on_complete.append(calls.append)
    return calls


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def test_request_maps_authority_to_host_and_drops_pseudo_headers(h2pair):
    seen: list[ProxyRequest] = []
    finishes: list[BaseException | None] = []

    async def handler(req: ProxyRequest) -> ProxyResponse:
        seen.append(req)
        resp = ProxyResponse(200, [("content-type", "text/plain")], _chunks(b"hello ", b"world"))
        resp.on_complete.append(finishes.append)
        return resp

    pair = h2pair(handler)
    sid = pair.request("GET", "/api/v1/namespaces/a/pods?watch=true&x=%2F",
                       headers=[("cookie", "a=1"), ("cookie", "b=2"), ("accept", "application/json")])
    await pair.until(lambda: pair.ended(sid))
    req = seen[0]
    assert (req.method, req.target, req.protocol, req.stream_id) == (
        "GET", "/api/v1/namespaces/a/pods?watch=true&x=%2F", "h2", sid)
    assert req.body is None
    assert ("host", "proxy.test") in req.headers
    assert all(not k.startswith(":") for k, _ in req.headers)
    assert req.header("cookie") == "a=1; b=2"
    assert pair.status(sid) == 200
    assert pair.body(sid) == b"hello world"
    assert finishes == [None]


async def test_handler_exception_becomes_502_status_json(h2pair):
    async def handler(req: ProxyRequest) -> ProxyResponse:
        raise RuntimeError("backend pool exploded")

    pair = h2pair(handler)
    sid = pair.request()
    await pair.until(lambda: pair.ended(sid))
    assert pair.status(sid) == 502
    status = orjson.loads(pair.body(sid))
    assert status["kind"] == "Status" and status["code"] == 502
    assert "backend pool exploded" not in status["message"]  # exception text stays in the log
    assert "Traceback" not in status["message"]


async def test_head_204_and_304_are_sent_without_body(h2pair):
    async def handler(req: ProxyRequest) -> ProxyResponse:
        code = {"/head": 200, "/nc": 204, "/nm": 304}[req.target]
        return ProxyResponse(code, [("content-length", "5")], _chunks(b"oops!"))

    pair = h2pair(handler)
    ids = [pair.request("HEAD", "/head"), pair.request("GET", "/nc"), pair.request("GET", "/nm")]
    await pair.until(lambda: all(pair.ended(s) for s in ids))
    assert [pair.status(s) for s in ids] == [200, 204, 304]
    assert [pair.body(s) for s in ids] == [b"", b"", b""]


async def test_hop_by_hop_response_headers_are_dropped(h2pair):
    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(200, [("connection", "keep-alive"), ("transfer-encoding", "chunked"),
                                   ("x-kept", "yes")], _chunks(b"ok"))

    pair = h2pair(handler)
    sid = pair.request()
    await pair.until(lambda: pair.ended(sid))
    resp = pair.response(sid)
    assert resp is not None
    names = {k for k, _ in resp.headers}
    assert b"x-kept" in names and b"connection" not in names and b"transfer-encoding" not in names


async def test_request_body_window_reopens_only_as_pipeline_consumes(h2pair):
    """The client can send one stream window; more only after the handler takes chunks."""
    window = 16384
    release = asyncio.Event()
    received: list[int] = []

    async def handler(req: ProxyRequest) -> ProxyResponse:
        await release.wait()
        assert req.body is not None
        total = 0
        async for chunk in req.body:
            total += len(chunk)
        received.append(total)
        return ProxyResponse(200, [], _chunks(str(total).encode()))

    pair = h2pair(handler, ProtocolSettings(stream_window_bytes=window))
    await pair.settle()
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, [(":method", "POST"), (":path", "/api/v1/namespaces/a/configmaps"),
                                   (":scheme", "https"), (":authority", "p")])
    payload = b"z" * (window * 3)
    sent = 0
    pair.client.send_data(sid, payload[:window])
    sent += window
    pair.pump()
    await pair.settle()
    # Nothing consumed yet: the server must not have reopened the stream window.
    assert pair.client.local_flow_control_window(sid) == 0
    release.set()
    while sent < len(payload):
        await pair.until(lambda: pair.client.local_flow_control_window(sid) > 0)
        n = min(pair.client.local_flow_control_window(sid), len(payload) - sent,
                pair.client.max_outbound_frame_size)
        pair.client.send_data(sid, payload[sent:sent + n])
        sent += n
        pair.pump()
    pair.client.end_stream(sid)
    pair.pump()
    await pair.until(lambda: pair.ended(sid))
    assert received == [len(payload)]
    assert pair.body(sid) == str(len(payload)).encode()


async def test_response_never_exceeds_small_client_window_nor_pulls_ahead(h2pair):
    pulls = 0
    chunk = b"y" * 600

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulls
        for _ in range(10):
            pulls += 1
            yield chunk

    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(200, [], body())

    pair = h2pair(handler, client_window=1200)  # exactly two chunks
    sid = pair.request()
    await pair.until(lambda: len(pair.body(sid)) >= 1200)
    await pair.settle(50)
    assert len(pair.body(sid)) == 1200, "sent beyond the client's stream window"
    assert pulls == 2, f"pulled {pulls} chunks for a window that holds two"
    while not pair.ended(sid):
        pair.ack(sid)
        await pair.settle()
    assert pair.body(sid) == chunk * 10
    assert pulls == 10


async def test_client_reset_cancels_handler_and_finishes_response(h2pair):
    handler_cancelled = asyncio.Event()
    body_closed = asyncio.Event()
    responses: list[ProxyResponse] = []
    finishes: list[BaseException | None] = []

    async def endless() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"event\n"
                await asyncio.sleep(0.01)
        finally:
            body_closed.set()

    async def handler(req: ProxyRequest) -> ProxyResponse:
        if req.target == "/slow":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                handler_cancelled.set()
                raise
        resp = ProxyResponse(200, [], endless())
        resp.on_complete.append(finishes.append)
        responses.append(resp)
        return resp

    pair = h2pair(handler)
    watch = pair.request("GET", "/watch")
    slow = pair.request("GET", "/slow")
    await pair.until(lambda: len(pair.body(watch)) > 0)
    pair.client.reset_stream(watch, ErrorCodes.CANCEL)
    pair.client.reset_stream(slow, ErrorCodes.CANCEL)
    pair.pump()
    await pair.until(lambda: handler_cancelled.is_set() and body_closed.is_set() and finishes)
    assert len(finishes) == 1 and isinstance(finishes[0], ClientGone)
    await pair.until(lambda: pair.server.open_streams == 0)


async def test_many_concurrent_streams_are_served_concurrently(h2pair):
    n = 60
    arrived = 0
    all_in = asyncio.Event()

    async def handler(req: ProxyRequest) -> ProxyResponse:
        nonlocal arrived
        arrived += 1
        if arrived == n:
            all_in.set()
        await all_in.wait()  # only returns once all n streams are in flight at once
        return ProxyResponse(200, [], _chunks(req.target.encode()))

    pair = h2pair(handler, ProtocolSettings(max_concurrent_streams=100))
    await pair.settle()
    ids = [pair.request("GET", f"/s/{i}") for i in range(n)]
    await pair.until(lambda: all(pair.ended(s) for s in ids))
    assert [pair.body(s) for s in ids] == [f"/s/{i}".encode() for i in range(n)]


async def test_large_header_block_is_accepted(h2pair):
    seen: list[ProxyRequest] = []

    async def handler(req: ProxyRequest) -> ProxyResponse:
        seen.append(req)
        return ProxyResponse(200, [], _chunks(b"ok"))

    big = "a" * 300_000  # spans many CONTINUATION frames
    pair = h2pair(handler)
    encode = pair.client.encoder.encode
    pair.client.encoder.encode = lambda headers, huffman=True: encode(headers, huffman=False)  # speed only
    await pair.settle()
    sid = pair.request(headers=[("authorization", "Bearer " + big)])
    await pair.until(lambda: pair.ended(sid))
    assert seen[0].header("authorization") == "Bearer " + big


async def test_connection_lost_finishes_inflight_responses(h2pair):
    finishes: list[BaseException | None] = []

    async def endless() -> AsyncIterator[bytes]:
        while True:
            yield b"x"
            await asyncio.sleep(0.01)

    async def handler(req: ProxyRequest) -> ProxyResponse:
        resp = ProxyResponse(200, [], endless())
        resp.on_complete.append(finishes.append)
        return resp

    pair = h2pair(handler)
    sid = pair.request()
    await pair.until(lambda: len(pair.body(sid)) > 0)
    pair.server.connection_lost()
    await pair.until(lambda: bool(finishes))
    assert isinstance(finishes[0], ClientGone)
    assert pair.server.closed.is_set()


async def test_idle_connection_gets_goaway_and_closes(h2pair):
    before = REGISTRY.get_sample_value("gatekeeper_proxy_goaway_sent_total", {"reason": "idle"}) or 0.0

    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(200, [], _chunks(b"ok"))

    pair = h2pair(handler, ProtocolSettings(idle_timeout_seconds=0.05))
    sid = pair.request()
    await pair.until(lambda: pair.ended(sid))
    await pair.until(lambda: pair.transport_closed.is_set())
    assert pair.goaways and pair.goaways[0].last_stream_id == sid and pair.goaways[0].error_code == 0
    after = REGISTRY.get_sample_value("gatekeeper_proxy_goaway_sent_total", {"reason": "idle"})
    assert after == before + 1


async def test_headers_and_reset_in_one_read_leave_no_stream_behind(h2pair):
    """A task cancelled before its first step must still be cleaned up (else drains never end)."""
    calls: list[str] = []

    async def handler(req: ProxyRequest) -> ProxyResponse:
        calls.append(req.target)
        return ProxyResponse(200, [], _chunks(b"ok"))

    pair = h2pair(handler, ProtocolSettings(idle_timeout_seconds=0.2))
    await pair.settle()
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, [(":method", "GET"), (":path", "/gone"), (":scheme", "https"),
                                   (":authority", "p")], end_stream=True)
    pair.client.reset_stream(sid, ErrorCodes.CANCEL)
    pair.pump()  # both frames in one read
    await pair.settle()
    assert pair.server.open_streams == 0
    # the idle timer re-armed: the connection is retired once idle
    await pair.until(lambda: pair.transport_closed.is_set())
    assert pair.goaways and pair.goaways[0].error_code == 0


async def test_response_before_request_body_ends_resets_with_no_error(h2pair):
    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(429, [("retry-after", "1")], _chunks(b"too many"))

    pair = h2pair(handler)
    await pair.settle()
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, [(":method", "POST"), (":path", "/api/v1/namespaces/a/secrets"),
                                   (":scheme", "https"), (":authority", "p")])
    pair.client.send_data(sid, b"{" * 1000)  # the body is still coming
    pair.pump()
    await pair.until(lambda: pair.reset(sid) is not None)
    assert pair.status(sid) == 429 and pair.body(sid) == b"too many" and pair.ended(sid)
    reset = pair.reset(sid)
    assert reset is not None and reset.error_code == ErrorCodes.NO_ERROR


async def test_stream_over_max_concurrent_streams_is_refused_and_others_finish(h2pair):
    release = asyncio.Event()

    async def handler(req: ProxyRequest) -> ProxyResponse:
        await release.wait()
        return ProxyResponse(200, [], _chunks(req.target.encode()))

    pair = h2pair(handler, ProtocolSettings(max_concurrent_streams=2))
    await pair.settle()
    # A misbehaving client that ignores our SETTINGS_MAX_CONCURRENT_STREAMS.
    pair.client.remote_settings.max_concurrent_streams = 100
    pair.client.remote_settings.acknowledge()
    before = REGISTRY.get_sample_value("gatekeeper_proxy_refused_streams_total") or 0.0
    ids = [pair.request("GET", f"/s/{i}") for i in range(3)]
    await pair.until(lambda: pair.reset(ids[2]) is not None)
    assert pair.reset(ids[2]).error_code == ErrorCodes.REFUSED_STREAM
    assert REGISTRY.get_sample_value("gatekeeper_proxy_refused_streams_total") == before + 1
    release.set()
    await pair.until(lambda: pair.ended(ids[0]) and pair.ended(ids[1]))
    assert [pair.body(s) for s in ids[:2]] == [b"/s/0", b"/s/1"]
    assert pair.goaways == [] and not pair.transport_closed.is_set()
    # The connection still takes new streams once there is room.
    sid = pair.request("GET", "/after")
    await pair.until(lambda: pair.ended(sid))
    assert pair.body(sid) == b"/after"


async def test_malformed_header_block_resets_that_stream_only_with_protocol_error(h2pair):
    calls: list[ProxyRequest] = []

    async def handler(req: ProxyRequest) -> ProxyResponse:
        calls.append(req)
        return ProxyResponse(200, [], _chunks(b"ok"))

    pair = h2pair(handler)
    await pair.settle()
    # The client-side h2 would refuse to send these; switch its checks off like a broken client.
    pair.client.config.validate_outbound_headers = False
    pair.client.config.normalize_outbound_headers = False
    bad = pair.request(headers=[("x-evil", "a\r\nx-remote-user: admin")])
    good = pair.request()
    await pair.until(lambda: pair.reset(bad) is not None and pair.ended(good))
    assert pair.reset(bad).error_code == ErrorCodes.PROTOCOL_ERROR
    assert pair.response(bad) is None
    assert pair.status(good) == 200 and pair.goaways == []
    assert [r.stream_id for r in calls] == [good]


async def test_response_header_names_are_lowercased_and_connection_headers_dropped(h2pair):
    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(429, [("Retry-After", "1"), ("Connection", "close"), ("Keep-Alive", "x"),
                                   ("X-Padded", " v ")], _chunks(b"slow down"))

    pair = h2pair(handler)
    sid = pair.request()
    await pair.until(lambda: pair.ended(sid))
    headers = pair.response(sid).headers
    assert (b"retry-after", b"1") in headers and (b"x-padded", b"v") in headers
    assert not any(k in (b"connection", b"keep-alive", b"Retry-After") for k, _ in headers)


async def test_per_response_audit_id_and_date_are_not_hpack_indexed(h2pair):
    from hpack import NeverIndexedHeaderTuple

    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(200, [("Audit-Id", req.target[1:]), ("date", "now"), ("content-type", "x/y")],
                             _chunks(b"ok"))

    pair = h2pair(handler)
    ids = [pair.request("GET", f"/{i}") for i in range(3)]
    await pair.until(lambda: all(pair.ended(s) for s in ids))
    for i, sid in enumerate(ids):
        headers = {bytes(k): h for k, h in ((h[0], h) for h in pair.response(sid).headers)}
        assert headers[b"audit-id"] == (b"audit-id", str(i).encode())
        assert isinstance(headers[b"audit-id"], NeverIndexedHeaderTuple)
        assert isinstance(headers[b"date"], NeverIndexedHeaderTuple)
        assert not isinstance(headers[b"content-type"], NeverIndexedHeaderTuple)
    table = [name for name, _ in pair.client.decoder.header_table.dynamic_entries]
    assert b"audit-id" not in table and b"content-type" in table


async def test_body_that_knows_its_last_chunk_ends_the_stream_on_that_data_frame(h2pair):
    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(200, [], _KnowsLastChunk(b"a" * 10, b"b" * 10))

    pair = h2pair(handler)
    sid = pair.request()
    await pair.until(lambda: pair.ended(sid))
    frames = [e for e in pair.events if isinstance(e, DataReceived) and e.stream_id == sid]
    assert [f.data for f in frames] == [b"a" * 10, b"b" * 10]
    assert frames[-1].stream_ended is not None and frames[0].stream_ended is None


class _KnowsLastChunk:
    """A body that knows its last chunk, like upstream's (``exhausted`` turns True as it hands it out)."""

    def __init__(self, *parts: bytes) -> None:
        self.parts = list(parts)
        self.exhausted = False

    def __aiter__(self) -> _KnowsLastChunk:
        return self

    async def __anext__(self) -> bytes:
        if not self.parts:
            raise StopAsyncIteration
        part = self.parts.pop(0)
        self.exhausted = not self.parts
        return part


async def test_exhausted_body_ending_in_an_empty_chunk_still_ends_the_stream(h2pair):
    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(200, [], _KnowsLastChunk(b"abc", b""))  # type: ignore[arg-type]

    pair = h2pair(handler)
    sid = pair.request()
    await pair.until(lambda: pair.ended(sid))
    assert pair.body(sid) == b"abc"


async def test_largest_valid_stream_window_keeps_connection_window_within_rfc_limit(h2pair):
    """streamWindowBytes passes validate() up to 2^31-1, but the connection window is 4x that:
    it must be capped at 2^31-1 (RFC 9113 6.9.1), not sent as an invalid WINDOW_UPDATE, which broke every
    connection."""

    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(200, [], _chunks(b"ok"))

    settings = ProtocolSettings(stream_window_bytes=2**30)
    settings.validate()
    pair = h2pair(handler, settings)
    sid = pair.request("GET", "/api/v1/pods")
    await pair.until(lambda: pair.ended(sid))
    assert pair.status(sid) == 200
    assert pair.client.remote_flow_control_window(sid) <= 2**31 - 1
    assert pair.server._conn.inbound_flow_control_window == 2**31 - 1
