"""The supervising parent on its own (no sandbox): stopping while a worker starts, the config it hands out,
and a worker that stops answering."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from gatekeeper.base.errors import UsageError
from gatekeeper.proxy import workers
from gatekeeper.proxy.settings import BackendSettings, ProxySettings, UpstreamSettings

SETTINGS = ProxySettings(backends=[BackendSettings(url="https://127.0.0.1:1")],
                         upstream=UpstreamSettings(ca_file="/etc/hostname"))
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def supervisor(tmp_path: Path, settings: ProxySettings = SETTINGS, n: int = 1) -> workers.WorkerSupervisor:
    """A supervisor whose port is bound but never accepted on (these tests do not start its dispatcher)."""
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    return workers.WorkerSupervisor(settings, tmp_path / "proxy.yaml", n, tmp_path, port.getsockname()[1], [port])


def handoff_supervisor(tmp_path: Path, n: int) -> tuple[workers.WorkerSupervisor, socket.socket]:
    """A supervisor that hands connections over (listening on a loopback port), with no metrics port and no
    heartbeat; the caller closes the listener."""
    from dataclasses import replace

    from gatekeeper.proxy.settings import ListenerSettings

    settings = replace(SETTINGS, listener=ListenerSettings(metrics_port=-1), worker_hang_seconds=0)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    return workers.WorkerSupervisor(settings, tmp_path / "proxy.yaml", n, tmp_path, listener.getsockname()[1],
                              [listener]), listener


async def test_sigterm_while_a_worker_is_being_started_still_reaches_it(tmp_path: Path, monkeypatch) -> None:
    """stop() signals the workers it knows; one whose start was under way when SIGTERM came was missed,
    and the parent then waited for it forever."""
    sup = supervisor(tmp_path)
    real = asyncio.create_subprocess_exec

    async def start_during_sigterm(*argv: Any, **kw: Any) -> asyncio.subprocess.Process:
        sup.stop()  # the signal handler runs while the parent awaits the fork
        return await real(*SLEEPER, **kw)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", start_during_sigterm)
    slot = sup.slots[0]
    await sup._spawn(slot)
    assert slot.proc is not None
    try:
        assert await asyncio.wait_for(slot.proc.wait(), 10) == -signal.SIGTERM
    finally:
        if slot.proc.returncode is None:
            slot.proc.kill()


@contextlib.asynccontextmanager
async def heartbeat_on(tmp_path: Path, hang: float, healthz: Callable[..., Awaitable[None] | None],
                       ) -> AsyncIterator[tuple[workers._Slot, asyncio.subprocess.Process]]:
    """A supervisor's heartbeat (``workerHangSeconds=hang``) watching one live worker process whose private
    ``/healthz`` is served by ``healthz`` (an ``asyncio.start_server`` callback); stopped and cleaned up after."""
    from dataclasses import replace

    sup = supervisor(tmp_path, replace(SETTINGS, worker_hang_seconds=hang))
    proc = await asyncio.create_subprocess_exec(*SLEEPER)
    slot = sup.slots[0]
    slot.proc = proc
    server = await asyncio.start_server(healthz, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    (tmp_path / "worker-0.json").write_text(f'{{"pid": {proc.pid}, "metricsUrl": "http://127.0.0.1:{port}"}}')
    beat = asyncio.get_running_loop().create_task(sup._heartbeat())
    try:
        yield slot, proc
    finally:
        sup.stopping.set()
        await beat
        server.close()
        if proc.returncode is None:
            proc.kill()


async def test_a_worker_that_stops_answering_is_killed(tmp_path: Path) -> None:
    """A stuck worker is alive to waitpid; only the heartbeat on its private /healthz notices it."""
    # "serving" on a port that accepts and never answers: a listening socket nobody reads
    async with heartbeat_on(tmp_path, 1.0, lambda r, w: None) as (slot, proc):
        assert await asyncio.wait_for(proc.wait(), 20) == -signal.SIGKILL
        assert slot.hung_kills == 1


async def test_a_worker_that_answers_late_is_not_killed(tmp_path: Path) -> None:
    """A CPU-starved worker answers its /healthz late but answers: each probe gave up after 2 s (here 1 s), so
    a loop lagging over that for workerHangSeconds got the worker SIGKILLed with all its connections."""
    answers = 0

    async def slow_healthz(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answers
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(1.5)  # over the old per-probe timeout, well within workerHangSeconds
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()
        answers += 1

    async with heartbeat_on(tmp_path, 3.0, slow_healthz) as (slot, proc):  # a probe used to give up after 1 s
        await asyncio.sleep(8)
        assert proc.returncode is None and slot.hung_kills == 0, "a slow but answering worker was killed"
        assert answers >= 3


def test_workers_start_from_a_private_copy_of_the_validated_config(tmp_path: Path) -> None:
    import gatekeeper.proxy.settings  # noqa: F401 - registers the proxy: section
    from gatekeeper.base.config import load_config

    config = tmp_path / "proxy.yaml"
    config.write_text(yaml.safe_dump({"proxy": {"backends": [{"url": "https://127.0.0.1:1"}],
                                                "upstream": {"caFile": "/etc/hostname"}}}))
    settings = load_config(config, need="proxy").proxy
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    copy = workers.snapshot_config(settings, config, runtime)
    assert copy.parent == runtime and copy.stat().st_mode & 0o777 == 0o600
    config.write_text("proxy: [\n")  # an edit after start no longer reaches a restarted worker
    assert load_config(copy, need="proxy").proxy == settings

    other = tmp_path / "run2"
    other.mkdir()
    with pytest.raises(UsageError, match="changed while the proxy was starting"):
        workers.snapshot_config(settings, config, other)


async def test_a_worker_that_ignores_sigterm_is_killed_after_the_drain_time(tmp_path: Path, monkeypatch) -> None:
    """The parent used to wait forever for a worker that never finished draining (stuck or stopped)."""
    from dataclasses import replace

    from gatekeeper.proxy.settings import ListenerSettings, ProtocolSettings

    settings = replace(SETTINGS, listener=ListenerSettings(metrics_port=-1), worker_hang_seconds=0,
                       protocol=ProtocolSettings(shutdown_timeout_seconds=0.5))
    sup = supervisor(tmp_path, settings)
    real = asyncio.create_subprocess_exec
    deaf = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                  "print('ready', flush=True); time.sleep(60)"]
    started = asyncio.Event()

    async def deaf_worker(*argv: Any, **kw: Any) -> asyncio.subprocess.Process:
        proc = await real(*deaf, **{**kw, "stdout": asyncio.subprocess.PIPE})
        assert proc.stdout is not None
        await proc.stdout.readline()  # SIGTERM is ignored from here on
        started.set()
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", deaf_worker)
    monkeypatch.setattr(workers, "KILL_GRACE", 0.5, raising=False)
    run = asyncio.get_running_loop().create_task(sup.run())
    try:
        await asyncio.wait_for(started.wait(), 20)
        sup.stop()
        assert await asyncio.wait_for(run, 20) == signal.SIGKILL
    finally:
        for slot in sup.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                slot.proc.kill()


async def test_the_proxy_exits_when_its_connection_hand_off_thread_fails(tmp_path: Path, monkeypatch) -> None:
    """The hand-off thread closes the TLS port when it fails (a bug, a full disk under its metrics). The
    parent ran on without a port: workers alive, ``/readyz`` still ready, so an orchestrator kept sending
    clients to a node that refused them. It now stops and exits 1, to be restarted."""
    from gatekeeper.proxy.handoff.dispatcher import HandoffDispatcher

    sup, listener = handoff_supervisor(tmp_path, 1)
    real = asyncio.create_subprocess_exec

    async def sleeper(*argv: Any, **kw: Any) -> asyncio.subprocess.Process:
        return await real(*SLEEPER, **kw)

    def bug(self: HandoffDispatcher) -> None:
        raise RuntimeError("a bug in the hand-off thread")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", sleeper)
    monkeypatch.setattr(HandoffDispatcher, "_apply_commands", bug)  # runs at the first worker's start
    try:
        assert await asyncio.wait_for(sup.run(), 20) == 1
    finally:
        listener.close()
        for slot in sup.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                slot.proc.kill()


# A worker that drains on the end of its hand-off socket (as ProxyServer does) for 0.5 s, and dies of a SIGTERM
# at any time: the exit code says which it saw.
_HANDOFF_WORKER = """
import os, signal, socket, sys, time
signal.signal(signal.SIGTERM, lambda *a: os._exit(15))
sock = socket.socket(fileno=int(sys.argv[sys.argv.index("--handoff-fd") + 1]))
sock.send(b"R")
while sock.recv(16):
    pass
time.sleep(0.5)
sys.exit(0)
"""


async def test_stopping_with_the_hand_off_closes_the_workers_sockets_and_sends_no_sigterm(
        tmp_path: Path, monkeypatch) -> None:
    """Closing a worker's hand-off socket is its signal to drain. The parent used to send SIGTERM as well,
    which raced that drain: one landing as the worker swapped its handlers killed it (CI saw workers exit -15
    and the proxy 15 in test_exec_sandbox's and test_h2spec's teardowns)."""
    sup, listener = handoff_supervisor(tmp_path, 2)
    real = asyncio.create_subprocess_exec

    async def handoff_worker(*argv: Any, **kw: Any) -> asyncio.subprocess.Process:
        return await real(sys.executable, "-c", _HANDOFF_WORKER, *argv[argv.index("--handoff-fd"):][:2], **kw)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", handoff_worker)
    run = asyncio.get_running_loop().create_task(sup.run())
    try:
        async with asyncio.timeout(20):
            while sup.dispatcher is None or sup.dispatcher.loads() != [0, 0]:  # noqa: ASYNC110 - its thread
                await asyncio.sleep(0.01)
        sup.stop()
        assert await asyncio.wait_for(run, 20) == 0  # before: 15, each worker killed by the SIGTERM
        assert [s.proc.returncode for s in sup.slots if s.proc is not None] == [0, 0]
    finally:
        listener.close()
        for slot in sup.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                slot.proc.kill()
