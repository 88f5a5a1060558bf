"""A request that is not long-running ends by its deadline, whatever its client's read speed
(``protocol.requestTimeoutSeconds``, kube-apiserver's --request-timeout): a 504 before the response head, a
reset HTTP/2 stream or a closed HTTP/1.1 connection after it, and the pipeline learns the request ended."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from edge_kit import bench, body_json, make_pki, rejected, status_of
from h2.errors import ErrorCodes

from gatekeeper.certs.pki import PKI
from gatekeeper.kube import requestinfo
from gatekeeper.kube.duration import DurationError
from gatekeeper.proxy.adapter import DeadlinePassed
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.pipeline.deadline import Deadlines, request_timeout
from gatekeeper.proxy.pipeline.stages import chain, front_for
from gatekeeper.proxy.settings import ProtocolSettings


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def timeout_of(target: str, maximum: float = 60.0) -> float | None:
    return request_timeout(requestinfo.parse("GET", target), target, maximum)


# --- which deadline -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", [
    "/api/v1/pods?watch=1", "/api/v1/namespaces/a/pods/p/log?follow=true", "/api/v1/namespaces/a/pods/p/exec",
    "/api/v1/namespaces/a/pods/p/portforward", "/api/v1/namespaces/a/pods/p/attach",
    "/api/v1/namespaces/a/services/s/proxy/x",
])
def test_long_running_requests_have_no_deadline(target: str) -> None:
    assert timeout_of(target) is None


def test_a_log_read_without_follow_is_bounded_as_it_holds_a_seat() -> None:
    assert timeout_of("/api/v1/namespaces/a/pods/p/log") == 60.0


@pytest.mark.parametrize(("query", "seconds"), [
    ("", 60.0), ("timeout=5s", 5.0), ("timeout=2m", 60.0), ("timeout=0", 60.0), ("timeout=-1s", 60.0),
    ("%74imeout=5s", 5.0),  # Go decodes the key: the apiserver sees timeout=5s, so must we
    ("timeout=5s&timeout=1s", 5.0),  # Query().Get takes the first
    ("limit=5&timeout=250ms", 0.25), ("timeoutSeconds=5", 60.0),
])
def test_the_clients_timeout_shortens_the_deadline_and_never_lengthens_it(query: str, seconds: float) -> None:
    assert timeout_of(f"/api/v1/secrets?{query}" if query else "/api/v1/secrets") == seconds


def test_a_timeout_go_cannot_parse_is_refused() -> None:
    with pytest.raises(DurationError):
        timeout_of("/api/v1/secrets?timeout=5")


# --- HTTP/2, in memory -------------------------------------------------------------------------------------------

class Ends:
    """What the pipeline learns when each response ends (flow control frees its seats on it)."""

    def __init__(self) -> None:
        self.errors: list[BaseException | None] = []
        self.body_closed = 0
        self.handler_cancelled = 0

    def response(self, body: AsyncIterator[bytes]) -> ProxyResponse:
        resp = ProxyResponse(200, [("content-type", "application/json")], body)
        resp.on_complete.append(self.errors.append)
        return resp

    async def endless(self, first: bytes = b'{"items":[') -> AsyncIterator[bytes]:
        try:
            yield first
            await asyncio.Event().wait()
        finally:
            self.body_closed += 1


def pipeline(ends: Ends, final, seconds: float = 0.3) -> tuple[object, Deadlines]:
    deadlines = Deadlines()
    return chain([front_for([], deadlines, seconds)], final), deadlines


async def test_h2_request_past_its_deadline_before_the_head_gets_a_504_status(h2pair) -> None:
    ends = Ends()

    async def stuck(request: ProxyRequest) -> ProxyResponse:  # queued for a seat, or an apiserver that sits
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            ends.handler_cancelled += 1
            raise
        raise AssertionError("unreachable")

    handler, deadlines = pipeline(ends, stuck)
    before = rejected("deadline")
    pair = h2pair(handler)
    started = time.monotonic()
    sid = pair.request(path="/api/v1/secrets")
    await pair.until(lambda: pair.ended(sid) or pair.reset(sid) is not None)
    assert pair.status(sid) == 504
    status = orjson.loads(pair.body(sid))
    assert status["reason"] == "Timeout" and "did not complete within 0.3s" in status["message"]
    assert 0.3 <= time.monotonic() - started < 2
    assert ends.handler_cancelled == 1, "the pipeline's work (queue wait, upstream call) must be cancelled"
    assert rejected("deadline") == before + 1 and len(deadlines) == 0


async def test_h2_response_still_streaming_at_its_deadline_is_reset_cancel(h2pair) -> None:
    ends = Ends()

    async def trickling(request: ProxyRequest) -> ProxyResponse:
        return ends.response(ends.endless())

    handler, deadlines = pipeline(ends, trickling)
    pair = h2pair(handler)
    sid = pair.request(path="/api/v1/secrets")
    await pair.until(lambda: pair.reset(sid) is not None)
    assert pair.status(sid) == 200 and pair.body(sid) == b'{"items":['
    assert pair.reset(sid).error_code == ErrorCodes.CANCEL
    await pair.until(lambda: len(ends.errors) == 1)
    assert isinstance(ends.errors[0], DeadlinePassed), "flow control must see the request end (seats released)"
    assert ends.body_closed == 1, "the upstream body must be closed (the backend's stream cancelled)"
    assert len(deadlines) == 0


async def test_h2_watch_outlives_the_deadline(h2pair) -> None:
    ends = Ends()

    async def watch(request: ProxyRequest) -> ProxyResponse:
        return ends.response(ends.endless(b'{"type":"ADDED"}\n'))

    handler, deadlines = pipeline(ends, watch, seconds=0.2)
    pair = h2pair(handler)
    sid = pair.request(path="/api/v1/secrets?watch=1")
    await asyncio.sleep(1.0)
    assert pair.status(sid) == 200 and pair.reset(sid) is None and ends.errors == []
    assert len(deadlines) == 0


async def test_h2_bad_timeout_is_a_400_and_nothing_runs(h2pair) -> None:
    ends = Ends()
    called = []

    async def final(request: ProxyRequest) -> ProxyResponse:
        called.append(request)
        return ends.response(ends.endless())

    handler, _ = pipeline(ends, final)
    before = rejected("bad_timeout")
    pair = h2pair(handler)
    sid = pair.request(path="/api/v1/secrets?timeout=10")
    await pair.until(lambda: pair.ended(sid))
    assert pair.status(sid) == 400 and called == []
    assert "invalid timeout specified in the request URL" in orjson.loads(pair.body(sid))["message"]
    assert rejected("bad_timeout") == before + 1


async def test_a_request_done_in_time_leaves_no_deadline_behind(h2pair) -> None:
    ends = Ends()

    async def quick(request: ProxyRequest) -> ProxyResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b"{}"
        return ends.response(body())

    handler, deadlines = pipeline(ends, quick)
    pair = h2pair(handler, ProtocolSettings())
    sids = [pair.request(path=f"/api/v1/namespaces/a/configmaps/c{i}") for i in range(5)]
    await pair.until(lambda: all(pair.ended(s) for s in sids))
    assert [pair.status(s) for s in sids] == [200] * 5
    await pair.until(lambda: len(ends.errors) == 5)
    assert len(deadlines) == 0
    await asyncio.sleep(0.6)  # the sweeper has run past every would-be deadline: nothing cut
    assert ends.errors == [None] * 5


# --- HTTP/1.1, through the real listener and upstream client ----------------------------------------------------

async def test_h1_request_past_its_deadline_gets_a_504_and_the_connection_closes(pki: PKI) -> None:
    async with bench(pki, protocol={"request_timeout_seconds": 0.5}) as b:
        before = rejected("deadline")
        started = time.monotonic()
        raw = await b.raw(b"GET /slow/api/v1/secrets HTTP/1.1\r\nHost: x\r\n\r\n")  # returns once closed
        assert status_of(raw) == 504, raw[:300]
        assert body_json(raw)["reason"] == "Timeout"
        assert b"connection: close" in raw.lower()
        assert time.monotonic() - started < b.backend.slow_seconds
        assert rejected("deadline") == before + 1


async def test_h1_clients_timeout_parameter_shortens_the_deadline(pki: PKI) -> None:
    async with bench(pki, protocol={"request_timeout_seconds": 30}) as b:
        started = time.monotonic()
        raw = await b.raw(b"GET /slow/api/v1/secrets?timeout=300ms HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(raw) == 504
        assert time.monotonic() - started < 2


async def test_h1_response_still_streaming_at_its_deadline_is_reset_at_once(pki: PKI) -> None:
    """A 32 MiB answer read slowly: the connection is reset at the deadline, mid-response. A plain close
    left the kernel sending its megabytes of send buffer to the trickling client, which saw the cut only
    minutes later."""
    async with bench(pki, protocol={"request_timeout_seconds": 0.5}) as b:
        reader, writer = await b.open()
        writer.write(b"GET /big/api/v1/secrets HTTP/1.1\r\nHost: x\r\n\r\n")
        got = await reader.read(65536)
        assert status_of(got) == 200
        await asyncio.sleep(1.0)  # a slow reader: nothing taken until past the deadline
        total, closed = len(got), False
        started = time.monotonic()
        try:
            while time.monotonic() - started < 5:
                chunk = await reader.read(16384)
                if not chunk:
                    closed = True
                    break
                total += len(chunk)
                await asyncio.sleep(0.05)  # about 300 KiB/s: far slower than the buffers could empty
        except (ConnectionError, OSError):
            closed = True
        writer.close()
        assert closed, f"still receiving after the deadline ({total} bytes)"
        assert total < b.backend.big_bytes


def test_request_timeout_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="requestTimeoutSeconds"):
        ProtocolSettings(request_timeout_seconds=0).validate()
