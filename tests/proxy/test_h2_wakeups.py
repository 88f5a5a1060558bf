"""Work a request must not add per wake-up (issue 42): at a low rate every request runs alone in its loop pass, so a
timer made and cancelled, an extra write or a locked metric update per request is paid in full each time."""

from __future__ import annotations

import asyncio
from typing import Any

import prometheus_client.values
import pytest
from h2.events import DataReceived, ResponseReceived, StreamEnded
from hyperframe.frame import DataFrame, Frame, HeadersFrame
from test_mux_upstream import backend, get, pki, read_all, send  # noqa: F401 - fixtures, used by name

from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse, one_chunk
from gatekeeper.proxy.settings import ProtocolSettings


class TimerCount:
    """Stands in for the protocol's loop: counts the timers armed through it, passes everything on."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.armed = 0

    def call_later(self, delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        self.armed += 1
        return self._loop.call_later(delay, callback, *args)

    def call_at(self, when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        self.armed += 1
        return self._loop.call_at(when, callback, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


async def _ok(req: ProxyRequest) -> ProxyResponse:
    return ProxyResponse(200, [("content-type", "application/json")], one_chunk(b'{"kind":"Namespace"}'))


async def _one_at_a_time(pair: Any, n: int, gap: float = 0.0) -> None:
    for _ in range(n):
        sid = pair.request()
        await pair.until(lambda sid=sid: pair.ended(sid))
        await pair.settle()  # the stream's task finishes: the connection is idle again
        if gap:
            await asyncio.sleep(gap)


async def test_a_connection_serving_one_request_at_a_time_arms_no_timer_per_request(h2pair) -> None:
    pair = h2pair(_ok, ProtocolSettings(idle_timeout_seconds=30))
    timers = TimerCount(pair.server._loop)
    pair.server._loop = timers
    await _one_at_a_time(pair, 20)
    # Each request made the connection busy then idle again; the idle timer armed at start() still stands.
    assert timers.armed == 0
    assert not pair.transport_closed.is_set()


async def test_the_idle_goaway_counts_from_the_end_of_the_last_stream(h2pair) -> None:
    idle = 0.3
    pair = h2pair(_ok, ProtocolSettings(idle_timeout_seconds=idle))
    loop = asyncio.get_running_loop()
    # Busy for twice the idle timeout, never idle for long: the timer armed at start() must move on, not fire.
    await _one_at_a_time(pair, 6, gap=idle / 3)
    await _one_at_a_time(pair, 1)
    last_end = loop.time()
    assert not pair.transport_closed.is_set() and not pair.goaways
    await pair.until(lambda: pair.transport_closed.is_set(), limit=5 * idle)
    assert loop.time() - last_end >= idle * 0.9  # the loop's clock may round a timer a millisecond early
    assert pair.goaways and pair.goaways[0].error_code == 0


async def test_a_stream_open_when_the_idle_timer_fires_keeps_the_connection(h2pair) -> None:
    idle = 0.1
    release = asyncio.Event()

    async def slow(req: ProxyRequest) -> ProxyResponse:
        await release.wait()
        return await _ok(req)

    pair = h2pair(slow, ProtocolSettings(idle_timeout_seconds=idle))
    sid = pair.request()
    await asyncio.sleep(3 * idle)  # the timer armed at start() fired with the stream open
    assert not pair.goaways
    release.set()
    await pair.until(lambda: pair.ended(sid))
    await pair.until(lambda: pair.transport_closed.is_set(), limit=10 * idle)  # re-armed at the stream's end
    assert pair.goaways and pair.goaways[0].last_stream_id == sid


async def test_a_one_chunk_answer_goes_out_in_one_write_with_its_headers_and_end_stream(h2pair) -> None:
    """The proxy's own answers (a 429, a 504) and any body that knows its last chunk, as the upstream bodies do."""
    pair = h2pair(_ok)
    await pair.settle()
    writes: list[bytes] = []
    inner = pair.server._write

    def counting(data: bytes) -> None:
        writes.append(data)
        inner(data)

    pair.server._write = counting
    sid = pair.request()
    await pair.until(lambda: pair.ended(sid))
    await pair.settle()
    assert len(writes) == 1
    kinds = []
    buf = memoryview(writes[0])
    while buf:
        frame, length = Frame.parse_frame_header(buf[:9])
        frame.parse_body(buf[9:9 + length])
        kinds.append((type(frame), sorted(frame.flags)))
        buf = buf[9 + length:]
    assert kinds == [(HeadersFrame, ["END_HEADERS"]), (DataFrame, ["END_STREAM"])]
    assert [type(e) for e in pair.events if getattr(e, "stream_id", None) == sid] == [
        ResponseReceived, DataReceived, StreamEnded]


async def test_a_multiplexed_get_makes_no_prometheus_client_update(backend, monkeypatch) -> None:  # noqa: F811
    """Per-request counts go through tallies (one locked update per label set per flush, not per request)."""
    _, client = backend
    await read_all(await send(client, get("/api/v1/namespaces/warm")))  # the connection and its metrics exist
    updates: list[float] = []
    real = prometheus_client.values.MutexValue.inc

    def counted(self: Any, amount: float) -> None:
        updates.append(amount)
        real(self, amount)

    monkeypatch.setattr(prometheus_client.values.MutexValue, "inc", counted)
    for i in range(5):
        body = await read_all(await send(client, get(f"/api/v1/namespaces/n{i}")))
        assert body == f"ok /api/v1/namespaces/n{i}".encode()
    assert updates == []


@pytest.fixture(autouse=True)
def _no_leftover_tally_timer() -> None:
    """Each test runs on its own loop; nothing to clean up, but keep the tallies' pending counts out of later tests."""
    from gatekeeper.proxy import tally

    tally.flush()
