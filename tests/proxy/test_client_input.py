"""The listener's client protocol: h2 input by callback, bytes before the ALPN decision kept in order."""

from __future__ import annotations

import asyncio
from typing import Any

from gatekeeper.proxy.listen.client_input import ClientProtocol


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.closing = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def _proto() -> tuple[ClientProtocol, asyncio.StreamReader, _Transport]:
    reader = asyncio.StreamReader()
    proto = ClientProtocol(reader)
    transport = _Transport()
    proto.connection_made(transport)
    return proto, reader, transport


async def test_bytes_before_alpn_decision_reach_h2_in_order_then_the_eof() -> None:
    proto, _, _ = _proto()
    proto.data_received(b"PRI * HTTP/2.0\r\n")
    proto.data_received(b"\r\nSM\r\n\r\n")
    proto.eof_received()
    got: list[bytes] = []
    ends: list[str] = []
    proto.attach_sink(got.append, lambda: ends.append("end"), lambda: None, 1.0)
    assert got == [b"PRI * HTTP/2.0\r\n", b"\r\nSM\r\n\r\n"]
    assert ends == ["end"]
    proto.data_received(b"after the end")  # nothing is fed after the end
    assert len(got) == 2


async def test_http1_bytes_before_a_lost_connection_are_read_before_the_eof() -> None:
    proto, reader, _ = _proto()
    proto.data_received(b"GET / HTTP/1.1\r\n\r\n")
    proto.connection_lost(None)
    proto.attach_reader()
    assert await reader.read(100) == b"GET / HTTP/1.1\r\n\r\n"
    assert await reader.read(100) == b""


async def test_h2_input_pauses_over_high_water_and_a_stalled_client_is_cut() -> None:
    proto, _, transport = _proto()
    stalls: list[str] = []
    ends: list[str] = []
    proto.attach_sink(lambda _: None, lambda: ends.append("end"), lambda: stalls.append("stall"), 0.05)
    proto.pause_writing()
    assert transport.paused
    proto.resume_writing()
    assert not transport.paused
    await asyncio.sleep(0.1)
    assert stalls == [] and ends == []  # resumed in time: no cut
    proto.pause_writing()
    for _ in range(100):
        if stalls:
            break
        await asyncio.sleep(0.02)
    assert stalls == ["stall"] and ends == ["end"]


async def test_a_client_gone_error_while_feeding_ends_the_connection() -> None:
    proto, _, _ = _proto()
    ends: list[str] = []

    def sink(_: bytes) -> None:
        raise ConnectionResetError("gone")

    proto.attach_sink(sink, lambda: ends.append("end"), lambda: None, 1.0)
    proto.data_received(b"x")
    assert ends == ["end"]


async def test_bytes_held_before_the_alpn_decision_are_bounded_by_pausing_the_reads() -> None:
    from gatekeeper.proxy.listen.client_input import EARLY_PAUSE_BYTES

    proto, _, transport = _proto()
    chunk = b"x" * 16384
    for _ in range(EARLY_PAUSE_BYTES // len(chunk)):
        proto.data_received(chunk)
    assert not transport.paused  # up to the bound: read on, as a StreamReader would
    proto.data_received(chunk)
    assert transport.paused  # past it: the client waits for the ALPN decision
    got: list[bytes] = []
    proto.attach_sink(got.append, lambda: None, lambda: None, 1.0)
    assert not transport.paused
    assert sum(map(len, got)) == EARLY_PAUSE_BYTES + len(chunk)  # nothing held was lost
