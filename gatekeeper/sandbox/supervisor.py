"""``python -m gatekeeper.sandbox.supervisor DIR``: the sandbox's kubelet for memory-limited apiservers.

``sandbox up --apiserver-memory-limit`` starts it (recorded in ``sandbox.json``, so ``sandbox down`` stops it
first). Twice a second it reads each apiserver's cgroup: an apiserver that is gone *and* whose cgroup counted a
new OOM kill is restarted after kubelet's back-off (``restarts.py``), into the same cgroup, with the same argv,
environment and log. Every kill and restart is logged, appended to ``DIR/apiserver-events.jsonl``
(wall time, component, event, the cgroup's kill count, the back-off) and counted in ``sandbox.json``
(``extra.apiserver_oom_kills``, ``extra.apiserver_restarts``). A process that exits without an OOM kill is
left alone: that is a deliberate stop or a crash to look at, not the incident.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.memlimit import MemoryCgroup
from gatekeeper.sandbox.restarts import BackOff
from gatekeeper.sandbox.state import ProcessRecord, SandboxState

NAME = "apiserver-supervisor"
EVENTS = "apiserver-events.jsonl"
TICK_SECONDS = 0.5


class Supervisor:
    def __init__(self, directory: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.clock = clock
        state = SandboxState.load(directory)
        self.version = int(state.extra.get("memory_cgroup_version", 1))
        self.kills: dict[str, int] = {}
        self.backoff: dict[str, BackOff] = {}
        for rec in self.watched(state):
            self.kills[rec.name] = self.group(rec).oom_kills()
            self.backoff[rec.name] = BackOff(started_at=clock())
        self.stopping = False

    @staticmethod
    def watched(state: SandboxState) -> list[ProcessRecord]:
        return [p for p in state.processes if p.name.startswith("kube-apiserver") and p.cgroup]

    def group(self, rec: ProcessRecord) -> MemoryCgroup:
        return MemoryCgroup(Path(rec.cgroup), self.version)

    def event(self, name: str, what: str, **more: object) -> None:
        line = {"time": round(time.time(), 3), "component": name, "event": what, **more}
        with open(self.directory / EVENTS, "a") as out:
            out.write(json.dumps(line) + "\n")
        print(f"{time.strftime('%H:%M:%S')} {name}: {what} {more}", flush=True)

    def tick(self) -> None:
        state = SandboxState.load(self.directory)
        now = self.clock()
        changed = False
        for rec in self.watched(state):
            kills = self.group(rec).oom_kills()
            backoff = self.backoff.setdefault(rec.name, BackOff(started_at=now))
            if kills > self.kills.get(rec.name, 0) and not processes.is_alive(rec.pid):
                self.kills[rec.name] = kills
                wait = backoff.killed(now)
                counts = state.extra.setdefault("apiserver_oom_kills", {})
                counts[rec.name] = counts.get(rec.name, 0) + 1
                changed = True
                self.event(rec.name, "oom_kill", cgroup_oom_kills=kills, restart_in_seconds=wait)
            if backoff.ready(now):
                fresh = processes.start(rec.name, rec.cmd, Path(rec.log), env=rec.env, ports=rec.ports,
                                        urls=rec.urls, health=rec.health, cgroup=rec.cgroup, cwd=self.directory)
                state.processes = [fresh if p.name == rec.name else p for p in state.processes]
                backoff.restarted(now)
                counts = state.extra.setdefault("apiserver_restarts", {})
                counts[rec.name] = counts.get(rec.name, 0) + 1
                changed = True
                self.event(rec.name, "restart", pid=fresh.pid, restarts=backoff.restarts,
                           next_backoff_seconds=backoff.delay)
        if changed:
            state.save()

    def run(self) -> None:
        def stop(_signum: int, _frame: FrameType | None) -> None:
            self.stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        while not self.stopping:
            try:
                self.tick()
            except (OSError, ValueError) as exc:  # a state file being rewritten: the next tick reads it whole
                print(f"tick failed: {exc}", flush=True)
            time.sleep(TICK_SECONDS)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m gatekeeper.sandbox.supervisor STATE_DIR", file=sys.stderr)
        return 2
    Supervisor(Path(argv[0])).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
