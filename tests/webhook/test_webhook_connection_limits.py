"""What a caller that is not the apiserver can hold: connections, handshakes, heads, bodies (real TLS server).

Any pod can reach the webhook's Service, so each of these is bounded by a setting and the refusals are
counted. Waits are generous upper bounds (a defence that is missing holds for an hour, not seconds);
nothing here asserts how fast anything is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from review_fixtures import b64, review, secret

from gatekeeper.certs.pki import PKI
from gatekeeper.webhook.app import metrics
from gatekeeper.webhook.server import serve
from gatekeeper.webhook.settings import GpuSettings, ServerSettings, WebhookSettings

GIVE_UP = 20.0
"""How long a test waits for the server to close a connection before calling the defence missing."""


@dataclass
class Listening:
    port: int
    ctx: ssl.SSLContext

    async def tls(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port, ssl=self.ctx)

    async def tcp(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


async def _serving(tmp_path: Path, **limits: float | int) -> AsyncIterator[Listening]:
    pki = PKI(tmp_path / "pki")
    pki.init()
    issued = pki.issue_serving("webhook", ips=["127.0.0.1"])
    port_file = tmp_path / "port"
    server = replace(ServerSettings(port=0, cert_file=str(issued.cert), key_file=str(issued.key),
                                    port_file=str(port_file)), **limits)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(WebhookSettings(server=server, gpu=GpuSettings(enabled=False)), stop))
    try:
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert not task.done() and time.monotonic() < deadline
            await asyncio.sleep(0.02)
        yield Listening(int(port_file.read_text()), ssl.create_default_context(cafile=str(pki.cert_path("ca"))))
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


@pytest.fixture
async def short_limits(tmp_path: Path) -> AsyncIterator[Listening]:
    async for s in _serving(tmp_path, idle_timeout_seconds=1.0, body_timeout_seconds=1.0,
                            tls_handshake_timeout_seconds=1.0):
        yield s


async def _closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes; fails if it is still open after GIVE_UP seconds."""
    try:
        return await asyncio.wait_for(reader.read(), GIVE_UP)
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {GIVE_UP:g} s", pytrace=False)
    except (ConnectionError, ssl.SSLError):
        return b""


def _refused(route: str, reason: str) -> float:
    return metrics().refused.labels(route, reason)._value.get()


async def test_idle_connection_is_closed_after_the_idle_timeout(short_limits: Listening) -> None:
    reader, writer = await short_limits.tls()
    assert await _closed_by_server(reader) == b""
    writer.close()


async def test_request_head_that_never_ends_is_closed_after_the_idle_timeout(short_limits: Listening) -> None:
    reader, writer = await short_limits.tls()
    writer.write(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n")
    await writer.drain()
    assert await _closed_by_server(reader) == b""
    writer.close()


async def test_body_that_stops_arriving_gets_408_and_the_connection_closed(short_limits: Listening) -> None:
    before = _refused("validate", "body-timeout")
    reader, writer = await short_limits.tls()
    writer.write(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Length: 100000\r\n\r\n{\"apiVersion\":")
    await writer.drain()
    answer = await _closed_by_server(reader)
    assert answer.startswith(b"HTTP/1.1 408") and b"bodyTimeoutSeconds" in answer
    assert _refused("validate", "body-timeout") == before + 1
    writer.close()


async def test_connection_that_never_starts_tls_is_dropped(short_limits: Listening) -> None:
    reader, writer = await short_limits.tcp()
    assert await _closed_by_server(reader) == b""
    writer.close()


async def test_connection_over_the_cap_is_closed_before_any_request(tmp_path: Path) -> None:
    async for served in _serving(tmp_path, max_connections=2):
        refused = metrics().refused_connections.labels("connection-cap")
        before = refused._value.get()
        held = [await served.tls() for _ in range(2)]
        for _, w in held:  # a request each, so both are established connections on the server's side
            w.write(b"GET /healthz HTTP/1.1\r\nHost: webhook\r\n\r\n")
        for r, _ in held:
            assert (await r.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        reader, writer = await served.tls()
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: webhook\r\n\r\n")
        assert await _closed_by_server(reader) == b""
        assert refused._value.get() == before + 1
        writer.close()
        held[0][1].close()
        await held[0][1].wait_closed()
        deadline = time.monotonic() + GIVE_UP  # the server sees the close a moment later
        while True:
            reader, writer = await served.tls()
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: webhook\r\nConnection: close\r\n\r\n")
            if (await _closed_by_server(reader)).startswith(b"HTTP/1.1 200"):
                break
            assert time.monotonic() < deadline, "a freed slot was never reused"
            await asyncio.sleep(0.1)
        writer.close()
        held[1][1].close()


async def test_a_review_still_gets_its_answer_under_short_limits(short_limits: Listening) -> None:
    body = orjson.dumps(review(secret(data={"a": b64(1024)})))
    reader, writer = await short_limits.tls()
    writer.write(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    answer = await _closed_by_server(reader)
    assert answer.startswith(b"HTTP/1.1 200") and b'"allowed":true' in answer
    writer.close()


async def test_a_request_head_over_the_header_field_limits_gets_400_and_is_counted(tmp_path: Path) -> None:
    """aiohttp's own limits (128 fields of 8 KiB) let one unfinished head hold ~2.5 MiB until the idle timeout:
    200 connections of one pod took a worker from 53 to 559 MiB. Heads are now held to maxHeaderFields and
    maxHeaderFieldBytes; the apiserver's own head (about ten short fields) still gets its review answered."""
    body = orjson.dumps(review(secret(data={"a": b64(1024)})))

    def head(fields: int, size: int = 16) -> bytes:
        pad = b"".join(b"X-Pad-%02d: %s\r\n" % (i, b"p" * size) for i in range(fields))
        return (b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n" + pad +
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))

    async for served in _serving(tmp_path):
        bad = metrics().bad_requests.labels("http")
        before = bad._value.get()
        for request in (head(40), head(1, size=9000)):
            reader, writer = await served.tls()
            writer.write(request)
            answer = await _closed_by_server(reader)
            assert answer.split(b" ", 2)[1] == b"400", answer[:200]
            writer.close()
        assert bad._value.get() == before + 2
        reader, writer = await served.tls()
        writer.write(head(20, size=1000))  # a bearer token and a mesh's headers fit
        answer = await _closed_by_server(reader)
        assert answer.startswith(b"HTTP/1.1 200") and b'"allowed":true' in answer
        writer.close()


def _unfinished_head(fields: int = 12) -> bytes:
    """A request head of ``fields`` 8 KB fields (within maxHeaderFields and maxHeaderFieldBytes), never ended."""
    return b"GET /healthz HTTP/1.1\r\nHost: webhook\r\n" + b"".join(
        b"X-Pad-%02d: %s\r\n" % (i, b"p" * 8000) for i in range(fields))


async def _wait_for(counter: Any, above: float) -> None:
    deadline = time.monotonic() + GIVE_UP
    while counter._value.get() <= above:
        assert time.monotonic() < deadline, f"nothing was counted within {GIVE_UP:g} s"
        await asyncio.sleep(0.05)


async def test_unfinished_heads_past_the_request_budget_close_the_largest_holder(tmp_path: Path) -> None:
    """Each unfinished head is within the per-head limits, but nothing bounded them all together: maxConnections of
    them took a worker to ~750 MiB (the pod limit is 512 MiB). Past maxBufferedRequestBytes the connection holding
    the most is closed and counted, while a review on a connection holding little is still answered."""
    async for served in _serving(tmp_path, max_buffered_request_bytes=300_000):
        evicted = metrics().refused_connections.labels("request-budget")
        before = evicted._value.get()
        apiserver_reader, apiserver = await served.tls()
        body = orjson.dumps(review(secret(data={"a": b64(64)})))
        apiserver.write(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10]))  # its review is under way
        await apiserver.drain()
        big_reader, big = await served.tls()
        big.write(_unfinished_head(20))  # 160 KB
        await big.drain()
        others = []
        for _ in range(2):  # 96 KB each: the third head takes the total past 300 KB
            reader, writer = await served.tls()
            writer.write(_unfinished_head(12))
            await writer.drain()
            others.append((reader, writer))
        assert await _closed_by_server(big_reader) == b""
        await _wait_for(evicted, before)
        assert evicted._value.get() == before + 1
        apiserver.write(body[10:])
        await apiserver.drain()
        answer = await asyncio.wait_for(apiserver_reader.readuntil(b"}}"), GIVE_UP)
        assert answer.startswith(b"HTTP/1.1 200") and b'"allowed":true' in answer
        for _, writer in [(big_reader, big), (apiserver_reader, apiserver), *others]:
            writer.close()


def _pipeline_fat_heads_without_reading(served: Listening, requests: int = 40) -> ssl.SSLSocket:
    """Requests with 96 KB heads sent back to back; no answer is read, so they queue behind the first."""
    return _pipeline_without_reading(served, requests,
                                     _unfinished_head(12).replace(b"/healthz", b"/metrics") + b"\r\n")


async def test_requests_queued_behind_a_pipelined_one_count_in_the_request_budget(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp queues up to 32 parsed requests per connection while it answers one: 10 clients that pipeline fat
    heads and never read took a worker from 54 to 207 MiB. The queued heads count, so the client is cut long
    before writeTimeoutSeconds (which alone would hold them for 30 s); nothing is logged at ERROR for it."""
    # The kernel's autotuned receive buffer: reads of many heads at once queue them behind the first. With the
    # default 16 KiB, requests arrive one read at a time and each is answered before the next is parsed (the
    # answers wait in the kernel's send buffer, counted as unacknowledged), so nothing queues to be counted.
    async for served in _serving(tmp_path, max_buffered_request_bytes=1_000_000, socket_receive_buffer_bytes=0):
        evicted = metrics().refused_connections.labels("request-budget")
        before = evicted._value.get()
        with caplog.at_level(logging.WARNING):
            tls = await asyncio.to_thread(_pipeline_fat_heads_without_reading, served)
            try:
                await _wait_for(evicted, before)
                await asyncio.sleep(0.5)  # the handler stuck writing meets the closed connection
            finally:
                tls.close()
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("max_connections", 0, "maxConnections"),
    ("max_buffered_request_bytes", 200_000, "maxBufferedRequestBytes"),
    ("max_header_fields", 4, "maxHeaderFields"),
    ("max_header_field_bytes", 100, "maxHeaderFieldBytes"),
    ("idle_timeout_seconds", 0, "idleTimeoutSeconds"),
    ("body_timeout_seconds", -1, "bodyTimeoutSeconds"),
    ("tls_handshake_timeout_seconds", 0, "tlsHandshakeTimeoutSeconds"),
    ("write_timeout_seconds", 0, "writeTimeoutSeconds"),
    ("socket_receive_buffer_bytes", 1024, "socketReceiveBufferBytes"),
    ("socket_receive_buffer_bytes", 1 << 30, "socketReceiveBufferBytes"),
])
def test_limits_must_be_positive(field: str, value: float, needle: str) -> None:
    settings = replace(ServerSettings(cert_file="c", key_file="k"), **{field: value})
    with pytest.raises(ValueError, match=needle):
        settings.validate()


async def _post(served: Listening, body: bytes) -> bytes:
    reader, writer = await served.tls()
    writer.write(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    answer = await _closed_by_server(reader)
    writer.close()
    return answer


async def test_bodies_held_at_once_are_bounded_by_the_budget_not_by_connections(tmp_path: Path) -> None:
    """Two slow senders declaring 64 KiB each fill a 128 KiB budget: the next review gets 503 before its body
    is read, and is answered again once they are gone. Before, each connection could hold maxBodyBytes."""
    async for served in _serving(tmp_path, max_body_bytes=64 * 1024, max_buffered_body_bytes=128 * 1024,
                                 max_buffered_body_caller_share=1.0):  # one caller here: the budget alone
        before = _refused("validate", "body-budget")
        review_body = orjson.dumps(review(secret(data={"a": b64(1024)})))
        slow = [await served.tls() for _ in range(2)]
        for _, w in slow:
            w.write(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Length: 65536\r\n\r\n{\"apiVersion\":")
            await w.drain()
        deadline = time.monotonic() + GIVE_UP
        while not (answer := await _post(served, review_body)).startswith(b"HTTP/1.1 503"):
            assert answer.startswith(b"HTTP/1.1 200")
            assert time.monotonic() < deadline, "two held 64 KiB bodies never filled the 128 KiB budget"
            await asyncio.sleep(0.05)
        assert b"maxBufferedBodyBytes" in answer and b"Retry-After: 1" in answer
        assert _refused("validate", "body-budget") >= before + 1
        for _, w in slow:
            w.close()
        deadline = time.monotonic() + GIVE_UP
        while not (answer := await _post(served, review_body)).startswith(b"HTTP/1.1 200"):
            assert time.monotonic() < deadline, "the budget was not given back when the slow senders left"
            await asyncio.sleep(0.05)


SLOW_HEAD = b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Length: 65536\r\n%s\r\n{\"apiVersion\":"


async def test_one_caller_is_held_to_its_share_of_the_budget(tmp_path: Path) -> None:
    """A caller (peer IP) whose slow bodies hold its share gets 503 for more, while the budget has room left."""
    async for served in _serving(tmp_path, max_body_bytes=64 * 1024, max_buffered_body_bytes=256 * 1024,
                                 max_buffered_body_caller_share=0.25):
        before = _refused("validate", "body-budget-caller")
        review_body = orjson.dumps(review(secret(data={"a": b64(1024)})))
        assert (await _post(served, review_body)).startswith(b"HTTP/1.1 200")
        _, w = await served.tls()
        w.write(SLOW_HEAD % b"")
        await w.drain()
        deadline = time.monotonic() + GIVE_UP
        while not (answer := await _post(served, review_body)).startswith(b"HTTP/1.1 503"):
            assert answer.startswith(b"HTTP/1.1 200")
            assert time.monotonic() < deadline, "a 64 KiB body held by 127.0.0.1 never filled its 64 KiB share"
            await asyncio.sleep(0.05)
        assert b"maxBufferedBodyCallerShare" in answer and b"127.0.0.1" in answer and b"Retry-After: 1" in answer
        assert _refused("validate", "body-budget-caller") >= before + 1
        w.close()
        deadline = time.monotonic() + GIVE_UP
        while not (answer := await _post(served, review_body)).startswith(b"HTTP/1.1 200"):
            assert time.monotonic() < deadline, "the share was not given back when the slow sender left"
            await asyncio.sleep(0.05)


async def test_caller_at_its_share_does_not_block_another_callers_review() -> None:
    """One pod's slow bodies took the whole budget and the apiserver's reviews got 503 (open mode: any pod can
    call). Two peers on one loopback address: the peer IP is taken from a test header here."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from gatekeeper.webhook.app import BUDGET_KEY, build_app

    server = replace(ServerSettings(cert_file="c", key_file="k"), max_body_bytes=64 * 1024,
                     max_buffered_body_bytes=128 * 1024, max_buffered_body_caller_share=0.5)
    app = build_app(WebhookSettings(server=server, gpu=GpuSettings(enabled=False)))

    @web.middleware
    async def peer_from_header(request: web.Request, handler):  # type: ignore[no-untyped-def]
        return await handler(request.clone(remote=request.headers["x-test-peer"]))

    app.middlewares.insert(0, peer_from_header)
    review_body = orjson.dumps(review(secret(data={"a": b64(1024)})))

    async def post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: bytes) -> bytes:
        writer.write(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nx-test-peer: %s\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (peer, len(review_body), review_body))
        return await _closed_by_server(reader)

    async with TestServer(app, host="127.0.0.1") as ts:
        before = _refused("validate", "body-budget-caller")
        slow = [await asyncio.open_connection("127.0.0.1", ts.port) for _ in range(2)]
        for _, w in slow:  # the attacker: two slow 64 KiB bodies, each its whole share alone
            w.write(SLOW_HEAD % b"x-test-peer: 10.0.0.66\r\n")
            await w.drain()
        budget = app[BUDGET_KEY]
        deadline = time.monotonic() + GIVE_UP
        # both slow bodies were seen: the second refused at the caller's share (or, without it, the budget full)
        while _refused("validate", "body-budget-caller") == before and budget.used < budget.limit:
            assert time.monotonic() < deadline, "the slow bodies never reached the webhook"
            await asyncio.sleep(0.05)
        answer = await post(*await asyncio.open_connection("127.0.0.1", ts.port), b"10.0.0.1")
        assert answer.startswith(b"HTTP/1.1 200") and b'"allowed":true' in answer, answer[:300]
        assert _refused("validate", "body-budget-caller") == before + 1
        for _, w in slow:
            w.close()


def test_caller_share_is_a_fraction_and_never_below_the_largest_review() -> None:
    base = ServerSettings(cert_file="c", key_file="k")
    assert base.max_buffered_body_bytes_per_caller == 16 * 1024 * 1024
    assert replace(base, max_buffered_body_caller_share=0.01).max_buffered_body_bytes_per_caller == base.max_body_bytes
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="maxBufferedBodyCallerShare"):
            replace(base, max_buffered_body_caller_share=bad).validate()


def test_budget_take_reserves_or_names_the_refusal_and_reserves_nothing() -> None:
    """``take`` alone decides: None when reserved, else the metric's reason; a refusal changes nothing."""
    from gatekeeper.webhook.app import BodyBudget

    budget = BodyBudget(100, per_caller=60)
    assert budget.take(50, "10.0.0.66") is None
    assert budget.take(20, "10.0.0.66") == "body-budget-caller"
    assert budget.take(40, None) is None  # a verified apiserver is held to the budget alone
    assert budget.take(20, "10.0.0.1") == "body-budget"  # the budget before the share: 110 > 100
    assert (budget.used, budget.by_caller) == (90, {"10.0.0.66": 50})
    budget.give(50, "10.0.0.66")
    budget.give(40, None)
    assert (budget.used, budget.by_caller) == (0, {})


def test_budget_must_hold_the_largest_review() -> None:
    settings = ServerSettings(cert_file="c", key_file="k", max_body_bytes=1 << 20, max_buffered_body_bytes=1 << 19)
    with pytest.raises(ValueError, match="maxBufferedBodyBytes"):
        settings.validate()


def _pipeline_without_reading(served: Listening, requests: int = 20000,
                              request: bytes = b"GET /metrics HTTP/1.1\r\nHost: webhook\r\n\r\n") -> ssl.SSLSocket:
    """A blocking client with a tiny receive window that sends ``request`` back to back and reads nothing."""
    raw = socket.create_connection(("127.0.0.1", served.port))
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    tls = served.ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    tls.settimeout(3)
    with contextlib.suppress(OSError):  # the server stops reading (or cuts us): enough sent
        for _ in range(requests):
            tls.sendall(request)
    return tls


async def test_client_that_never_reads_its_responses_is_cut_after_the_write_timeout(tmp_path: Path) -> None:
    """Pipelined requests whose answers are never read: the handler waited for the socket to drain forever
    (measured: still established after 60 s with 3.8 MB queued), and a waiting handler is not idle."""
    async for served in _serving(tmp_path, write_timeout_seconds=1.0, idle_timeout_seconds=1.0):
        before = _refused("other", "write-timeout")
        tls = await asyncio.to_thread(_pipeline_without_reading, served)
        try:
            deadline = time.monotonic() + GIVE_UP
            while _refused("other", "write-timeout") == before:
                assert time.monotonic() < deadline, f"a never-reading client was still served after {GIVE_UP:g} s"
                await asyncio.sleep(0.1)
        finally:
            tls.close()


async def test_malformed_http_is_counted_and_not_logged_as_an_error(short_limits: Listening,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Any pod can send a bad chunk size; aiohttp logged each one as an ERROR with a traceback."""
    bad = metrics().bad_requests.labels("http")
    before = bad._value.get()
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        for _ in range(3):
            reader, writer = await short_limits.tls()
            writer.write(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
            answer = await _closed_by_server(reader)
            assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400")
            writer.close()
    assert bad._value.get() == before + 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_a_response_whose_connection_was_reset_while_waiting_is_dropped_without_an_error() -> None:
    """The listener aborts the connection holding the most of maxBufferedRequestBytes, possibly while its answer
    waits for the socket to drain; aiohttp then logged an ERROR with a traceback for each, a line any client
    could have for the price of a connection."""
    from aiohttp.client_exceptions import ClientConnectionResetError
    from aiohttp.test_utils import make_mocked_request

    from gatekeeper.webhook.app import _write_bounded

    class Reset(web.Response):
        async def prepare(self, request: web.BaseRequest) -> Any:
            raise ClientConnectionResetError("Cannot write to closing transport")

    class Busy:
        def get_write_buffer_size(self) -> int:
            return 1  # something queued already: the answer waits for a drain

        def get_extra_info(self, name: str, default: Any = None) -> Any:
            return default

    async def handler(request: web.Request) -> web.StreamResponse:
        return Reset(text="ok")

    request = make_mocked_request("GET", "/metrics", transport=Busy())
    middleware = _write_bounded(WebhookSettings())
    resp = await middleware(request, handler)
    assert isinstance(resp, Reset)


def _review_without_reading(served: Listening, uid_bytes: int) -> ssl.SSLSocket:
    """A blocking client with a tiny receive window that sends one review whose uid (echoed in the answer) is
    ``uid_bytes`` long, and reads nothing."""
    doc = review(secret(data={"a": b64(64)}))
    doc["request"]["uid"] = "u" * uid_bytes
    body = orjson.dumps(doc)
    raw = socket.create_connection(("127.0.0.1", served.port))
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    tls = served.ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    tls.settimeout(3)
    tls.sendall(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return tls


async def test_answers_a_client_does_not_read_count_in_the_request_budget(tmp_path: Path) -> None:
    """An answer is as large as what the caller puts in it (the review's uid is echoed; a mutating patch grows with
    the pod), and uvloop's TLS transport hands a whole answer to its TCP buffer at once, so aiohttp never waited and
    the write timeout never fired: 1000 connections that sent a review with a 1 MiB uid and never read took a worker
    to 3.8 GiB. Answers the client has not acknowledged count in maxBufferedRequestBytes, so the connection holding
    the most unread answer bytes is cut, while a client that reads its answers is still served."""
    async for served in _serving(tmp_path, max_buffered_request_bytes=1_000_000):
        evicted = metrics().refused_connections.labels("request-budget")
        before = evicted._value.get()
        held = []
        try:
            for _ in range(3):  # 400 KB answers each: the third takes the total past 1 MB
                held.append(await asyncio.to_thread(_review_without_reading, served, 400_000))
                await asyncio.sleep(0.2)  # reviewed and answered: the answer waits for the client
            await _wait_for(evicted, before)
            answer = await _post(served, orjson.dumps(review(secret(data={"a": b64(64)}))))
            assert answer.startswith(b"HTTP/1.1 200") and b'"allowed":true' in answer
        finally:
            for tls in held:
                tls.close()


async def test_the_head_of_an_answered_request_counts_until_the_next_one(tmp_path: Path) -> None:
    """aiohttp's request loop keeps the request it last answered while it waits for the next one (up to
    idleTimeoutSeconds): 1000 connections that each sent one 254 KB head, read the answer and idled held 750 KiB
    each, a worker at 820 MiB, with nothing counted. That head counts until the next request, so past
    maxBufferedRequestBytes the idle connection holding the most is cut, while the next request on a connection
    is still answered (its previous head let go)."""
    async for served in _serving(tmp_path, max_buffered_request_bytes=300_000):
        evicted = metrics().refused_connections.labels("request-budget")
        before = evicted._value.get()
        small_reader, small = await served.tls()
        fat = []
        try:
            for _ in range(4):  # 96 KB heads, each answered and then idle: the fourth takes the total past 300 KB
                reader, writer = await served.tls()
                writer.write(_unfinished_head(12) + b"\r\n")
                await writer.drain()
                answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), GIVE_UP)
                assert answer.startswith(b"HTTP/1.1 200")
                fat.append(writer)
            await _wait_for(evicted, before)
            for _ in range(3):  # a connection asking again and again holds one head, not all of them
                small.write(_unfinished_head(1) + b"\r\n")
                await small.drain()
                answer = await asyncio.wait_for(small_reader.readuntil(b"\r\n\r\nok"), GIVE_UP)
                assert answer.startswith(b"HTTP/1.1 200")
        finally:
            for writer in [small, *fat]:
                writer.close()


def _server_side_receive_buffers() -> list[int]:
    """SO_RCVBUF of the webhook's accepted connections in this process (the server runs in the test's loop)."""
    import gc

    from gatekeeper.webhook.listen import MeteredRequestHandler

    return [h.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            for h in gc.get_objects() if isinstance(h, MeteredRequestHandler) and h.transport is not None]


async def test_connections_get_the_configured_receive_buffer(tmp_path: Path) -> None:
    """One read hands the TLS layer everything the kernel queued, and uvloop's read buffer and OpenSSL's incoming
    BIO keep that size for the connection's life, out of any budget: 1000 connections writing a body faster than
    the webhook read it held ~650 KiB each (a worker at ~700 MiB) with the kernel's autotuned buffer, ~120 KiB at
    16 KiB. The accepted connections carry socketReceiveBufferBytes (the kernel doubles it)."""
    async for served in _serving(tmp_path, socket_receive_buffer_bytes=16384):
        reader, writer = await served.tls()
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: webhook\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), GIVE_UP)
            sizes = _server_side_receive_buffers()
            assert sizes and all(size <= 2 * 16384 for size in sizes), sizes
        finally:
            writer.close()
