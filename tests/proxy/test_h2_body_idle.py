"""HTTP/2 request bodies that go quiet: cut after ``h2BodyIdleTimeoutSeconds``, unless the proxy holds the window.

In memory (the ``h2pair`` fixture). The sandbox test in
``test_h2_abuse_sandbox.py`` shows the same against a real apiserver.
"""

from __future__ import annotations

import asyncio

from edge_kit import chunks, rejected
from h2.errors import ErrorCodes

from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import ProtocolSettings

IDLE = 0.3
CONFIGMAPS = "/api/v1/namespaces/default/configmaps"


class _Reader:
    """A handler that reads the whole body (as the upstream exchange does), remembering how it ended."""

    def __init__(self) -> None:
        self.bodies: dict[int | None, bytes] = {}
        self.failures: dict[int | None, BaseException] = {}

    async def __call__(self, req: ProxyRequest) -> ProxyResponse:
        got = b""
        try:
            if req.body is not None:
                async for chunk in req.body:
                    got += chunk
        except BaseException as exc:
            self.failures[req.stream_id] = exc
            raise
        self.bodies[req.stream_id] = got
        return ProxyResponse(200, [], chunks(b"ok"))


async def test_a_request_body_idle_past_the_timeout_is_reset_and_counted(h2pair):
    reader = _Reader()
    pair = h2pair(reader, ProtocolSettings(h2_body_idle_timeout_seconds=IDLE))
    await pair.settle()
    before = rejected("body_timeout")
    loop = asyncio.get_running_loop()
    sid = pair.request("POST", CONFIGMAPS, open_body=True)
    pair.client.send_data(sid, b'{"kind":')  # a start, then nothing
    pair.pump()
    start = loop.time()
    await pair.until(lambda: pair.reset(sid) is not None, limit=5)
    assert pair.reset(sid).error_code == ErrorCodes.CANCEL
    assert IDLE * 0.8 <= loop.time() - start < 3
    await pair.until(lambda: sid in reader.failures)
    assert isinstance(reader.failures[sid], ConnectionError), "the upstream side must see the body fail"
    await pair.until(lambda: pair.server.open_streams == 0)
    assert rejected("body_timeout") == before + 1
    # The connection itself stays usable.
    other = pair.request()
    await pair.until(lambda: pair.ended(other))
    assert pair.status(other) == 200


async def test_a_slow_but_steady_body_is_not_cut(h2pair):
    reader = _Reader()
    pair = h2pair(reader, ProtocolSettings(h2_body_idle_timeout_seconds=IDLE))
    await pair.settle()
    sid = pair.request("POST", CONFIGMAPS, open_body=True)
    parts = [b"x" * 10 for _ in range(8)]
    for part in parts:  # 8 gaps of IDLE/2: four idle timeouts in all, none between two chunks
        pair.client.send_data(sid, part)
        pair.pump()
        await asyncio.sleep(IDLE / 2)
    pair.client.end_stream(sid)
    pair.pump()
    await pair.until(lambda: pair.ended(sid))
    assert pair.status(sid) == 200 and reader.bodies[sid] == b"".join(parts)
    assert pair.reset(sid) is None


async def test_a_body_the_connection_window_holds_back_is_not_cut(h2pair):
    """Streams whose handlers do not read yet fill the connection window; a client that cannot send is not idle."""
    release = asyncio.Event()
    reader = _Reader()

    async def handler(req: ProxyRequest) -> ProxyResponse:
        if req.target.startswith("/hold"):
            await release.wait()  # e.g. queued for a flow-control seat: the body is not read yet
        return await reader(req)

    window = 16384  # connection window = 4 stream windows = 65536
    pair = h2pair(handler, ProtocolSettings(h2_body_idle_timeout_seconds=IDLE, stream_window_bytes=window))
    await pair.settle()
    held = [pair.request("POST", f"/hold/{i}", open_body=True) for i in range(4)]
    for sid in held:
        pair.client.send_data(sid, b"h" * window, end_stream=True)
        pair.pump()
    waiting = pair.request("POST", CONFIGMAPS, open_body=True)
    await pair.until(lambda: pair.client.local_flow_control_window(waiting) == 0)
    before = rejected("body_timeout")
    await asyncio.sleep(IDLE * 3)
    assert pair.reset(waiting) is None, "cut for an idleness the proxy caused"
    assert rejected("body_timeout") == before
    release.set()  # the held handlers read: their DATA is acknowledged and the window reopens
    await pair.until(lambda: pair.client.local_flow_control_window(waiting) > 0)
    pair.client.send_data(waiting, b"late but allowed", end_stream=True)
    pair.pump()
    await pair.until(lambda: pair.ended(waiting) and all(pair.ended(s) for s in held))
    assert pair.status(waiting) == 200 and reader.bodies[waiting] == b"late but allowed"
    assert all(reader.bodies[s] == b"h" * window for s in held)


async def test_bodies_left_unread_by_an_early_answer_give_the_connection_window_back(h2pair):
    """A 429 (or any answer) before the body was read: the DATA already queued must be acknowledged,
    or every such upload shrinks the connection window for good and the connection stalls."""
    reader = _Reader()

    async def handler(req: ProxyRequest) -> ProxyResponse:
        if req.target.startswith("/busy"):
            await asyncio.sleep(0.05)  # the body arrives meanwhile; it is never read
            return ProxyResponse(429, [("retry-after", "1")], chunks(b"busy"))
        return await reader(req)

    window = 16384  # connection window = 4 stream windows
    pair = h2pair(handler, ProtocolSettings(stream_window_bytes=window))
    await pair.settle()
    for i in range(6):  # together more than the connection window
        sid = pair.request("POST", f"/busy/{i}", open_body=True)
        pair.client.send_data(sid, b"b" * window)
        pair.pump()
        await pair.until(lambda sid=sid: pair.ended(sid) or pair.reset(sid) is not None)
        assert pair.status(sid) == 429
    last = pair.request("POST", CONFIGMAPS, open_body=True)
    await pair.until(lambda: pair.client.local_flow_control_window(last) == window, limit=3)
    pair.client.send_data(last, b"z" * window, end_stream=True)
    pair.pump()
    await pair.until(lambda: pair.ended(last))
    assert pair.status(last) == 200 and reader.bodies[last] == b"z" * window
