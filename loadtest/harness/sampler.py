"""Time series of the components' own figures while a load runs: /proc (RSS, CPU) and their /metrics.

A background thread samples every ``interval`` seconds. Processes are looked up
by name in the sandbox state on every tick, so an apiserver restarted mid-run
(skew, gogc) is followed to its new pid. Each apiserver's /metrics gives the Go
heap (``go_memstats_heap_alloc_bytes``: RSS hides freed-but-mapped memory) and a
request counter (``apiserver_request_total`` for the verbs and resource the
scenario drives), so per-apiserver shares come from the servers themselves.
"""

from __future__ import annotations

import contextlib
import csv
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from gatekeeper.sandbox.state import SandboxState
from loadtest.harness import sockets
from loadtest.harness.cluster import admin, kit

FIELDS = ["arm", "t", "component", "rss_bytes", "cpu_seconds", "heap_bytes", "requests", "executing", "connections"]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_figures(pid: int) -> tuple[int, float] | None:
    """(RSS bytes, user+system CPU seconds) of ``pid`` and every process in its process group, or None.

    Sandbox components lead their own group (``start_new_session``), so a
    multi-worker webhook or proxy counts its workers too.
    """
    rss, cpu, seen = 0, 0.0, False
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(d.name) != pid and int(fields[2]) != pid:
                continue
            status = (d / "status").read_text()
        except (OSError, IndexError, ValueError):
            continue
        vm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), None)
        if vm is None:  # a zombie or a kernel thread: no memory of its own to report
            continue
        seen = True
        rss += vm
        cpu += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return (rss, cpu) if seen else None


GO_FIGURES = {"heap_inuse_bytes": "go_memstats_heap_inuse_bytes",
              "heap_released_bytes": "go_memstats_heap_released_bytes",
              "gc_cycles": "go_gc_duration_seconds_count"}
"""More of each apiserver's Go runtime figures, one column each (gogc): heap in use and returned to the OS
split RSS into live data and what the runtime still holds, and the GC counter gives GOGC's price in cycles."""
FIELDS += list(GO_FIGURES)


@dataclass
class Sampler:
    state: SandboxState
    arm: str
    components: Sequence[str] = ("kube-apiserver",)
    """Process-name prefixes to follow (``kube-apiserver`` matches every apiserver)."""
    count: dict[str, str] = field(default_factory=dict)
    """Labels selecting the ``apiserver_request_total`` series to count, e.g. ``{"resource": "secrets"}``."""
    interval: float = 0.5
    extra_pids: dict[str, int] = field(default_factory=dict)
    """More processes to follow by pid (the gatekeeper proxy, HAProxy, the webhook)."""
    rows: list[dict[str, object]] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)

    metrics_interval: float = 1.0
    """/metrics is scraped on its own thread: a busy apiserver answers it slowly, and /proc must not wait."""
    heap_urls: dict[str, str] = field(default_factory=dict)
    """More components whose /metrics give ``go_memstats_heap_alloc_bytes`` (e.g. kube-scheduler's URL)."""

    apf_level: str = ""
    """A priority level whose executing requests are summed over the apiservers every ``apf_interval``
    (``/debug/api_priority_and_fairness/dump_priority_levels``, a few hundred bytes): the cluster-wide concurrency
    a budget promises. ``/metrics`` is megabytes under a storm, so its gauge sums moments up to seconds apart. Each
    tick is one nested sweep (see ``nested_sum``): ``apf-sum`` rows hold what either read saw, ``apf-held`` rows
    what both reads saw."""
    apf_interval: float = 0.1
    front_port: int = 0
    """The port of the front (HAProxy, a proxy) whose established connections to each apiserver are counted
    every tick (``connections``): the connection skew an L4 balancer keeps."""
    follow_restarts: bool = False
    """Read the processes from ``sandbox.json`` on every tick: the sandbox's supervisor restarts OOM-killed
    apiservers under new pids (a gap in an apiserver's series is the time it was down)."""

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._proc_loop, name=f"proc-{self.arm}", daemon=True),
                         threading.Thread(target=self._metrics_loop, name=f"metrics-{self.arm}", daemon=True)]
        if self.apf_level:
            self._threads.append(threading.Thread(target=self._apf_loop, name=f"apf-{self.arm}", daemon=True))
        self._lock = threading.Lock()
        self.t0 = time.monotonic()

    def __enter__(self) -> Sampler:
        self.t0 = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def mark(self, what: str) -> float:
        """Record an event (e.g. "restart kube-apiserver-2") at the current offset; returns the offset."""
        t = time.monotonic() - self.t0
        self.events.append((t, what))
        return t

    def wait_metrics(self, timeout: float = 10.0) -> bool:
        """Wait until every apiserver's /metrics has been read again since now: a run of a second or two may
        otherwise end between two scrapes and its requests (a WATCH is counted when it ends) go unseen."""
        since, deadline = self._now(), time.monotonic() + timeout
        want = len(self.state.apiserver_urls)
        while time.monotonic() < deadline:
            with self._lock:
                seen = {r["component"] for r in self.rows if r["requests"] != "" and float(str(r["t"])) > since}
            if len(seen) >= want:
                return True
            time.sleep(0.05)
        return False

    def _now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def _add(self, **row: object) -> None:
        with self._lock:
            self.rows.append({"arm": self.arm, "rss_bytes": "", "cpu_seconds": "", "heap_bytes": "", "requests": "",
                              "executing": "", "connections": "", **row})

    def _proc_loop(self) -> None:
        ports = [urlsplit(u).port or 443 for u in self.state.apiserver_urls]
        front = sockets.listener_group(self.front_port) if self.front_port else None
        while not self._stop.is_set():
            t = self._now()
            state = self.state
            if self.follow_restarts:
                with contextlib.suppress(OSError, ValueError):  # being rewritten: this tick uses the last one read
                    state = SandboxState.load(Path(self.state.dir))
            procs = [(p.name, p.pid) for p in state.processes if p.name.startswith(tuple(self.components))]
            for name, pid in procs + list(self.extra_pids.items()):
                figures = proc_figures(pid)
                if figures:
                    self._add(t=t, component=name, rss_bytes=figures[0], cpu_seconds=figures[1])
            if front is not None:
                counts = sockets.connections_to(front, ports)
                for i, port in enumerate(ports, 1):
                    self._add(t=t, component=f"kube-apiserver-{i}", connections=counts[port])
            self._stop.wait(self.interval)

    def _metrics_loop(self) -> None:
        clients = [admin(self.state, u, timeout=10) for u in self.state.apiserver_urls]
        others = {name: admin(self.state, u, timeout=10) for name, u in self.heap_urls.items()}
        try:
            while not self._stop.is_set():
                t = self._now()
                for i, c in enumerate(clients, 1):
                    with contextlib.suppress(httpx.HTTPError):
                        text = c.get("/metrics").text
                        self._add(t=t, component=f"kube-apiserver-{i}",
                                  heap_bytes=kit.metric_sum(text, "go_memstats_heap_alloc_bytes"),
                                  requests=kit.metric_sum(text, "apiserver_request_total", **self.count),
                                  executing=kit.metric_sum(text, "apiserver_flowcontrol_current_executing_requests",
                                                           flow_schema=kit.OBSERVE),
                                  **{col: kit.metric_sum(text, metric) for col, metric in GO_FIGURES.items()})
                for name, c in others.items():
                    with contextlib.suppress(httpx.HTTPError):
                        r = c.get("/metrics")
                        if r.status_code == 200:
                            self._add(t=t, component=name,
                                      heap_bytes=kit.metric_sum(r.text, "go_memstats_heap_alloc_bytes"))
                self._stop.wait(self.metrics_interval)
        finally:
            for c in [*clients, *others.values()]:
                c.close()

    def _apf_loop(self) -> None:
        clients = [admin(self.state, u, timeout=5) for u in self.state.apiserver_urls]

        def executing(c: httpx.Client) -> int | None:
            try:
                text = c.get(kit.APF_DUMP).text
            except httpx.HTTPError:
                return None
            return kit.apf_executing(text, self.apf_level)

        try:
            while not self._stop.is_set():
                t = self._now()
                out = [executing(c) for c in clients]
                back = [executing(c) for c in reversed(clients)][::-1]
                if all(v is not None for v in out + back):
                    seen, held = nested_sum([v or 0 for v in out], [v or 0 for v in back])
                    self._add(t=t, component="apf-sum", executing=seen)
                    self._add(t=t, component="apf-held", executing=held)
                self._stop.wait(self.apf_interval)
        finally:
            for c in clients:
                c.close()

    def series(self, component_prefix: str, column: str) -> dict[str, list[tuple[float, float]]]:
        """Per component: [(t, value)] of numeric samples of ``column``."""
        out: dict[str, list[tuple[float, float]]] = {}
        for r in self.rows:
            name = str(r["component"])
            v = r.get(column, "")  # a column only some rows carry (GO_FIGURES: the apiservers' /metrics rows)
            if name.startswith(component_prefix) and v != "":
                out.setdefault(name, []).append((float(r["t"]), float(v)))  # type: ignore[arg-type]
        return out

    def summed(self, component_prefix: str, column: str) -> list[tuple[float, float]]:
        """Sum over matching components per tick (ticks where any of them had no value are skipped)."""
        per = self.series(component_prefix, column)
        by_t: dict[float, list[float]] = {}
        for points in per.values():
            for t, v in points:
                by_t.setdefault(t, []).append(v)
        return [(t, sum(vs)) for t, vs in sorted(by_t.items()) if len(vs) == len(per)]

    def peak(self, component_prefix: str, column: str) -> float:
        return max((v for _, v in self.summed(component_prefix, column)), default=0.0)

    def first(self, component_prefix: str, column: str) -> float:
        s = self.summed(component_prefix, column)
        return s[0][1] if s else 0.0


def nested_sum(out: Sequence[int], back: Sequence[int]) -> tuple[int, int]:
    """Executing requests summed over apiservers read one after another, then again in reverse (``back`` indexed
    as ``out``): (seen by either read, seen by both).

    No sum of separate reads is one instant. A LIST that ends on one apiserver while the next starts on another is
    seen on both by reads a few milliseconds apart, so "either" overcounts hand-offs, which a budget makes every
    few hundred milliseconds. The reverse sweep nests every apiserver's two reads around all later ones', so a
    request counted by "both" ran across the whole inner window: a LIST outlasts a sweep by two orders of
    magnitude, and an overlap that holds memory is seen there, while a hand-off is not.
    """
    if len(out) != len(back):
        raise ValueError("one value per apiserver in each sweep")
    pairs = list(zip(out, back, strict=True))
    return sum(max(p) for p in pairs), sum(min(p) for p in pairs)


def write_rows(path: Path, samplers: Iterable[Sampler]) -> int:
    """All samplers' rows into one CSV (one header); returns the number of rows."""
    n = 0
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        for s in samplers:
            w.writerows(s.rows)
            n += len(s.rows)
    return n
