"""``gatekeeper proxy --workers N``: N proxy processes on one port under a supervising parent.

One Python event loop tops out at one core. Hand-off, restarts, hang kills, signals, metrics and the runtime directory
are described in docs/proxy/workers.md."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout

from gatekeeper.base.config import ConfigError, load_config
from gatekeeper.base.errors import UsageError
from gatekeeper.proxy import rejections
from gatekeeper.proxy.flowcontrol.edge.ledger import SeatLedger
from gatekeeper.proxy.handoff.dispatcher import HandoffDispatcher
from gatekeeper.proxy.handoff.protocol import ClosedCounts
from gatekeeper.proxy.listen.conn_metrics import HANDED_OFF, HANDOFF_STALLS, HANDOFF_TAKEN_BACK, HANDOFF_WAITS
from gatekeeper.proxy.settings import ProxySettings
from gatekeeper.proxy.worker_metrics import start_parent_listener
from gatekeeper.runtime import tempdirs
from gatekeeper.runtime.metrics import absorb_dead_process
from gatekeeper.runtime.tasks import stop_task
from gatekeeper.serving.netbind import bind_listeners

log = logging.getLogger("gatekeeper.proxy.workers")

MAX_BACKOFF = 10.0
STABLE_SECONDS = 10.0
"""A worker that ran this long before dying is restarted without backoff."""
PARENT_ENV = "GATEKEEPER_PROXY_PARENT"
"""The supervisor's pid, in each worker's environment: a worker started after its parent died exits."""
KILL_GRACE = 10.0
"""After SIGTERM, a worker still running this long past ``protocol.shutdownTimeoutSeconds`` is SIGKILLed."""


@dataclass
class _Slot:
    index: int
    proc: asyncio.subprocess.Process | None = None
    started: float = 0.0
    restarts: int = 0
    quick_deaths: int = 0
    ready_once: bool = False
    answered: float = 0.0
    """When the current worker last answered a heartbeat (or was first seen serving)."""
    hung_kills: int = 0


class WorkerSupervisor:
    """Starts, watches and stops the workers; serves the proxy-wide metrics."""

    def __init__(self, settings: ProxySettings, config: Path, workers: int, runtime: Path, port: int,
                 listeners: list[socket.socket]) -> None:
        """``listeners``: the TLS port's listening sockets; the parent accepts and hands connections over."""
        self.settings = settings
        self.config = config
        self.runtime = runtime
        self.port = port
        self.slots = [_Slot(i) for i in range(workers)]
        self.stopping = asyncio.Event()
        self.fatal: int | None = None
        self.ledger = SeatLedger.create(runtime / "ledger", workers)
        self.dispatcher = HandoffDispatcher(listeners, ClosedCounts.create(runtime / "closed", workers), workers,
                                     on_handoff=lambda w: HANDED_OFF.labels(worker=str(w)).inc(),
                                     on_wait=HANDOFF_WAITS.inc,
                                     on_stall=lambda w: HANDOFF_STALLS.labels(worker=str(w)).inc(),
                                     on_take_back=lambda w: HANDOFF_TAKEN_BACK.labels(worker=str(w)).inc(),
                                     max_connections=settings.listener.max_client_connections,
                                     on_refused=lambda n: rejections.reject(
                                         "connection_cap", "%d client connections open in all workers "
                                         "(maxClientConnections)", n))

    async def _spawn(self, slot: _Slot) -> None:
        argv = [sys.executable, "-m", "gatekeeper", "proxy", "--config", str(self.config), "--workers", "1",
                "--worker-index", str(slot.index), "--runtime-dir", str(self.runtime), "--worker-port", str(self.port)]
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        (self.runtime / f"worker-{slot.index}.json").unlink(missing_ok=True)
        theirs = self.dispatcher.channel(slot.index)
        argv += ["--handoff-fd", str(theirs.fileno())]
        try:
            slot.proc = await asyncio.create_subprocess_exec(
                *argv, env=env, stdin=asyncio.subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()  # the worker has it; ours must go or its end never reads EOF
        slot.started = time.monotonic()
        slot.answered = 0.0
        log.info("worker %d started (pid %d)", slot.index, slot.proc.pid)
        if self.stopping.is_set():
            # SIGTERM arrived while this worker was starting: stop() could not reach it, and we would wait forever.
            with contextlib.suppress(ProcessLookupError):
                slot.proc.send_signal(signal.SIGTERM)

    async def _watch(self, slot: _Slot) -> None:
        while True:
            assert slot.proc is not None
            code = await slot.proc.wait()
            pid = slot.proc.pid
            self.dispatcher.retire(slot.index)  # what it had not read goes to the others
            slot.ready_once = slot.ready_once or (self.runtime / f"worker-{slot.index}.json").exists()
            self._forget(slot.index, pid)
            if self.stopping.is_set():
                return
            lived = time.monotonic() - slot.started
            if not slot.ready_once and code == 2:
                log.error("worker %d exited 2 before serving (a configuration error): stopping", slot.index)
                self.fatal = 2
                self.stop()
                return
            slot.quick_deaths = 0 if lived >= STABLE_SECONDS else slot.quick_deaths + 1
            delay = 0.0 if slot.quick_deaths == 0 else min(MAX_BACKOFF, 0.25 * 2 ** slot.quick_deaths)
            log.warning("worker %d (pid %d) exited with %s after %.1fs; restarting in %.1fs",
                        slot.index, pid, code, lived, delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)
            if self.stopping.is_set():
                return
            slot.restarts += 1
            await self._spawn(slot)

    def _forget(self, index: int, pid: int) -> None:
        """A worker is gone: release its seats, drop its live-gauge files and its metrics address."""
        self.ledger.clear_worker(index)
        try:
            absorb_dead_process(pid)
        except Exception:  # never let bookkeeping stop the restart
            log.exception("folding worker %d's (pid %d) metric files into the archive failed", index, pid)
        (self.runtime / f"worker-{index}.json").unlink(missing_ok=True)

    def worker_urls(self) -> dict[int, str]:
        """Private metrics URLs of the live, serving workers, by worker index."""
        out = {}
        for slot, url, _ in self._serving():
            slot.ready_once = True
            out[slot.index] = url
        return out

    def describe(self) -> list[dict[str, Any]]:
        """``GET /workers`` on the metrics port: index, pid, restarts and private metrics URL of each worker."""
        out = []
        loads = self.dispatcher.loads()
        for slot in self.slots:
            info: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError):
                info = json.loads((self.runtime / f"worker-{slot.index}.json").read_text())
            pid = slot.proc.pid if slot.proc is not None else None
            alive = slot.proc is not None and slot.proc.returncode is None
            serving = alive and info.get("pid") == pid
            out.append({"index": slot.index, "pid": pid, "alive": alive, "restarts": slot.restarts,
                        "metricsUrl": info.get("metricsUrl") if serving else None,
                        "connections": loads[slot.index]})  # None: not taking connections
        return out

    async def _heartbeat(self) -> None:
        """Kill a serving worker whose private ``/healthz`` has not answered for ``workerHangSeconds``.

        A stuck or SIGSTOPped worker is alive, so ``_watch`` never notices, yet its connections hang and its
        seats stay taken. A late answer counts: a short probe timeout killed CPU-starved (busy, not hung)
        workers in a LIST storm, a cascade exactly when the cluster is loaded."""
        hang = self.settings.worker_hang_seconds
        if hang <= 0:
            return
        every = min(2.0, hang / 3)
        in_flight: dict[int, asyncio.Task[None]] = {}
        async with ClientSession(timeout=ClientTimeout(total=hang)) as session:

            async def probe(slot: _Slot, url: str, pid: int) -> None:
                with contextlib.suppress(Exception):
                    async with session.get(f"{url}/healthz") as resp:
                        await resp.read()
                        if slot.proc is not None and slot.proc.pid == pid:
                            slot.answered = time.monotonic()

            try:
                while not self.stopping.is_set():
                    now = time.monotonic()
                    for slot, url, pid in self._serving():
                        if slot.answered == 0.0:
                            slot.answered = now  # first seen serving: the clock starts now
                        elif now - slot.answered > hang and slot.proc is not None:
                            log.error("worker %d (pid %d) has not answered /healthz for %.0fs: killing it",
                                      slot.index, pid, now - slot.answered)
                            slot.hung_kills += 1
                            slot.answered = now  # one kill per hang; _watch reaps and restarts it
                            with contextlib.suppress(ProcessLookupError):
                                slot.proc.kill()
                        task = in_flight.get(slot.index)
                        if task is None or task.done():
                            in_flight[slot.index] = asyncio.create_task(probe(slot, url, pid))
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.stopping.wait(), every)
            finally:
                for task in in_flight.values():
                    task.cancel()
                await asyncio.gather(*in_flight.values(), return_exceptions=True)

    async def _reap_after_drain(self, watchers: list[asyncio.Task[None]]) -> None:
        """Wait for the workers' drains; SIGKILL any still running ``shutdownTimeoutSeconds`` + KILL_GRACE later,
        else a stuck worker would hold the port forever."""
        grace = self.settings.protocol.shutdown_timeout_seconds + KILL_GRACE
        _, late = await asyncio.wait(watchers, timeout=grace)
        if late:
            for slot in self.slots:
                if slot.proc is not None and slot.proc.returncode is None:
                    log.error("worker %d (pid %d) still running %.0fs after SIGTERM: killing it",
                              slot.index, slot.proc.pid, grace)
                    with contextlib.suppress(ProcessLookupError):
                        slot.proc.kill()
        await asyncio.gather(*watchers, return_exceptions=True)

    def _serving(self) -> list[tuple[_Slot, str, int]]:
        """(slot, private metrics URL, pid) of each live worker that has announced it serves."""
        out = []
        for slot in self.slots:
            with contextlib.suppress(OSError, ValueError, KeyError):
                info = json.loads((self.runtime / f"worker-{slot.index}.json").read_text())
                if slot.proc is not None and info.get("pid") == slot.proc.pid and slot.proc.returncode is None:
                    out.append((slot, str(info["metricsUrl"]), slot.proc.pid))
        return out

    def stop(self) -> None:
        if self.stopping.is_set():
            return
        self.stopping.set()
        # The port closes first. Closing a worker's socket is its signal to drain; a SIGTERM too raced that drain
        # and could kill it mid handler swap. Only a worker whose socket was not closed gets SIGTERM.
        closed = self.dispatcher.stop()
        for slot in self.slots:
            if slot.index in closed:
                continue
            if slot.proc is not None and slot.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(signal.SIGTERM)

    def _handoff_failed(self) -> None:
        """The hand-off thread died and closed the port: exit 1 rather than run port-less but ready."""
        log.error("the TLS port is closed (connection hand-off failed): stopping the proxy")
        self.fatal = 1
        self.stop()

    def reload(self) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(signal.SIGHUP)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop)
        loop.add_signal_handler(signal.SIGINT, self.stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        self.dispatcher.start(on_failure=lambda: loop.call_soon_threadsafe(self._handoff_failed))
        for slot in self.slots:
            await self._spawn(slot)
        watchers = [loop.create_task(self._watch(s)) for s in self.slots]
        heartbeat = loop.create_task(self._heartbeat(), name="gatekeeper-worker-heartbeat")
        runner = None
        lst = self.settings.listener
        if lst.metrics_port >= 0:
            runner, mport = await start_parent_listener(self, lst.metrics_address, lst.metrics_port)
            log.info("proxy metrics for all %d workers on http://%s:%d", len(self.slots), lst.metrics_address, mport)
        log.info("gatekeeper proxy: %d workers on https://%s:%d", len(self.slots), lst.address, self.port)
        try:
            await self.stopping.wait()
            await self._reap_after_drain(watchers)
            codes = [s.proc.returncode for s in self.slots if s.proc is not None]
        finally:
            self.dispatcher.stop()
            await stop_task(heartbeat)
            if runner is not None:
                await runner.cleanup()
        if self.fatal is not None:
            return self.fatal
        bad = [c for c in codes if c]
        return max((abs(c) for c in bad), default=0)


def snapshot_config(settings: ProxySettings, config: Path, runtime: Path) -> Path:
    """A private copy of the validated config file, for every worker the parent ever starts.

    Re-reading ``--config`` at each restart gave a replaced worker other settings than its siblings, and a bad edit a
    crash loop. Raises UsageError if the file changed between the check and the copy."""
    copy = runtime / "config.yaml"
    try:
        data = config.read_bytes()
    except OSError as exc:
        raise UsageError(f"{config}: cannot read config file: {exc.strerror}") from None
    fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    try:
        same = load_config(copy, need="proxy").proxy == settings
    except ConfigError:
        same = False
    if not same:
        raise UsageError(f"{config}: changed while the proxy was starting; start it again")
    return copy


def supervise(settings: ProxySettings, config: Path, workers: int) -> int:
    """The parent process: returns the exit code (0 when every worker drained cleanly). The command has called
    ``enable_multiprocess`` before importing this module."""
    runtime = tempdirs.make("gatekeeper-proxy-")  # stamped: a later start removes it if we are SIGKILLed
    lst = settings.listener
    try:
        # Bound, not listening: the dispatcher listens once a worker serves (port 0 resolves here, once).
        reserved = bind_listeners(lst.address, lst.port)
    except OSError as exc:
        shutil.rmtree(runtime, ignore_errors=True)
        raise UsageError(f"proxy.listener: cannot listen on {lst.address}:{lst.port}: {exc.strerror or exc}") from None
    port = int(reserved[0].getsockname()[1])
    try:
        snapshot = snapshot_config(settings, config, runtime)
        return asyncio.run(WorkerSupervisor(settings, snapshot, workers, runtime, port, reserved).run())
    finally:
        for sock in reserved:
            sock.close()
        shutil.rmtree(runtime, ignore_errors=True)
