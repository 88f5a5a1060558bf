"""In-memory HTTP/2 harness: a client-side ``H2Connection`` wired to the proxy's ``H2Protocol``.

GOAWAY frames from the server are split out of the byte stream and recorded
instead of being fed to the client ``H2Connection``: h2 moves a connection
that *receives* GOAWAY to CLOSED and then rejects DATA for in-flight streams
(the client-side face of python-hyper/h2 issue 1181), while real clients
(Go's transport) keep reading in-flight streams. Everything else goes
through h2, so framing, flow control and resets are checked by a real
HTTP/2 implementation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, Event, ResponseReceived, StreamEnded, StreamReset
from h2.settings import SettingCodes, Settings
from hyperframe.frame import Frame, GoAwayFrame

from gatekeeper.proxy.listen.body_budget import RequestBodyBudget
from gatekeeper.proxy.listen.h2 import H2Protocol
from gatekeeper.proxy.messages import Handler
from gatekeeper.proxy.settings import ProtocolSettings


class H2Pair:
    """A proxy ``H2Protocol`` and an in-memory client; the client auto-pumps its output to the server."""

    def __init__(
        self,
        handler: Handler,
        settings: ProtocolSettings | None = None,
        *,
        rng: Callable[[], float] | None = None,
        client_window: int | None = None,
        close_delay: float = 0.05,
        body_budget: RequestBodyBudget | None = None,
    ) -> None:
        self.client = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        self.events: list[Event] = []
        self.goaways: list[GoAwayFrame] = []
        self.transport_closed = asyncio.Event()
        self.bytes_after_close = 0
        self._buf = bytearray()
        kwargs: dict[str, Any] = {}
        if rng is not None:
            kwargs["rng"] = rng
        if body_budget is not None:
            kwargs["body_budget"] = body_budget
        self.server = H2Protocol(
            handler, settings or ProtocolSettings(), write=self._from_server, drain=self._drain,
            close=self._close, peer="127.0.0.1:1", close_delay=close_delay, **kwargs,
        )
        if client_window is not None:
            self.client.local_settings = Settings(
                client=True, initial_values={SettingCodes.INITIAL_WINDOW_SIZE: client_window}
            )
        self.client.initiate_connection()
        self.server.start()
        self.pump()

    async def _drain(self) -> None:
        await asyncio.sleep(0)

    def _close(self) -> None:
        self.transport_closed.set()

    def _from_server(self, data: bytes) -> None:
        if self.transport_closed.is_set():
            self.bytes_after_close += len(data)
            return
        self._buf += data
        while len(self._buf) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(self._buf[:9]))
            if len(self._buf) < 9 + length:
                break
            raw = bytes(self._buf[: 9 + length])
            del self._buf[: 9 + length]
            if isinstance(frame, GoAwayFrame):
                frame.parse_body(memoryview(raw[9:]))
                self.goaways.append(frame)
            else:
                self.events.extend(self.client.receive_data(raw))
        asyncio.get_running_loop().call_soon(self.pump)

    def pump(self) -> None:
        data = self.client.data_to_send()
        if data and not self.transport_closed.is_set():
            self.server.data_received(data)

    # ---------------------------------------------------------------- client helpers

    def request(self, method: str = "GET", path: str = "/api/v1/pods", *, body: bytes | None = None,
                headers: list[tuple[str, str]] | None = None, open_body: bool = False) -> int:
        """``open_body``: HEADERS only, the body to follow with ``client.send_data`` (an upload in progress)."""
        sid = self.client.get_next_available_stream_id()
        hdrs = [(":method", method), (":path", path), (":scheme", "https"), (":authority", "proxy.test")]
        hdrs += headers or []
        self.client.send_headers(sid, hdrs, end_stream=body is None and not open_body)
        if body is not None:
            self.client.send_data(sid, body, end_stream=True)
        self.pump()
        return sid

    async def settle(self, rounds: int = 20) -> None:
        for _ in range(rounds):
            await asyncio.sleep(0)

    async def until(self, predicate: Callable[[], bool], limit: float = 5.0) -> None:
        """Poll ``predicate`` (cheap, in-memory state) until true; fail after ``limit`` seconds."""
        async with asyncio.timeout(limit):
            while not predicate():  # noqa: ASYNC110 - state lives in several objects, no single event
                await asyncio.sleep(0.001)

    def response(self, sid: int) -> ResponseReceived | None:
        for e in self.events:
            if isinstance(e, ResponseReceived) and e.stream_id == sid:
                return e
        return None

    def status(self, sid: int) -> int | None:
        r = self.response(sid)
        if r is None:
            return None
        return int(dict(r.headers)[b":status"])

    def body(self, sid: int) -> bytes:
        return b"".join(e.data for e in self.events if isinstance(e, DataReceived) and e.stream_id == sid)

    def ended(self, sid: int) -> bool:
        return any(isinstance(e, StreamEnded) and e.stream_id == sid for e in self.events)

    def reset(self, sid: int) -> StreamReset | None:
        for e in self.events:
            if isinstance(e, StreamReset) and e.stream_id == sid:
                return e
        return None

    def ack(self, sid: int) -> None:
        """Hand back the window for everything received on ``sid`` so far (like a reading client)."""
        for e in self.events:
            if isinstance(e, DataReceived) and e.stream_id == sid and not getattr(e, "_acked", False):
                self.client.acknowledge_received_data(e.flow_controlled_length, sid)
                e._acked = True  # type: ignore[attr-defined]
        self.pump()


@pytest.fixture
def h2pair() -> Callable[..., H2Pair]:
    """An ``H2Pair`` factory: a client (the h2 library) and our ``H2Protocol`` wired in memory."""

    def make(handler: Handler, settings: ProtocolSettings | None = None, **kwargs: Any) -> H2Pair:
        return H2Pair(handler, settings or ProtocolSettings(), **kwargs)

    return make
