"""Stopping a task a component owns, as every close() does: cancel it, then wait until it has ended."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def stop_task(task: asyncio.Future[Any] | None) -> None:
    """Cancel ``task`` (None: nothing to stop) and wait for it to end, its CancelledError swallowed, so nothing it
    holds outlives the close that stopped it."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
