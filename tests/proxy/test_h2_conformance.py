"""RFC 9113 8.1.1/8.2: malformed requests get RST_STREAM PROTOCOL_ERROR on that stream, as Go's server does.

Driven in memory (client-side ``H2Connection`` with its own checks off, like a
broken or hostile client). The pipeline must never see a malformed request,
and the client's other streams must keep working.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame

from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse

OK = [(":method", "GET"), (":scheme", "https"), (":path", "/api/v1/pods"), (":authority", "proxy.test")]


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


def _without(name: str) -> list[tuple[str, str]]:
    return [h for h in OK if h[0] != name]


MALFORMED = {
    "uppercase header name": [*OK, ("X-Upper", "1")],
    "unknown pseudo-header": [*OK, (":foo", "bar")],
    "response pseudo-header": [*OK, (":status", "200")],
    "pseudo-header after a regular header": [*OK[:3], ("accept", "*/*"), OK[3]],
    "connection-specific header": [*OK, ("connection", "keep-alive")],
    "transfer-encoding": [*OK, ("transfer-encoding", "chunked")],
    "te other than trailers": [*OK, ("te", "gzip")],
    "empty :path": [(":method", "GET"), (":scheme", "https"), (":path", ""), (":authority", "p")],
    "missing :method": _without(":method"),
    "missing :scheme": _without(":scheme"),
    "missing :path": _without(":path"),
    "duplicated :method": [*OK[:1], (":method", "GET"), *OK[1:]],
    "duplicated :scheme": [*OK[:2], (":scheme", "https"), *OK[2:]],
    "duplicated :path": [*OK[:3], (":path", "/x"), *OK[3:]],
    "CR LF in a value": [*OK, ("x-evil", "a\r\nx-remote-user: admin")],
}


@pytest.mark.parametrize("block", list(MALFORMED.values()), ids=list(MALFORMED))
async def test_malformed_request_gets_rst_stream_protocol_error_and_never_reaches_pipeline(h2pair, block):
    seen: list[int | None] = []

    async def handler(req: ProxyRequest) -> ProxyResponse:
        seen.append(req.stream_id)
        return ProxyResponse(200, [], _chunks(b"ok"))

    pair = h2pair(handler)
    await pair.settle()
    pair.client.config.validate_outbound_headers = False
    pair.client.config.normalize_outbound_headers = False
    bad = pair.client.get_next_available_stream_id()
    pair.client.send_headers(bad, block, end_stream=True)
    pair.pump()
    good = pair.request()
    await pair.until(lambda: pair.reset(bad) is not None and pair.ended(good))
    reset = pair.reset(bad)
    assert reset is not None and reset.error_code == ErrorCodes.PROTOCOL_ERROR
    assert pair.response(bad) is None, "a malformed request must not be answered"
    assert seen == [good]
    assert pair.status(good) == 200 and pair.goaways == []


async def test_body_longer_than_content_length_resets_only_that_stream(h2pair):
    """h2 alone makes this a connection error (GOAWAY for every stream); Go resets the one stream."""
    bodies: dict[int, bytes] = {}

    async def handler(req: ProxyRequest) -> ProxyResponse:
        data = b""
        if req.body is not None:
            async for chunk in req.body:
                data += chunk
        bodies[req.stream_id or 0] = data
        return ProxyResponse(200, [], _chunks(b"ok"))

    pair = h2pair(handler)
    await pair.settle()
    bad = pair.client.get_next_available_stream_id()
    pair.client.send_headers(bad, [(":method", "POST"), *OK[1:], ("content-length", "3")])
    pair.pump()
    # The client library would refuse to send the extra bytes; write the DATA frame by hand.
    frame = DataFrame(bad, data=b"12345", flags=["END_STREAM"])
    pair.server.data_received(frame.serialize())
    good = pair.request("POST", body=b"abc", headers=[("content-length", "3")])
    await pair.until(lambda: pair.reset(bad) is not None and pair.ended(good))
    assert pair.reset(bad).error_code == ErrorCodes.PROTOCOL_ERROR
    assert pair.goaways == [] and pair.status(good) == 200
    assert bodies.get(good) == b"abc"
    assert bad not in bodies or bodies[bad] != b"12345"
