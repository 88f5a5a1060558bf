"""``dra-scale``: N one-GPU pods onto KWOK GPU nodes, served three ways; scheduling latency and memory.

The seed ("KWOK 0 -> 4000 workloads"): DRA against the topology-aware
scheduler stack, scheduler memory -30 %, apiserver memory -20 %. Here the same
N pods (``nvidia.com/gpu: 1``, created by Locust users with bounded
concurrency) go to three freshly started sandboxes (one apiserver, scheduler,
controller manager, KWOK nodes of 8 GPUs each), one per arm:

* ``device-plugin``: the nodes advertise ``nvidia.com/gpu`` capacity, no
  webhook, no ResourceSlices (a device-plugin cluster publishes none);
* ``dra-webhook``: gatekeeper's webhook (mode ``dra``) rewrites every pod to a
  ResourceClaim from a template; the controller manager creates the claims,
  the scheduler allocates devices from the ResourceSlices;
* ``dra-kep5004``: unchanged pods, the DeviceClass maps ``nvidia.com/gpu``
  (KEP-5004 ``extendedResourceName``) and the nodes do not advertise it, so
  the scheduler allocates through DRA and writes a claim per pod itself.

A fresh sandbox per arm, not one sandbox cleaned in between: every arm needs a
different node and DeviceClass shape, and a Go heap grown by one arm stays
mapped and would hide the next arm's peak (design.md §4).
"""

from __future__ import annotations

import csv
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from loadtest.harness import cluster
from loadtest.harness.cluster import ScenarioError, kit
from loadtest.harness.podwatch import PodWatch
from loadtest.harness.report import MIB, Report, bar_plot, line_plot
from loadtest.harness.run import RunContext, ms, run_locust
from loadtest.harness.sampler import Sampler, write_rows

NAME = "dra-scale"
NS = "loadtest-dra"
GPUS_PER_NODE = 8
HEADROOM = 1.1
"""Nodes for 10 % more GPUs than pods, so the last pods still find free devices on several nodes."""
COMPONENTS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kwok", "webhook")
CLAIM = """DRA vs topology-aware scheduling, tested with KWOK (K8s 1.32) scaling from 0 to 4000 workloads:
scheduling latency: topology-aware was way more latency-affected; scheduler memory: 30 % saved with DRA;
apiserver memory: another 20 % saved."""


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
    arm: Arm
    sampler: Sampler
    pods: list[dict[str, Any]] = field(default_factory=list)
    """One row per pod: name, created/bound offsets, watch latency, condition latency, node."""
    rows: dict[str, dict[str, str]] = field(default_factory=dict)
    first_create: float = 0.0
    completion: float = float("nan")
    """Seconds from the first pod seen to the last pod bound."""
    claims_allocated: int = 0
    sli: dict[float, float] = field(default_factory=dict)
    """The scheduler's SLI histogram at the end of the arm."""
    load: tuple[float, ...] = ()

    def latencies(self) -> list[float]:
        return sorted(p["latency_s"] for p in self.pods if p["latency_s"] != "")


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted ``values`` (NaN when empty)."""
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def _adopted_arm(state: SandboxState) -> Arm:
    if state.extra.get("gpu_extended_resource_mapping"):
        return ARMS[2]
    return ARMS[1] if "webhook" in state.extra else ARMS[0]


def _drop_slices(state: SandboxState) -> None:
    p = kit.kubectl(state, "delete", "resourceslices", "--all", "--wait=true")
    if p.returncode != 0:
        raise ScenarioError(f"delete resourceslices: {p.stderr.strip()}")


def _wait_default_sa(state: SandboxState) -> None:
    deadline = time.monotonic() + 120
    with cluster.admin(state) as c:
        while c.get(f"/api/v1/namespaces/{NS}/serviceaccounts/default").status_code != 200:
            if time.monotonic() > deadline:
                raise ScenarioError(f"no default ServiceAccount in {NS} after 120 s (is the controller manager up?)")
            time.sleep(0.5)


def _stamp(text: str) -> float:
    return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ"))


def _final(state: SandboxState) -> tuple[dict[str, dict[str, Any]], int]:
    """Every pod of the namespace by name, and the number of allocated ResourceClaims there."""
    with cluster.admin(state, timeout=120) as c:
        pods = {p["metadata"]["name"]: p for p in c.get(f"/api/v1/namespaces/{NS}/pods").json()["items"]}
        claims = c.get(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims").json()["items"]
    return pods, sum(1 for cl in claims if cl.get("status", {}).get("allocation"))


SLI = "scheduler_pod_scheduling_sli_duration_seconds"
"""The scheduler's own SLI: from a pod entering the scheduling queue to bound, all attempts, sub-ms buckets."""


def _scheduler_sli(state: SandboxState) -> dict[float, float]:
    """The scheduler's cumulative SLI histogram {upper bound s: pods}, summed over labels; {} if unreadable."""
    try:
        with cluster.admin(state, state.process("kube-scheduler").urls["server"], timeout=20) as c:
            text = c.get("/metrics").text
    except Exception:  # a figure for the report, not a condition of the run
        return {}
    out: dict[float, float] = {}
    for m in re.finditer(rf'^{SLI}_bucket{{([^}}]*)}} (\S+)$', text, re.M):
        le = re.search(r'le="([^"]+)"', m.group(1))
        if le:
            out[float(le.group(1))] = out.get(float(le.group(1)), 0.0) + float(m.group(2))
    return out


def histogram_quantile(buckets: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` (NaN without samples)."""
    total = buckets.get(math.inf, max(buckets.values(), default=0.0))
    for le in sorted(buckets):
        if total and buckets[le] >= q * total:
            return le
    return float("nan")


def _condition_latency(pod: dict[str, Any]) -> float | str:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "True":
            return _stamp(cond["lastTransitionTime"]) - _stamp(pod["metadata"]["creationTimestamp"])
    return ""


def run_arm(ctx: RunContext, arm: Arm, state: SandboxState, total: int, users: int, timeout: float) -> ArmResult:
    if arm.drop_slices:
        _drop_slices(state)
    identities = cluster.tenants(state, NS, 2, ctx.work)
    _wait_default_sa(state)
    ca = SandboxPKI(Path(state.certs_dir)).ca
    sampler = Sampler(state, arm.name, components=COMPONENTS, interval=0.5,
                      heap_urls={"kube-scheduler": state.process("kube-scheduler").urls["server"]})
    result = ArmResult(arm, sampler)
    spec = {"user_classes": ["loadtest.harness.users:GpuPodUser"], "users": users, "spawn_rate": users,
            "run_time": timeout, "until_done": True, "targets": state.apiserver_urls, "identities": identities,
            "namespace": NS, "ca": str(ca), "total": total, "request_timeout": 60}
    with sampler, PodWatch(state, NS, sampler.t0) as watch:
        time.sleep(2)  # a baseline before the first create
        sampler.mark("first create")
        started = time.monotonic()
        result.rows = run_locust(ctx, arm.name, spec, timeout=timeout)
        created = int(ms(result.rows.get("CREATE gpu pod"), "Request Count")) - int(
            ms(result.rows.get("CREATE gpu pod"), "Failure Count"))
        left = max(30.0, timeout - (time.monotonic() - started))
        if not watch.wait_bound(created, left):
            ctx.say(f"  {arm.name}: only {len(watch.bound)}/{created} pods bound after {timeout:.0f} s")
        sampler.mark("all bound")
        time.sleep(3)  # the tail of the peak (claims, status writes by KWOK)
        result.load = os.getloadavg()
    pods, result.claims_allocated = _final(state)
    result.sli = _scheduler_sli(state)
    for name in sorted(set(watch.created) | set(pods)):
        c, b = watch.created.get(name), watch.bound.get(name)
        result.pods.append({
            "arm": arm.name, "pod": name, "created_s": "" if c is None else c, "bound_s": "" if b is None else b,
            "latency_s": "" if c is None or b is None else round(b - c, 4),
            "condition_latency_s": _condition_latency(pods[name]) if name in pods else "",
            "node": pods.get(name, {}).get("spec", {}).get("nodeName", ""),
        })
    if watch.created:
        result.first_create = min(watch.created.values())
    if watch.bound and len(watch.bound) >= total:
        result.completion = max(watch.bound.values()) - result.first_create
    if watch.errors:
        ctx.say(f"  {arm.name}: pod watch restarted {len(watch.errors)} times: {watch.errors[:2]}")
    return result


def run(ctx: RunContext) -> None:
    total = ctx.n(1000, 10)
    users = max(2, min(20, total // 10))
    nodes = math.ceil(total * HEADROOM / GPUS_PER_NODE)
    timeout = max(120.0, total * 0.6)
    report = Report(ctx.out, f"dra-scale: {total} one-GPU pods, device plugin vs DRA (webhook, KEP-5004)", CLAIM)
    results: list[ArmResult] = []
    arms: tuple[Arm, ...] = ARMS
    if ctx.adopt is not None:
        arms = (_adopted_arm(SandboxState.load(ctx.adopt)),)
        ctx.say(f"  --state-dir: one arm, {arms[0].name}, in the adopted sandbox")
    for arm in arms:
        ctx.say(f"  arm {arm.name}: sandbox with {nodes} KWOK nodes x {GPUS_PER_NODE} GPUs")
        with cluster.sandbox(ctx.work / arm.name, ctx.adopt, ctx.log, apiservers=1, with_scheduler=True,
                             gpu_nodes=nodes, gpus_per_node=GPUS_PER_NODE, addons=arm.addons,
                             gpu_extended_resource_mapping=arm.mapping) as state:
            report.use_sandbox(state)
            r = run_arm(ctx, arm, state, total, users, timeout)
            results.append(r)
            lat = r.latencies()
            ctx.say(f"  {arm.name}: {len(lat)}/{total} bound, p50 {quantile(lat, .5) * 1000:.0f} ms, "
                    f"completion {r.completion:.1f} s, scheduler peak "
                    f"{r.sampler.peak('kube-scheduler', 'rss_bytes') / MIB:.0f} MiB")
    _write(ctx, report, results, total, users, nodes)


def _write(ctx: RunContext, report: Report, results: list[ArmResult], total: int, users: int, nodes: int) -> None:
    write_rows(ctx.out / "samples.csv", [r.sampler for r in results])
    with (ctx.out / "pods.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["arm", "pod", "created_s", "bound_s", "latency_s",
                                           "condition_latency_s", "node"])
        w.writeheader()
        for r in results:
            w.writerows(r.pods)
    report.csvs += ["pods.csv", "samples.csv", *[f"{r.arm.name}_stats.csv" for r in results]]
    report.setup["load"] = (
        f"{total} pods (nvidia.com/gpu: 1) per arm, created by {users} Locust users (one create in flight "
        f"each); {nodes} KWOK nodes x {GPUS_PER_NODE} GPUs; one kube-apiserver (every write and watch lands "
        "there), kube-scheduler and kube-controller-manager with their default client QPS; a fresh sandbox "
        "per arm")
    report.setup["arms"] = "; ".join(f"{r.arm.name}: {r.arm.what}" for r in results)
    report.setup["load average (1 min) at the end of each arm"] = ", ".join(
        f"{r.arm.name} {r.load[0]:.1f}" for r in results if r.load)
    table = []
    figures: dict[str, dict[str, float]] = {}
    for r in results:
        lat = r.latencies()
        cond = sorted(float(p["condition_latency_s"]) for p in r.pods if p["condition_latency_s"] != "")
        f = {
            "bound": len(lat), "p50": quantile(lat, .5), "p99": quantile(lat, .99), "max": lat[-1] if lat else 0.0,
            "cond_p99": quantile(cond, .99), "completion": r.completion,
            "sli_p50": histogram_quantile(r.sli, .5), "sli_p99": histogram_quantile(r.sli, .99),
            "sched": r.sampler.peak("kube-scheduler", "rss_bytes"),
            "sched0": r.sampler.first("kube-scheduler", "rss_bytes"),
            "api": r.sampler.peak("kube-apiserver", "rss_bytes"),
            "api0": r.sampler.first("kube-apiserver", "rss_bytes"),
            "kcm": r.sampler.peak("kube-controller-manager", "rss_bytes"),
            "sched_heap": r.sampler.peak("kube-scheduler", "heap_bytes"),
            "heap": r.sampler.peak("kube-apiserver", "heap_bytes"),
            "create_ms": ms(r.rows.get("CREATE gpu pod"), "Average Response Time"),
            "failed": ms(r.rows.get("CREATE gpu pod"), "Failure Count"),
        }
        figures[r.arm.name] = f
        table.append([r.arm.name, f"{len(lat)}/{total}", r.claims_allocated, f["p50"] * 1000, f["p99"] * 1000,
                      f["max"] * 1000, f"<= {f['sli_p50'] * 1000:g} / <= {f['sli_p99'] * 1000:g}",
                      f["cond_p99"], f["completion"], f["sched"] / MIB, f["sched_heap"] / MIB, f["api"] / MIB,
                      f["heap"] / MIB, f["kcm"] / MIB, f["create_ms"], int(f["failed"])])
    report.table(["arm", "pods bound", "claims allocated", "latency p50 ms", "p99 ms", "max ms",
                  "scheduler SLI p50 / p99 ms", "p99 by condition timestamps s", "completion s",
                  "peak scheduler RSS MiB", "peak scheduler heap MiB",
                  "peak apiserver RSS MiB", "peak apiserver heap MiB", "peak controller-manager RSS MiB",
                  "create mean ms", "create failures"], table)
    report.text(
        "Latency: creation to binding, both seen on one watch of the namespace (the apiserver's "
        "PodScheduled and creation timestamps have 1 s resolution; their p99 is the coarse cross-check "
        "column); the scheduler's own SLI histogram (queue entry to bound, "
        f"`{SLI}`) gives bucket upper bounds. Completion: first pod seen to last pod bound. "
        "Peaks: /proc RSS sampled every 0.5 s "
        "(apiserver and scheduler Go heap, `go_memstats_heap_alloc_bytes`, from their /metrics every second), "
        "fresh processes per arm.")
    report.text(
        "What this comparison can and cannot say. The seed compared DRA with its topology-aware stack (a "
        "second, topology-aware scheduler plus NodeResourceTopology objects kept current by nfd's topology "
        "updater on every node); its -30 % / -20 % are savings against that. The stretch arm that would "
        "reproduce it (sigs.k8s.io/scheduler-plugins with NRT objects for the KWOK nodes) is not built here. "
        "The baseline here is the plain device plugin, the lightest possible one: the scheduler only "
        "subtracts an integer per node, and there is one object per pod. DRA adds a ResourceClaim per pod "
        "(written by the controller manager from the webhook's template, or by the scheduler itself for "
        "KEP-5004), allocation status writes and ResourceSlices, and its allocator evaluates each device "
        "on each feasible node, so more memory and latency than the device plugin is the expected "
        "direction, and a reduction like the seed's is not expected against this baseline. The claims' "
        "creation rate of the template path is bounded by kube-controller-manager's client QPS (default "
        "20, two writes per pod: the claim and the pod's claim status); KEP-5004 has no controller in the "
        "path but puts claim creation into the scheduler's binding cycle.")
    base = figures.get("device-plugin")
    if base:
        ratio_rows = []
        for name, f in figures.items():
            if name == "device-plugin":
                continue
            ratio_rows.append([f"{name} / device-plugin", _x(f["sched"], base["sched"]), _x(f["api"], base["api"]),
                               _x(f["sched"] - f["sched0"], base["sched"] - base["sched0"]),
                               _x(f["api"] - f["api0"], base["api"] - base["api0"]),
                               _x(f["p50"], base["p50"]), _x(f["p99"], base["p99"]),
                               _x(f["completion"], base["completion"])])
        report.table(["ratio", "peak scheduler RSS", "peak apiserver RSS", "scheduler RSS growth",
                      "apiserver RSS growth", "latency p50", "latency p99", "completion"], ratio_rows,
                     title="Ratios against the device-plugin arm (same run)")
        for name in ("dra-webhook", "dra-kep5004"):
            if name in figures:
                f = figures[name]
                report.seed_vs_ours += [
                    (f"scheduler memory, DRA ({name}) vs baseline", "-30 % (vs topology-aware scheduler)",
                     f"{_pct(f['sched'], base['sched'])} peak RSS vs device plugin "
                     f"({f['sched'] / MIB:.0f} vs {base['sched'] / MIB:.0f} MiB)"),
                    (f"apiserver memory, DRA ({name}) vs baseline", "-20 %",
                     f"{_pct(f['api'], base['api'])} peak RSS ({f['api'] / MIB:.0f} vs {base['api'] / MIB:.0f} MiB)"),
                    (f"scheduling latency, DRA ({name}) vs baseline", "DRA less affected than topology-aware",
                     f"p50 {f['p50'] * 1000:.0f} vs {base['p50'] * 1000:.0f} ms, p99 {f['p99'] * 1000:.0f} vs "
                     f"{base['p99'] * 1000:.0f} ms, completion {f['completion']:.0f} vs {base['completion']:.0f} s"),
                ]
    else:  # an adopted sandbox runs one arm: its figures, no ratios
        for name, f in figures.items():
            report.seed_vs_ours.append((f"{name} (one arm, adopted sandbox)", "-30 % scheduler, -20 % apiserver",
                                        f"scheduler {f['sched'] / MIB:.0f} MiB, apiserver {f['api'] / MIB:.0f} MiB, "
                                        f"p50 {f['p50'] * 1000:.0f} ms"))
    _plots(report, results, figures)
    report.write()


def _x(a: float, b: float) -> str:
    return f"x{a / b:.2f}" if b and not math.isnan(a) and not math.isnan(b) else "n/a"


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.0f} %" if b else "n/a"


def _plots(report: Report, results: list[ArmResult], figures: dict[str, dict[str, float]]) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        pts = sorted((p["created_s"] - r.first_create, p["latency_s"]) for p in r.pods if p["latency_s"] != "")
        if pts:
            ax.scatter([t for t, _ in pts], [v * 1000 for _, v in pts], s=4, alpha=0.5, label=r.arm.name)
    ax.set_yscale("log")
    ax.set(title="Scheduling latency over the ramp (creation -> bound)", xlabel="seconds since the first create",
           ylabel="ms (log)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, markerscale=3)
    fig.tight_layout()
    fig.savefig(report.plot("latency_over_ramp.png", "Each pod's scheduling latency by its creation time"), dpi=110)
    plt.close(fig)
    bound = {}
    for r in results:
        times = sorted(p["bound_s"] - r.first_create for p in r.pods if p["bound_s"] != "")
        bound[r.arm.name] = [(t, float(i)) for i, t in enumerate(times, 1)]
    line_plot(report.plot("pods_bound.png", "Pods bound over time (the ramp 0 -> N)"), "Pods bound",
              "pods", bound, xlabel="seconds since the first create")
    for comp, label in (("kube-scheduler", "scheduler"), ("kube-apiserver", "apiserver")):
        series = {r.arm.name: [(t - r.first_create, v) for t, v in r.sampler.summed(comp, "rss_bytes")]
                  for r in results}
        line_plot(report.plot(f"{label}_rss.png", f"kube-{label} RSS per arm over time"), f"kube-{label} RSS",
                  "MiB", series, scale=MIB, xlabel="seconds since the first create")
    bar_plot(report.plot("peaks.png", "Peak RSS per arm (MiB)"), "Peak RSS (MiB)", "MiB",
             {f"{name}\n{what}": f[key] / MIB for name, f in figures.items()
              for key, what in (("sched", "scheduler"), ("api", "apiserver"))})
