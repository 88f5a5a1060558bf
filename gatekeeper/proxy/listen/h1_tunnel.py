"""An upgraded HTTP/1.1 connection (WebSocket, SPDY: exec, attach, port-forward): the wait for the backend's
answer, then bytes spliced both ways until one side closes or nothing moves for h1UpgradeIdleTimeoutSeconds."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from gatekeeper.proxy import rejections
from gatekeeper.proxy.adapter import call_handler
from gatekeeper.proxy.listen.settings import ProtocolSettings
from gatekeeper.proxy.messages import Handler, ProxyRequest, ProxyResponse, Upgraded

READ_SIZE = 65536


async def upgrade_answer(handler: Handler, request: ProxyRequest, settings: ProtocolSettings,
                         peer: str) -> ProxyResponse | None:
    """The handler's answer to an upgrade request, or None if none came in h1UpgradeIdleTimeoutSeconds:
    nothing moves meanwhile, and without the bound such a request was held forever."""
    limit = settings.h1_upgrade_idle_timeout_seconds
    try:
        async with asyncio.timeout(limit):
            return await call_handler(handler, request)
    except TimeoutError:
        rejections.reject("upgrade_idle", f"{peer}: no answer to an upgrade request in {limit:g}s")
        return None


async def splice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, drain: Callable[[], Awaitable[None]],
                 up: Upgraded, settings: ProtocolSettings, peer: str) -> None:
    """Move bytes between the client (``reader``/``writer``; ``drain`` waits for it, aborting a stalled one) and
    the backend until either side closes or no byte moves either way for h1UpgradeIdleTimeoutSeconds."""
    loop = asyncio.get_running_loop()
    moved_at = loop.time()  # the last byte the tunnel moved (either way)

    async def to_backend() -> None:
        # a backend that stops reading stops us reading the client (the idle timeout ends it if nothing moves)
        nonlocal moved_at
        while data := await reader.read(READ_SIZE):
            moved_at = loop.time()
            up.writer.write(data)
            await up.writer.drain()

    async def to_client() -> None:
        # a client that takes none for h1WriteStallTimeoutSeconds is aborted (as for any response), so a
        # never-reading client cannot hold the tunnel and its backend
        nonlocal moved_at
        while data := await up.reader.read(READ_SIZE):
            moved_at = loop.time()
            writer.write(data)
            await drain()

    async def idle() -> None:
        # one timer re-armed from the last move, not one per read
        limit = settings.h1_upgrade_idle_timeout_seconds
        while (left := moved_at + limit - loop.time()) > 0:  # noqa: ASYNC110 - a re-armed deadline
            await asyncio.sleep(left)
        rejections.reject("upgrade_idle", f"{peer}: upgraded connection idle for {limit:g}s")

    tasks = {asyncio.create_task(to_backend()), asyncio.create_task(to_client()), asyncio.create_task(idle())}
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
