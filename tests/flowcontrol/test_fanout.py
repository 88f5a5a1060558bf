"""The shared body of coalesced requests (``edge/fanout.py``): its end is reported whatever moment readers leave."""

from __future__ import annotations

import asyncio

from gatekeeper.proxy.flowcontrol.edge.fanout import FanOut


class Endless:
    """An upstream body that sends nothing for an hour (a shared watch with no events)."""

    def __init__(self) -> None:
        self.closed = False

    def __aiter__(self) -> Endless:
        return self

    async def __anext__(self) -> bytes:
        await asyncio.sleep(3600)
        return b"x"

    async def aclose(self) -> None:
        self.closed = True


async def test_the_last_reader_gone_ends_a_silent_shared_stream_and_reports_it():
    body, ended = Endless(), []
    fan = FanOut(body, 2, 1 << 20, lambda total, err: ended.append(err))
    await asyncio.sleep(0.01)  # the pump waits for upstream bytes
    fan.subs[0].close()
    assert not ended  # one reader is left
    fan.subs[1].close()
    await asyncio.sleep(0.01)
    assert body.closed and len(ended) == 1


async def test_readers_all_gone_before_the_pump_ran_still_report_the_end_and_close_upstream():
    """A task cancelled before its first step never enters its coroutine: the ticket and the upstream stream would
    stay for good."""
    body, ended = Endless(), []
    fan = FanOut(body, 2, 1 << 20, lambda total, err: ended.append(err))
    for s in fan.subs:
        s.close()
    await asyncio.sleep(0.01)
    assert body.closed and len(ended) == 1
