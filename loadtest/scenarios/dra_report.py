"""dra-scale's figures and report: per-run rows (runs.csv), per-arm median and spread, ratios, plots.

Split from dra_scale.py (which runs the arms) so each stays readable. Every
figure is one run's; an arm's cell is the median over its runs with the
min-max spread beside it, because on a shared 2-core machine one run can be
off by the neighbours' load, and a ratio of single runs hid that before.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtest.harness.report import MIB, Report, line_plot
from loadtest.harness.rounds import compare
from loadtest.harness.run import RunContext, ms
from loadtest.harness.sampler import Sampler, write_rows

CLAIM = """DRA vs topology-aware scheduling, tested with KWOK (K8s 1.32) scaling from 0 to 4000 workloads:
scheduling latency: topology-aware was way more latency-affected; scheduler memory: 30 % saved with DRA;
apiserver memory: another 20 % saved."""

TOPOLOGY_ARM = """The seed's baseline, the topology-aware scheduler (sigs.k8s.io/scheduler-plugins, plugin
NodeResourceTopologyMatch, with topology.node.k8s.io/v1alpha2 NodeResourceTopology objects for the KWOK nodes),
is not an arm of this run: it could not be built here. An earlier attempt found v0.35.0 refused by the Go module
proxy. One other release was tried, v0.34.7 (the newest in the compatibility matrix of the project's README,
built with k8s v1.34.7): `go mod download -json sigs.k8s.io/scheduler-plugins@v0.34.7` succeeded, but building its
scheduler inside the module
(`GOTOOLCHAIN=local CGO_ENABLED=0 go build -trimpath -o .../kube-scheduler ./cmd/scheduler`, as
gatekeeper/sandbox/build.py builds k8s) failed on a dependency the proxy refuses:
`k8s.io/csi-translation-lib@v0.34.7: reading https://proxy.golang.org/k8s.io/csi-translation-lib/@v/v0.34.7.zip:
403 Forbidden, server response: This module version is not available.` (imported by
k8s.io/kubernetes@v1.34.7/pkg/scheduler/framework/plugins/nodevolumelimits). No further release was tried. So
the seed's -30 % / -20 % is neither confirmed nor refuted here; the device plugin here is the lightest
baseline, not the seed's."""


@dataclass(frozen=True)
class Arm:
    name: str
    addons: tuple[str, ...] = ()
    mapping: bool = False
    drop_slices: bool = False
    what: str = ""


ARMS = (
    Arm("device-plugin", drop_slices=True, what="nodes advertise nvidia.com/gpu; no webhook, no ResourceSlices"),
    Arm("dra-webhook", addons=("webhook",), what="gatekeeper webhook (dra) rewrites pods to ResourceClaimTemplates"),
    Arm("dra-kep5004", mapping=True, what="DeviceClass extendedResourceName: nvidia.com/gpu; unchanged pods"),
)


@dataclass
class ArmResult:
    """One run of one arm."""

    arm: Arm
    run: int
    sampler: Sampler
    pods: list[dict[str, Any]] = field(default_factory=list)
    """One row per pod: run, name, created/bound offsets, watch latency, condition latency, node."""
    rows: dict[str, dict[str, str]] = field(default_factory=dict)
    first_create: float = 0.0
    last_create: float = 0.0
    completion: float = float("nan")
    """Seconds from the first pod seen to the last pod bound."""
    claims_allocated: int = 0
    sli: dict[float, float] = field(default_factory=dict)
    """The scheduler's SLI histogram at the end of the run."""
    load: tuple[float, ...] = ()
    quiet_from: float = float("nan")
    quiet_to: float = float("nan")
    """The quiet window (sampler offsets): from the last pod bound for ``plan()["quiet"]`` seconds."""
    gc_heap: dict[str, float] = field(default_factory=dict)
    """Go heap right after a forced GC at the end of the quiet window, per component."""

    def latencies(self) -> list[float]:
        return sorted(p["latency_s"] for p in self.pods if p["latency_s"] != "")


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted ``values`` (NaN when empty)."""
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def histogram_quantile(buckets: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` (NaN without samples)."""
    total = buckets.get(math.inf, max(buckets.values(), default=0.0))
    for le in sorted(buckets):
        if total and buckets[le] >= q * total:
            return le
    return float("nan")


def window_min(sampler: Sampler, component: str, column: str, start: float, end: float) -> float:
    """The smallest sample of ``column`` within [start, end] (NaN if none): the memory the component kept once
    the ramp was over, rather than the moment before a GC."""
    values = [v for t, v in sampler.summed(component, column) if start <= t <= end]
    return min(values) if values else float("nan")


def figures(r: ArmResult) -> dict[str, float]:
    """Every figure of one run, by key (the columns of runs.csv)."""
    lat = r.latencies()
    cond = sorted(float(p["condition_latency_s"]) for p in r.pods if p["condition_latency_s"] != "")
    s = r.sampler
    created = [p["created_s"] for p in r.pods if p["created_s"] != ""]
    out: dict[str, float] = {
        "bound": float(len(lat)), "claims": float(r.claims_allocated),
        "p50": quantile(lat, .5), "p99": quantile(lat, .99), "max": lat[-1] if lat else float("nan"),
        "cond_p99": quantile(cond, .99), "completion": r.completion,
        "sli_p50": histogram_quantile(r.sli, .5), "sli_p99": histogram_quantile(r.sli, .99),
        "create_rate": (len(created) - 1) / (r.last_create - r.first_create)
        if len(created) > 1 and r.last_create > r.first_create else float("nan"),
        "ramp_lag_p99_ms": ms(r.rows.get("ramp lag"), "99%"),
        "create_ms": ms(r.rows.get("CREATE gpu pod"), "Average Response Time"),
        "failed": ms(r.rows.get("CREATE gpu pod"), "Failure Count"),
        "load1": r.load[0] if r.load else float("nan"),
    }
    for key, comp in (("sched", "kube-scheduler"), ("api", "kube-apiserver"), ("kcm", "kube-controller-manager")):
        out[key] = s.peak(comp, "rss_bytes")
        out[f"{key}_quiet"] = window_min(s, comp, "rss_bytes", r.quiet_from, r.quiet_to)
    for key, comp in (("sched_heap", "kube-scheduler"), ("heap", "kube-apiserver")):
        out[key] = s.peak(comp, "heap_bytes")
        out[f"{key}_quiet"] = window_min(s, comp, "heap_bytes", r.quiet_from, r.quiet_to)
        out[f"{key}_gc"] = r.gc_heap.get(comp, float("nan"))
    return out


def spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    """``median [min-max]`` of the finite values, divided by ``scale``; ``n/a`` if none."""
    vs = sorted(v / scale for v in values if not math.isnan(v))
    if not vs:
        return "n/a"
    med = statistics.median(vs)
    if len(vs) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{vs[0]:.{digits}f}-{vs[-1]:.{digits}f}]"


def median(values: list[float]) -> float:
    vs = [v for v in values if not math.isnan(v)]
    return statistics.median(vs) if vs else float("nan")


def _x(a: float, b: float) -> str:
    return f"x{a / b:.2f}" if b and not math.isnan(a) and not math.isnan(b) else "n/a"


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.0f} %" if b and not math.isnan(a) and not math.isnan(b) else "n/a"


RUN_COLUMNS = ("bound", "claims", "p50", "p99", "max", "cond_p99", "completion", "sli_p50", "sli_p99",
               "create_rate", "ramp_lag_p99_ms", "create_ms", "failed", "sched_quiet", "sched_heap_quiet",
               "sched_heap_gc", "api_quiet", "heap_quiet", "heap_gc", "kcm_quiet", "sched", "sched_heap", "api",
               "heap", "kcm", "load1")


def write(ctx: RunContext, report: Report, results: list[ArmResult], p: dict[str, Any], bounds: dict[str, int]) -> None:
    per_run = [(r, figures(r)) for r in results]
    write_rows(ctx.out / "samples.csv", [r.sampler for r in results])
    with (ctx.out / "pods.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["arm", "run", "pod", "created_s", "bound_s", "latency_s",
                                           "condition_latency_s", "node"])
        w.writeheader()
        for r in results:
            w.writerows(r.pods)
    with (ctx.out / "runs.csv").open("w", newline="") as fh:
        rw = csv.writer(fh)
        rw.writerow(["order", "arm", "run", *RUN_COLUMNS])
        for i, (r, f) in enumerate(per_run, 1):
            rw.writerow([i, r.arm.name, r.run, *(round(f[k], 4) for k in RUN_COLUMNS)])
    report.csvs += ["runs.csv", "pods.csv", "samples.csv",
                    *[f"{r.arm.name}-run{r.run}_stats.csv" for r in results]]
    arms = list(dict.fromkeys(r.arm.name for r in results))
    by_arm = {a: [f for r, f in per_run if r.arm.name == a] for a in arms}
    _setup(report, results, p, bounds)

    def col(arm: str, key: str) -> list[float]:
        return [f[key] for f in by_arm[arm]]

    report.text(f"Each cell: median over the arm's runs [min-max] ({p['runs']} runs per arm, interleaved; per-run "
                "rows in runs.csv). Memory is compared on the quiet-window figures: the minimum over the "
                f"{p['quiet']:.0f} s after the last pod was bound, and the Go heap right after a GC forced at its "
                "end. Peaks are beside them, but `go_memstats_heap_alloc_bytes` counts garbage not yet collected, "
                "so a peak heap says as much about when the GC last ran as about what the component keeps.")
    report.table(["arm", "runs", "pods bound (all runs)", "claims allocated per run", "latency p50 ms", "p99 ms",
                  "max ms", "completion s", "scheduler SLI p99 ms (bucket bound)", "creation rate pods/s",
                  "ramp lag p99 ms", "create mean ms"],
                 [[a, len(by_arm[a]), f"{sum(int(v) for v in col(a, 'bound'))}/{p['total'] * len(by_arm[a])}",
                   spread(col(a, "claims")), spread(col(a, "p50"), 1e-3), spread(col(a, "p99"), 1e-3),
                   spread(col(a, "max"), 1e-3), spread(col(a, "completion"), digits=1),
                   spread(col(a, "sli_p99"), 1e-3), spread(col(a, "create_rate"), digits=1),
                   spread(col(a, "ramp_lag_p99_ms")), spread(col(a, "create_ms"))] for a in arms],
                 title="Latency and the ramp")
    report.table(["arm", "scheduler RSS MiB (quiet)", "scheduler heap MiB (quiet)", "scheduler heap MiB (after GC)",
                  "apiserver RSS MiB (quiet)", "apiserver heap MiB (quiet)", "apiserver heap MiB (after GC)",
                  "controller-manager RSS MiB (quiet)", "peak scheduler RSS", "peak scheduler heap",
                  "peak apiserver RSS", "peak apiserver heap"],
                 [[a, *(spread(col(a, k), MIB) for k in ("sched_quiet", "sched_heap_quiet", "sched_heap_gc",
                                                         "api_quiet", "heap_quiet", "heap_gc", "kcm_quiet", "sched",
                                                         "sched_heap", "api", "heap"))] for a in arms],
                 title="Memory (MiB)")
    med = {a: {k: median(col(a, k)) for k in RUN_COLUMNS} for a in arms}
    pairs = [(a, "device-plugin") for a in arms if a != "device-plugin" and "device-plugin" in med]
    if "dra-webhook" in med and "dra-kep5004" in med:
        pairs.append(("dra-kep5004", "dra-webhook"))
    if pairs:
        report.table(["ratio of medians", "scheduler RSS (quiet)", "scheduler heap (after GC)", "apiserver RSS (quiet)",
                      "apiserver heap (after GC)", "peak scheduler RSS", "latency p50", "latency p99", "completion"],
                     [[f"{a} / {b}", *(_x(med[a][k], med[b][k]) for k in ("sched_quiet", "sched_heap_gc", "api_quiet",
                                                                         "heap_gc", "sched", "p50", "p99",
                                                                         "completion"))] for a, b in pairs],
                     title="Ratios of the arms' medians")
    lines = range_verdicts(by_arm, pairs)
    if lines:
        report.text("### Verdicts over the runs\n\nEvery run of one arm against every run of the other (no margin "
                    "to choose: ranges apart or not distinguished). The ratios above are of medians and say "
                    "nothing where a verdict here is not distinguished.\n\n" + "\n".join(lines))
    _verdicts(report, med)
    report.text(TOPOLOGY_ARM)
    _plots(report, results)
    report.write()


def _setup(report: Report, results: list[ArmResult], p: dict[str, Any], bounds: dict[str, int]) -> None:
    report.setup["load"] = (
        f"{p['total']} pods (nvidia.com/gpu: 1) per run, created open-loop at {p['rate']:g} pods/s (pod i sent at "
        f"i/{p['rate']:g} s, whatever earlier creates took; up to {p['users']} creates in flight), the same ramp in "
        f"every arm; {p['nodes']} KWOK nodes x {bounds['gpus_per_node']} GPUs; one kube-apiserver (every write and "
        "watch lands there); a fresh sandbox per run")
    report.setup["client QPS bounds"] = (
        f"kube-controller-manager and kube-scheduler --kube-api-qps={bounds['qps']} "
        f"--kube-api-burst={bounds['burst']} (defaults 20/30 and 50/100; the v1.37.2 kube-scheduler still takes "
        "both flags, deprecated, as it runs without --config)")
    report.setup["run order"] = " ".join(f"{r.arm.name}#{r.run}" for r in results)
    report.setup["quiet window"] = (
        f"{p['quiet']:.0f} s after the last pod was bound, then a forced GC (GET /debug/pprof/heap?gc=1) on the "
        "scheduler and the apiserver (the apiserver with --profiling=true for this; the sandbox's default is false)")
    report.setup["arms"] = "; ".join(f"{a.name}: {a.what}" for a in dict.fromkeys(r.arm for r in results))
    report.setup["load average (1 min) at the end of each run"] = ", ".join(
        f"{r.arm.name}#{r.run} {r.load[0]:.1f}" for r in results if r.load)


def _verdicts(report: Report, med: dict[str, dict[str, float]]) -> None:
    base = med.get("device-plugin")
    for name in ("dra-webhook", "dra-kep5004"):
        f = med.get(name)
        if not f or not base:
            continue
        report.seed_vs_ours += [
            (f"scheduler memory, DRA ({name}) vs baseline", "-30 % (vs topology-aware scheduler; not built here)",
             f"{_pct(f['sched_quiet'], base['sched_quiet'])} quiet RSS vs device plugin, medians "
             f"({f['sched_quiet'] / MIB:.0f} vs {base['sched_quiet'] / MIB:.0f} MiB); heap after GC "
             f"{_pct(f['sched_heap_gc'], base['sched_heap_gc'])}"),
            (f"apiserver memory, DRA ({name}) vs baseline", "-20 %",
             f"{_pct(f['api_quiet'], base['api_quiet'])} quiet RSS ({f['api_quiet'] / MIB:.0f} vs "
             f"{base['api_quiet'] / MIB:.0f} MiB); heap after GC {_pct(f['heap_gc'], base['heap_gc'])}"),
            (f"scheduling latency, DRA ({name}) vs baseline", "DRA less affected than topology-aware",
             f"median p50 {f['p50'] * 1000:.0f} vs {base['p50'] * 1000:.0f} ms, p99 {f['p99'] * 1000:.0f} vs "
             f"{base['p99'] * 1000:.0f} ms, completion {f['completion']:.0f} vs {base['completion']:.0f} s"),
        ]
    web, kep = med.get("dra-webhook"), med.get("dra-kep5004")
    if web and kep:
        report.text(
            "The webhook's `gpu.kep5004` default (`rewrite`: do not step aside for a KEP-5004 DeviceClass): the "
            f"scheduler's quiet RSS median is {kep['sched_quiet'] / MIB:.0f} MiB on the KEP-5004 path and "
            f"{web['sched_quiet'] / MIB:.0f} MiB on the template path ({_x(kep['sched_quiet'], web['sched_quiet'])}; "
            f"heap after GC {_x(kep['sched_heap_gc'], web['sched_heap_gc'])}), so this run "
            + kep5004_verdict(kep["sched_quiet"], web["sched_quiet"]))


RANGE_FIGURES = (("sched_quiet", "scheduler RSS (quiet)", MIB, "MiB"),
                 ("api_quiet", "apiserver RSS (quiet)", MIB, "MiB"),
                 ("p50", "scheduling latency p50", 1e-3, "ms"))
"""(run column, what, divisor, unit) of the figures judged over the runs."""


def range_verdicts(by_arm: dict[str, list[dict[str, float]]], pairs: list[tuple[str, str]]) -> list[str]:
    """For each compared pair and figure, whether every run of the first arm is below or above every run of the
    second: the verdict a ratio of medians (x1.23 with overlapping runs) cannot give."""
    lines = []
    for a, b in pairs:
        for key, what, scale, unit in RANGE_FIGURES:
            va = [f[key] for f in by_arm[a] if not math.isnan(f[key])]
            vb = [f[key] for f in by_arm[b] if not math.isnan(f[key])]
            lines.append(f"- {what}, {a} against {b}: **{compare(va, vb)}** ({spread(va, scale)} vs "
                         f"{spread(vb, scale)} {unit})")
    return lines


def kep5004_verdict(kep: float, web: float, margin: float = 0.10) -> str:
    """What the scheduler's quiet RSS medians say of the ``rewrite`` default: a difference within ``margin``
    is not read as one way or the other (runs of one arm differ by about that much)."""
    if math.isnan(kep) or math.isnan(web) or not web:
        return "cannot say (a median is missing)."
    if kep > web * (1 + margin):
        return "supports `rewrite` as the default (the KEP-5004 path costs the scheduler more memory)."
    if kep < web * (1 - margin):
        return "contradicts `rewrite` as the default on memory grounds (the KEP-5004 path costs the scheduler less)."
    return (f"shows no difference beyond {margin:.0%} in the scheduler's memory, so memory does not decide the "
            "default at this scale.")


def _by_run(results: list[ArmResult], points: Callable[[ArmResult], list[tuple[float, float]]]
            ) -> dict[str, list[tuple[float, float]]]:
    return {f"{r.arm.name} #{r.run}": points(r) for r in results}


def _plots(report: Report, results: list[ArmResult]) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        pts = sorted((p["created_s"] - r.first_create, p["latency_s"]) for p in r.pods if p["latency_s"] != "")
        if pts:
            ax.scatter([t for t, _ in pts], [v * 1000 for _, v in pts], s=4, alpha=0.4,
                       label=f"{r.arm.name} #{r.run}")
    ax.set_yscale("log")
    ax.set(title="Scheduling latency over the ramp (creation -> bound)", xlabel="seconds since the first create",
           ylabel="ms (log)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, markerscale=3, ncol=3)
    fig.tight_layout()
    fig.savefig(report.plot("latency_over_ramp.png", "Each pod's scheduling latency by its creation time, every run"),
                dpi=110)
    plt.close(fig)

    def bound(r: ArmResult) -> list[tuple[float, float]]:
        times = sorted(p["bound_s"] - r.first_create for p in r.pods if p["bound_s"] != "")
        return [(t, float(i)) for i, t in enumerate(times, 1)]

    line_plot(report.plot("pods_bound.png", "Pods bound over time, every run (the same ramp in each)"),
              "Pods bound", "pods", _by_run(results, bound), xlabel="seconds since the first create")
    for comp, label in (("kube-scheduler", "scheduler"), ("kube-apiserver", "apiserver")):
        for column, what in (("rss_bytes", "RSS"), ("heap_bytes", "Go heap")):
            def series(r: ArmResult, comp: str = comp, column: str = column) -> list[tuple[float, float]]:
                return [(t - r.first_create, v) for t, v in r.sampler.summed(comp, column)]

            name = f"{label}_{'rss' if column == 'rss_bytes' else 'heap'}.png"
            line_plot(report.plot(name, f"kube-{label} {what} per run over time (the quiet window follows the "
                                        "last bind)"),
                      f"kube-{label} {what}", "MiB", _by_run(results, series), scale=MIB,
                      xlabel="seconds since the first create")
