"""``gogc``: "High memory usage until we restart the apiserver ... GOGC 100 -> 50", separated from the data.

The seed's claims are about the garbage collector, so nothing else may move memory:

* the object count stays constant: each run pre-creates a fixed set of 64 KiB Secrets, and the churn
  rewrites their data, replaces one now and then (create + delete), and LISTs them all periodically
  (``users.SteadyChurnUser``, at a constant rate so both arms carry the same load);
* every run has its own fresh sandbox (etcd included), its apiservers restarted with the arm's GOGC right
  after ``up`` and before any load: ``UpOptions.gogc`` would set GOGC for etcd too, and the seed tuned
  only the apiserver;
* the arms are interleaved (100, 50, 100, 50, ...) and repeated, and every figure is the median over an
  arm's runs with its range, so a drift of the shared machine's load does not pass for an effect.

Each run has two apiserver lives under the same churn: the first from the start of the churn, the second
after all apiservers are restarted while the churn goes on. Both are measured over the same window after
the same warm-up, so "freed by a restart" compares equal loads, not a loaded apiserver with an idle one.
The restart runs in a child process: the apiservers it stops would otherwise be reaped by this process
while Locust runs, and their CPU would be counted as Locust's (``run_locust`` reads Locust's CPU from
RUSAGE_CHILDREN); only the child's own start-up, about a CPU second, still is.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from loadtest.harness import cluster
from loadtest.harness.cluster import ScenarioError, kit
from loadtest.harness.report import MIB, Report, line_plot
from loadtest.harness.run import REPO, RunContext, ms, run_locust
from loadtest.harness.sampler import GO_FIGURES, Sampler, proc_figures, write_rows
from loadtest.scenarios.gogc_figures import (
    FREED_MIN,
    GROWTH_MIN,
    Series,
    Spread,
    gauge_sum,
    growth_verdict,
    in_window,
    lower_memory_verdict,
    rate_sum,
    restart_verdict,
    slope_per_min,
)

NAME = "gogc"
ARMS = (100, 50)
RUNS = 3
NS = "loadtest-gogc"
SECRET_BYTES = 64 * 1024
CLAIM = """High memory usage until we restart the apiserver: the apiserver frees up to 40% of its memory when
restarted. Main suspect: garbage collection. Tuned GOGC from the default 100 to 50. Result: lower memory
utilisation and no more growth over time. (seed 000, KubeCon EU 2025)"""
RESTART = ("import sys; from pathlib import Path; from gatekeeper.sandbox.state import SandboxState; "
           "from loadtest.harness.cluster import restart_apiservers; "
           "print(restart_apiservers(SandboxState.load(Path(sys.argv[1]))))")
"""The child that restarts every apiserver with its recorded command and env (GOGC included)."""
METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


@dataclass(frozen=True)
class Plan:
    """One run's sizes and times, from ``--scale``. At 1: 8 users, 400 Secrets, 50 s warm-up and 30 s windows,
    about 200 s a run with its sandbox (six runs in about 21 minutes on 2 cores); sandbox up, the two restarts
    and down are about 40 s of each run whatever the scale."""

    users: int
    objects: int
    """Secrets pre-created per run (the constant count)."""
    warmup: float
    """Seconds from the start of a life (churn start, or all apiservers ready again) to its window."""
    window: float
    """Seconds measured in each life."""
    rate: float = 4.0
    """Requests per second per user."""
    list_every: float = 10.0
    """Seconds between one user's LISTs of all the Secrets."""

    @classmethod
    def at(cls, ctx: RunContext) -> Plan:
        return cls(users=ctx.n(8, 2), objects=ctx.n(400, 8), warmup=max(3.0, 50 * ctx.scale),
                   window=max(4.0, 30 * ctx.scale))


@dataclass(frozen=True)
class Edge:
    """Every apiserver's figures read at one moment."""

    t: float
    """Sampler seconds."""
    columns: dict[str, Series]
    """By sample column (``rss_bytes``, ``gc_cycles``, ...), then apiserver: one point each, at ``t``."""

    def of(self, column: str) -> Series:
        return self.columns.get(column, {})


@dataclass
class RunResult:
    gogc: int
    run: int
    order: int
    sampler: Sampler
    churn: float = float("nan")
    """Sampler seconds at which the churn's first requests were counted (the first life's start)."""
    life2: float = float("nan")
    """Sampler seconds at which every restarted apiserver was ready (the second life's start)."""
    restart_seconds: float = float("nan")
    secrets: tuple[int, int] = (0, 0)
    """The namespace's Secrets before the churn and after it: the count the churn must keep."""
    rows: dict[str, dict[str, str]] = field(default_factory=dict)
    load1: float = float("nan")
    edges: list[Edge] = field(default_factory=list)
    """The windows' edges: start and end of the first life's window, then of the second's."""
    figures: dict[str, float] = field(default_factory=dict)

    @property
    def arm(self) -> str:
        return f"GOGC={self.gogc}"

    @property
    def label(self) -> str:
        return self.sampler.arm


def _secret(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "labels": {"app": "steady"}},
            "data": {"blob": base64.b64encode(os.urandom(SECRET_BYTES)).decode()}}


def _preload(state: SandboxState, objects: int) -> None:
    path = f"/api/v1/namespaces/{NS}/secrets"
    with cluster.admin(state) as c, ThreadPoolExecutor(4) as pool:
        for i, r in enumerate(pool.map(lambda i: c.post(path, json=_secret(f"steady-{i:05d}")), range(objects))):
            if r.status_code != 201:
                raise ScenarioError(f"pre-create secret steady-{i:05d}: {r.status_code} {r.text[:300]}")


def _count(state: SandboxState) -> int:
    with cluster.admin(state) as c:
        r = c.get(f"/api/v1/namespaces/{NS}/secrets", headers={"accept": METADATA_ONLY})
    if r.status_code != 200:
        raise ScenarioError(f"count secrets: {r.status_code} {r.text[:300]}")
    return len(r.json()["items"])


def _wait(sampler: Sampler, until: float, locust: threading.Thread) -> None:
    """Sleep until sampler second ``until``; fail fast if Locust ended early (the churn stopped)."""
    while time.monotonic() - sampler.t0 < until:
        if not locust.is_alive():
            raise ScenarioError(f"{sampler.arm}: Locust ended before the measurements did")
        time.sleep(0.2)


def _churn_start(sampler: Sampler, locust: threading.Thread, history: Path, timeout: float = 180) -> float:
    """The sampler second at which Locust had counted its first request (its stats history, written every
    second): the first life starts there. Not the sampler's request counter: /metrics is read only every few
    seconds, and a late start would give the first life a longer warm-up than the second."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and locust.is_alive():
        with contextlib.suppress(OSError, ValueError, KeyError):
            with history.open() as fh:
                if any(r["Name"] == "Aggregated" and int(r["Total Request Count"]) > 0 for r in csv.DictReader(fh)):
                    return time.monotonic() - sampler.t0
        time.sleep(0.2)
    raise ScenarioError(f"{sampler.arm}: Locust counted no request within {timeout:.0f} s")


def _edge(state: SandboxState, sampler: Sampler) -> Edge:
    """Every apiserver's counters and gauges read at one moment, all at once: the window's edges.

    The sampler reads /metrics one apiserver after another, and a loaded apiserver takes seconds to render its
    megabyte of metrics, so its series may hold fewer than two points in a short window; counters are
    differenced between these edge readings instead, over the time between them."""
    recs = cluster.apiserver_records(SandboxState.load(Path(state.dir)))  # the child's restart rewrote the pids

    def read(rec: Any) -> tuple[str, dict[str, float]]:
        out: dict[str, float] = {}
        with cluster.admin(state, rec.urls["server"], timeout=30) as c:
            text = c.get("/metrics").text
        figures = proc_figures(rec.pid)  # right after the page: its counters and the CPU read close together
        if figures:
            out["rss_bytes"], out["cpu_seconds"] = float(figures[0]), figures[1]
        out["requests"] = kit.metric_sum(text, "apiserver_request_total", resource="secrets")
        out["heap_bytes"] = kit.metric_sum(text, "go_memstats_heap_alloc_bytes")
        out.update({col: kit.metric_sum(text, metric) for col, metric in GO_FIGURES.items()})
        return rec.name, out

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(recs)) as pool:
        read_all = list(pool.map(read, recs))
    t = (t0 + time.monotonic()) / 2 - sampler.t0
    columns: dict[str, Series] = {}
    for name, values in read_all:
        for col, v in values.items():
            columns.setdefault(col, {})[name] = [(t, v)]
    return Edge(t, columns)


def _restart_in_child(state: SandboxState) -> float:
    p = subprocess.run([sys.executable, "-c", RESTART, state.dir], cwd=REPO, capture_output=True, text=True,
                       timeout=400)
    if p.returncode != 0:
        raise ScenarioError(f"restart apiservers under churn: {p.stderr[-2000:]}")
    return float(p.stdout.strip().splitlines()[-1])


def _one_run(ctx: RunContext, report: Report, plan: Plan, gogc: int, run: int, order: int) -> RunResult:
    label, began = f"GOGC={gogc}-run{run}", time.monotonic()
    with cluster.sandbox(ctx.work / f"sandbox-{order}", None, ctx.log) as state:
        report.use_sandbox(state)
        cluster.restart_apiservers(state, env={"GOGC": str(gogc)})
        identities = cluster.tenants(state, NS, plan.users, ctx.work)
        _preload(state, plan.objects)
        before = _count(state)
        stop = ctx.work / f"stop-{order}"
        stop.unlink(missing_ok=True)
        history = ctx.out / f"{label}_stats_history.csv"
        history.unlink(missing_ok=True)  # an earlier report's in the same --out would say the churn had begun
        run_time = 2 * (plan.warmup + plan.window) + 600  # an upper bound: the users leave when ``stop`` exists
        spec = {"user_classes": ["loadtest.harness.users:SteadyChurnUser"], "users": plan.users,
                "spawn_rate": plan.users, "run_time": run_time, "until_done": True,
                "targets": state.apiserver_urls, "identities": identities, "namespace": NS,
                "ca": str(SandboxPKI(Path(state.certs_dir)).ca), "secret_bytes": SECRET_BYTES,
                "objects": plan.objects, "rate": plan.rate, "list_every": plan.list_every,
                "stop_file": str(stop)}
        sampler = Sampler(state, label, count={"resource": "secrets"}, interval=1.0,
                          metrics_interval=5.0, follow_restarts=True)
        result = RunResult(gogc, run, order, sampler)
        failure: list[BaseException] = []

        def churn() -> None:
            try:
                result.rows = run_locust(ctx, result.label, spec, timeout=run_time)
            except BaseException as exc:  # a thread's exception is lost otherwise
                failure.append(exc)

        locust = threading.Thread(target=churn, name=f"locust-{result.label}", daemon=True)
        with sampler:
            locust.start()
            try:
                result.churn = _churn_start(sampler, locust, history)
                sampler.mark("churn")
                for life in (1, 2):
                    start = result.churn if life == 1 else result.life2
                    _wait(sampler, start + plan.warmup, locust)
                    result.edges.append(_edge(state, sampler))
                    _wait(sampler, start + plan.warmup + plan.window, locust)
                    result.edges.append(_edge(state, sampler))
                    if life == 1:
                        sampler.mark("restart all apiservers")
                        result.restart_seconds = _restart_in_child(state)
                        result.life2 = sampler.mark("all restarted apiservers ready")
            finally:
                stop.touch()
                locust.join(run_time + 180)
        if failure:
            raise failure[0]
        result.secrets = (before, _count(SandboxState.load(Path(state.dir))))
        result.load1 = os.getloadavg()[0]
    result.figures = figures(result, plan)
    result.figures["run_s"] = time.monotonic() - began
    f = result.figures
    ctx.say(f"  {result.label}: RSS {f['rss_life1_mib']:.0f} -> {f['rss_life2_mib']:.0f} MiB across the restart, "
            f"{f['gc_per_min']:.1f} GC/min, {f['cpu_ms_per_request']:.1f} CPU ms per request, "
            f"Secrets {before} -> {result.secrets[1]}")
    return result


def figures(r: RunResult, plan: Plan) -> dict[str, float]:
    """The run's figures over its two windows (see ``gogc_figures``): gauges are averaged over the sampler's
    points in a window and its two edge readings, counters differenced between the edges."""
    s = r.sampler

    def gauge(life: int, column: str) -> float:
        start, end = r.edges[2 * life - 2], r.edges[2 * life - 1]
        sampled = s.series("kube-apiserver", column)
        names = {*sampled, *start.of(column), *end.of(column)}
        merged = {n: [*sampled.get(n, []), *start.of(column).get(n, []), *end.of(column).get(n, [])] for n in names}
        return gauge_sum(merged, start.t, end.t)

    def rate(column: str) -> float:
        start, end = r.edges[0].of(column), r.edges[1].of(column)
        return rate_sum({n: [*start[n], *end.get(n, [])] for n in start}, r.edges[0].t, r.edges[1].t)

    rss1, rss2 = gauge(1, "rss_bytes"), gauge(2, "rss_bytes")
    cpu, req = rate("cpu_seconds"), rate("requests")
    t0, t1 = r.edges[0].t, r.edges[1].t
    edge_rss = [(e.t, sum(v for points in e.of("rss_bytes").values() for _, v in points)) for e in r.edges[:2]
                if len(e.of("rss_bytes")) == len(s.series("kube-apiserver", "rss_bytes"))]  # only whole sums
    slope = slope_per_min(sorted(in_window(s.summed("kube-apiserver", "rss_bytes"), t0, t1) + edge_rss)) / MIB
    agg = r.rows.get("Aggregated")
    return {
        "rss_life1_mib": rss1 / MIB, "rss_life2_mib": rss2 / MIB, "freed_pct": (1 - rss2 / rss1) * 100,
        "rss_slope_mib_per_min": slope, "rss_growth_pct_per_min": slope / (rss1 / MIB) * 100,
        "heap_inuse_mib": gauge(1, "heap_inuse_bytes") / MIB,
        "heap_released_mib": gauge(1, "heap_released_bytes") / MIB,
        "heap_alloc_mib": gauge(1, "heap_bytes") / MIB,
        "gc_per_min": rate("gc_cycles") * 60,
        "cpu_cores": cpu, "secret_requests_per_s": req, "cpu_ms_per_request": cpu / req * 1000 if req else float("nan"),
        "window_s": t1 - t0, "restart_s": r.restart_seconds, "locust_req_per_s": ms(agg, "Requests/s"),
        "locust_failures": ms(agg, "Failure Count"),
    }


ROWS = [  # (figure key, what the report calls it, digits)
    ("rss_life1_mib", "RSS MiB, sum of 3, mean over the window", 0),
    ("heap_inuse_mib", "Go heap in use MiB (go_memstats_heap_inuse_bytes)", 0),
    ("heap_released_mib", "Go heap released to the OS MiB (go_memstats_heap_released_bytes)", 0),
    ("heap_alloc_mib", "Go heap allocated MiB (go_memstats_heap_alloc_bytes, incl. garbage)", 0),
    ("gc_per_min", "GC cycles per minute, sum of 3 (go_gc_duration_seconds_count)", 1),
    ("cpu_cores", "apiserver CPU, cores (user+system from /proc)", 2),
    ("secret_requests_per_s", "Secret requests served per s (apiserver_request_total)", 1),
    ("cpu_ms_per_request", "apiserver CPU ms per Secret request", 1),
    ("rss_slope_mib_per_min", "RSS slope over the window MiB/min", 1),
    ("rss_growth_pct_per_min", "RSS slope over the window, % of RSS per min", 1),
    ("rss_life2_mib", "RSS MiB after the restart, same warm-up and window", 0),
    ("freed_pct", "freed by the restart, % (equal load)", 0),
    ("restart_s", "restart until all ready, s", 1),
    ("run_s", "the whole run (sandbox up to down), s", 0),
]


def run(ctx: RunContext) -> None:
    if ctx.adopt is not None:
        raise ScenarioError("gogc needs a fresh sandbox (and etcd) per run; it cannot use --state-dir")
    plan = Plan.at(ctx)
    report = Report(ctx.out, "gogc: apiserver memory at a constant object count, GOGC 100 vs 50", CLAIM)
    order = [(gogc, k) for k in range(1, RUNS + 1) for gogc in ARMS]  # interleaved: 100, 50, 100, 50, ...
    results = [_one_run(ctx, report, plan, gogc, k, i) for i, (gogc, k) in enumerate(order, 1)]
    write_rows(ctx.out / "samples.csv", [r.sampler for r in results])
    _write_runs(ctx.out / "runs.csv", results)
    by_arm = {g: [r for r in results if r.gogc == g] for g in ARMS}
    spread = {g: {key: Spread.of([r.figures[key] for r in rs]) for key, _, _ in ROWS} for g, rs in by_arm.items()}
    report.csvs += ["runs.csv", "samples.csv", *[f"{r.label}_stats.csv" for r in results]]
    report.setup["load"] = (
        f"per run: a fresh sandbox (etcd + 3 apiservers, restarted with the arm's GOGC before any load), "
        f"{plan.objects} Secrets of {SECRET_BYTES // 1024} KiB pre-created; {plan.users} tenant users at "
        f"{plan.rate:g} req/s each: updates of their Secrets' data, every 20th a replacement (create + delete, "
        f"count constant), and a LIST of all Secrets every {plan.list_every:g} s per user")
    report.setup["windows"] = (
        f"warm-up {plan.warmup:.0f} s, then a {plan.window:.0f} s window, in each life: from the first churn "
        "request, and again from all apiservers ready after a restart under the same churn")
    report.setup["runs"] = f"{RUNS} per arm, interleaved: " + ", ".join(r.label for r in results)
    report.setup["failures"] = ("Locust's failures are requests sent while the apiservers restart: refused "
                                "connections, then 403s (and the odd 503) from an apiserver that serves before "
                                "it is ready, its RBAC cache not yet filled (each run's _failures.csv); the "
                                "second life, and its warm-up, start once every apiserver is ready")
    v_restart = restart_verdict([r.figures["freed_pct"] / 100 for r in by_arm[100]])
    v_lower = lower_memory_verdict([r.figures["rss_life1_mib"] * MIB for r in by_arm[100]],
                                   [r.figures["rss_life1_mib"] * MIB for r in by_arm[50]])
    v_growth = growth_verdict([r.figures["rss_growth_pct_per_min"] for r in by_arm[100]],
                              [r.figures["rss_growth_pct_per_min"] for r in by_arm[50]])
    a, b = spread[100], spread[50]

    def ratio(key: str) -> str:
        return f"x{b[key].median / a[key].median:.2f}" if a[key].median else "n/a"

    report.seed_vs_ours += [
        ("RSS freed by a restart, equal load and warm-up (GOGC=100)", "up to 40%",
         f"{a['freed_pct'].fmt(0, '%')}: {v_restart.word}"),
        ("RSS freed by a restart, equal load and warm-up (GOGC=50)", "(not given)", b["freed_pct"].fmt(0, "%")),
        ("RSS, GOGC 50 vs 100", "lower", f"{ratio('rss_life1_mib')} ({b['rss_life1_mib'].fmt(0)} vs "
         f"{a['rss_life1_mib'].fmt(0)} MiB): {v_lower.word}"),
        ("RSS growth over time, GOGC 100 -> 50", "stops growing",
         f"{a['rss_growth_pct_per_min'].fmt(1)} -> {b['rss_growth_pct_per_min'].fmt(1)} %/min: {v_growth.word}"),
        ("GC cycles per minute, GOGC 50 vs 100", "(not given)",
         f"{ratio('gc_per_min')} ({b['gc_per_min'].fmt(1)} vs {a['gc_per_min'].fmt(1)})"),
        ("apiserver CPU per Secret request, GOGC 50 vs 100 (GOGC 50's price)", "(not given)",
         f"{ratio('cpu_ms_per_request')} ({b['cpu_ms_per_request'].fmt(1)} vs {a['cpu_ms_per_request'].fmt(1)} ms)"),
    ]
    report.text(
        "### Which of the seed's claims hold on this v1.37 sandbox\n\n"
        "Median (min-max) over the runs of each arm. \"Lower\" means the median is lower and the ranges do not "
        f"overlap; a restart \"frees\" memory when every run's RSS after it is at least {FREED_MIN:.0%} lower "
        f"at the same load and warm-up; an arm \"grows\" when every run's RSS slope exceeds {GROWTH_MIN:g} % of "
        "its RSS per minute over the window.\n\n"
        f"1. *A restart frees up to 40 % (GOGC=100).* {v_restart}.\n"
        f"2. *GOGC 50 lowers memory.* {v_lower}.\n"
        f"3. *GOGC 50 stops growth over time.* {v_growth}. (Growth here is the RSS slope over the "
        f"{plan.window:.0f} s window after {plan.warmup:.0f} s of churn, minutes into an apiserver's life; the "
        "seed's growth was over days.)\n\n"
        f"The price of GOGC 50: {ratio('gc_per_min')} the GC cycles per minute and {ratio('cpu_ms_per_request')} "
        f"the apiserver CPU per Secret request, at {ratio('secret_requests_per_s')} the requests served.")
    report.table(["figure (median, min-max)", f"GOGC=100 ({a['rss_life1_mib'].n} runs)",
                  f"GOGC=50 ({b['rss_life1_mib'].n} runs)", "50 / 100 (medians)"],
                 [[what, a[key].fmt(d), b[key].fmt(d), ratio(key)] for key, what, d in ROWS],
                 "Per arm: the first life's window (the restart rows: the second life's)")
    report.table(["run", "RSS MiB", "heap in use MiB", "GC/min", "CPU ms/req", "RSS after restart MiB", "freed",
                  "Secrets before -> after", "Locust failures"],
                 [[r.label, f"{r.figures['rss_life1_mib']:.0f}", f"{r.figures['heap_inuse_mib']:.0f}",
                   f"{r.figures['gc_per_min']:.1f}", f"{r.figures['cpu_ms_per_request']:.1f}",
                   f"{r.figures['rss_life2_mib']:.0f}", f"{r.figures['freed_pct']:.0f}%",
                   f"{r.secrets[0]} -> {r.secrets[1]}", f"{r.figures['locust_failures']:.0f}"] for r in results],
                 "Per run, in the order run (all in runs.csv)")
    _plots(report, results)
    report.write()


def _write_runs(path: Path, results: list[RunResult]) -> None:
    keys = [key for key, _, _ in ROWS] + ["window_s", "locust_req_per_s", "locust_failures"]
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["order", "arm", "gogc", "run", "secrets_before", "secrets_after", "load1", *keys])
        for r in results:
            w.writerow([r.order, r.arm, r.gogc, r.run, *r.secrets, f"{r.load1:.2f}",
                        *[f"{r.figures[k]:.3f}" for k in keys]])


def _plots(report: Report, results: list[RunResult]) -> None:
    def aligned(r: RunResult, column: str) -> list[tuple[float, float]]:
        return [(t - r.churn, v) for t, v in r.sampler.summed("kube-apiserver", column)]

    first = results[0]
    events = [(t - first.churn, what) for t, what in first.sampler.events if what != "churn"]
    line_plot(report.plot("rss.png", "Apiserver RSS (sum of 3) per run, from the churn's start; a restart of all "
                          "apiservers half way (marked for the first run)"),
              "Apiserver RSS, sum of 3", "MiB", {r.label: aligned(r, "rss_bytes") for r in results},
              events=events, scale=MIB, xlabel="seconds since the churn started")
    line_plot(report.plot("heap.png", "Apiserver Go heap in use (go_memstats_heap_inuse_bytes, sum of 3) per run"),
              "Apiserver Go heap in use, sum of 3", "MiB", {r.label: aligned(r, "heap_inuse_bytes") for r in results},
              events=events, scale=MIB, xlabel="seconds since the churn started")
