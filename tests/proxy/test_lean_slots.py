"""The lean pool's slot gate: a counter while free, FIFO when full, cancellation loses no slot."""

from __future__ import annotations

import asyncio
import gc

import pytest

from gatekeeper.proxy.process import tune_gc
from gatekeeper.proxy.settings import BackendSettings, ProxySettings
from gatekeeper.proxy.upstream.slots import Slots


async def test_slots_are_taken_without_waiting_until_the_pool_is_full() -> None:
    slots = Slots(2)
    assert slots.try_take() and slots.try_take()
    assert not slots.try_take()
    slots.release()
    assert slots.try_take()
    assert not slots.waiters


async def test_released_slots_go_to_waiters_in_arrival_order() -> None:
    slots = Slots(1)
    assert slots.try_take()
    order: list[int] = []

    async def wait(i: int) -> None:
        await slots.take()
        order.append(i)

    tasks = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0)  # one loop pass: every task is in line
    assert len(slots.waiters) == 3
    for _ in range(3):
        slots.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert not slots.try_take()  # the last waiter still holds the one slot
    slots.release()
    assert slots.free == 1


async def test_a_timed_out_waiter_leaves_the_line_and_keeps_no_slot() -> None:
    slots = Slots(1)
    assert slots.try_take()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await slots.take()
    assert not slots.waiters
    slots.release()
    assert slots.free == 1


async def test_a_slot_granted_to_a_cancelled_waiter_passes_to_the_next() -> None:
    slots = Slots(1)
    assert slots.try_take()
    first = asyncio.create_task(slots.take())
    second = asyncio.create_task(slots.take())
    await asyncio.sleep(0)
    assert len(slots.waiters) == 2
    slots.release()  # granted to ``first`` ...
    first.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)
    assert slots.free == 0 and not slots.waiters
    slots.release()
    assert slots.free == 1


def test_tune_gc_freezes_startup_objects_and_raises_the_young_threshold() -> None:
    before = gc.get_threshold()
    try:
        settings = ProxySettings(backends=[BackendSettings(url="https://127.0.0.1:1")], gc_young_threshold=12345)
        tune_gc(settings)
        assert gc.get_threshold()[0] == 12345
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_negative_gc_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="gcYoungThreshold"):
        ProxySettings(backends=[BackendSettings(url="https://127.0.0.1:1")], gc_young_threshold=-1).validate()
