"""The accept loop both servers share (``gatekeeper/serving/acceptloop.py``): connections out, failures backed off."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from gatekeeper.serving import acceptloop
from gatekeeper.serving.acceptloop import accept_forever

log = logging.getLogger("test.acceptloop")


async def test_every_connection_goes_to_the_callback_until_stopping() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    got: list[socket.socket] = []
    stop = False
    task = asyncio.get_running_loop().create_task(
        accept_forever(listener, got.append, log=log, stopping=lambda: stop))
    clients = [socket.create_connection(listener.getsockname()) for _ in range(3)]
    try:
        async with asyncio.timeout(5):
            while len(got) < 3:  # noqa: ASYNC110 - the callback is the only signal
                await asyncio.sleep(0.01)
        assert sorted(c.getpeername() for c in got) == sorted(c.getsockname() for c in clients)
        stop = True
        clients.append(socket.create_connection(listener.getsockname()))  # wakes the loop, which then ends
        await asyncio.wait_for(task, 5)
        assert len(got) == 4  # the one it was waiting for is still handed over
    finally:
        task.cancel()
        for c in [*clients, *got]:
            c.close()
        listener.close()


async def test_a_failing_accept_backs_off_instead_of_spinning(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """Out of descriptors, the listening socket stays readable and every accept fails: retried at once, the
    loop would spin, starving every connection the process serves."""
    calls = 0

    async def failing_accept(sock: socket.socket) -> tuple[socket.socket, object]:
        nonlocal calls
        calls += 1
        raise OSError(24, "Too many open files")

    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "sock_accept", failing_accept)
    monkeypatch.setattr(acceptloop, "ACCEPT_BACKOFF", 0.2)
    listener = socket.socket()
    task = loop.create_task(accept_forever(listener, lambda conn: None, log=log))
    try:
        await asyncio.sleep(0.5)
        assert 1 <= calls <= 4, calls  # one try per back-off, not thousands
        assert "accept failed: [Errno 24] Too many open files" in caplog.text
    finally:
        task.cancel()
        listener.close()
