"""``dra-scale``: N one-GPU pods onto KWOK GPU nodes, served three ways; scheduling latency and memory.

The seed ("KWOK 0 -> 4000 workloads"): DRA against the topology-aware
scheduler stack, scheduler memory -30 %, apiserver memory -20 %. Here the same
N pods (``nvidia.com/gpu: 1``) go to freshly started sandboxes (one apiserver,
scheduler, controller manager, KWOK nodes of 8 GPUs each), one per run:

* ``device-plugin``: the nodes advertise ``nvidia.com/gpu`` capacity, no
  webhook, no ResourceSlices (a device-plugin cluster publishes none);
* ``dra-webhook``: gatekeeper's webhook (mode ``dra``) rewrites every pod to a
  ResourceClaim from a template; the controller manager creates the claims,
  the scheduler allocates devices from the ResourceSlices;
* ``dra-kep5004``: unchanged pods, the DeviceClass maps ``nvidia.com/gpu``
  (KEP-5004 ``extendedResourceName``) and the nodes do not advertise it, so
  the scheduler allocates through DRA and writes a claim per pod itself.

What makes the arms comparable (issue 30 item 5), and why:

* client QPS lifted: kube-controller-manager and kube-scheduler run with
  ``--kube-api-qps``/``--kube-api-burst`` far above what the ramp needs
  (:data:`QPS_ARGS`), because at their defaults (20/30 and 50/100) the DRA arms
  measured the clients' rate limiters (two controller writes per pod) instead
  of DRA;
* one open-loop ramp for every arm: pod ``i`` is sent at ``i / rate`` s
  (``users.RampGpuPodUser``), so a slower arm does not get a gentler load;
* arms interleaved (A B C A B C ...), :data:`RUNS` runs each, a fresh sandbox
  per run: the machine's other load drifts over a run of an hour, and
  interleaving spreads that drift over every arm instead of over the last one;
* memory compared as the minimum over a quiet window after the last pod is
  bound, and as the Go heap after a forced GC: ``go_memstats_heap_alloc_bytes``
  counts garbage not yet collected, so its peak says when the GC last ran as
  much as what is live (the KEP-5004 scheduler heap fell from 799 to 529 MiB
  within 15 s in the first report). Peaks are still reported.

The seed's own baseline, the topology-aware scheduler (scheduler-plugins'
NodeResourceTopologyMatch), could not be built here: see
:data:`dra_report.TOPOLOGY_ARM` for the command and the error.
A fresh sandbox per run, not one cleaned in between: every arm needs a
different node and DeviceClass shape, and a Go heap grown by one run stays
mapped and would hide the next run's peak (design.md §4).
"""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any

from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from loadtest.harness import cluster
from loadtest.harness.cluster import ScenarioError, kit
from loadtest.harness.podwatch import PodWatch
from loadtest.harness.report import MIB, Report
from loadtest.harness.run import RunContext, ms, run_locust
from loadtest.harness.sampler import Sampler
from loadtest.scenarios import dra_report
from loadtest.scenarios.dra_report import ARMS, Arm, ArmResult

NAME = "dra-scale"
NS = "loadtest-dra"
GPUS_PER_NODE = 8
HEADROOM = 1.1
"""Nodes for 10 % more GPUs than pods, so the last pods still find free devices on several nodes."""
COMPONENTS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kwok", "webhook")
RUNS = 3
"""Runs per arm at full scale (issue 30: >= 3, interleaved); a tiny --scale runs 2 to stay a quick test."""
RATE = 20.0
"""Pods created per second at --scale 1 (scaled, never below :data:`MIN_RATE`): 1,000 pods in 50 s. Under the
~45/s the first report's 20 users reached on the device-plugin arm, so the schedule, not the apiserver, sets
the pace of creation; about 40 controller writes/s on the template path."""
MIN_RATE = 5.0
QPS, BURST = 500, 1000
"""Client bounds of kube-controller-manager and kube-scheduler: over 10x what the ramp needs, so neither
client's rate limiter is what a run measures."""
QPS_ARGS = (f"--kube-api-qps={QPS}", f"--kube-api-burst={BURST}")
APISERVER_ARGS = ("--profiling=true",)
"""The sandbox's apiservers run ``--profiling=false``; here pprof's ``?gc=1`` forces the GC before the heap is
read (:func:`forced_gc_heap`). Its handlers hold no memory until asked."""
QUIET_S = 30.0
"""The quiet window after the last pod is bound, at --scale >= 1 (scaled, never below 6 s)."""


def plan(scale: float) -> dict[str, Any]:
    """The run's sizes from --scale: pods, nodes, ramp rate, users in flight, quiet window, runs per arm."""
    total = max(10, round(1000 * scale))
    rate = max(MIN_RATE, RATE * scale)
    return {"total": total, "nodes": math.ceil(total * HEADROOM / GPUS_PER_NODE), "rate": rate,
            "users": max(4, min(100, math.ceil(rate * 3))), "quiet": max(6.0, QUIET_S * min(1.0, scale)),
            "runs": RUNS if scale >= 0.05 else 2, "timeout": max(120.0, total / rate * 10)}


def order(arms: tuple[Arm, ...], runs: int) -> list[tuple[Arm, int]]:
    """A B C A B C ...: each arm's k-th run next to the others' k-th run."""
    return [(arm, k) for k in range(1, runs + 1) for arm in arms]


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


def forced_gc_heap(state: SandboxState, url: str) -> float:
    """``go_memstats_heap_alloc_bytes`` right after a GC forced through ``/debug/pprof/heap?gc=1`` (pprof runs
    ``runtime.GC()`` before it writes a heap profile): the live heap, without the garbage a peak counts.
    NaN if the component does not serve pprof (``--profiling=false``) or /metrics."""
    try:
        with cluster.admin(state, url, timeout=60) as c:
            if c.get("/debug/pprof/heap", params={"gc": "1"}).status_code != 200:
                return float("nan")
            return float(kit.metric_sum(c.get("/metrics").text, "go_memstats_heap_alloc_bytes"))
    except Exception:  # a figure for the report, not a condition of the run
        return float("nan")


def _condition_latency(pod: dict[str, Any]) -> float | str:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "True":
            return _stamp(cond["lastTransitionTime"]) - _stamp(pod["metadata"]["creationTimestamp"])
    return ""


def run_arm(ctx: RunContext, arm: Arm, run: int, state: SandboxState, p: dict[str, Any]) -> ArmResult:
    """One run of one arm in its fresh sandbox: the ramp, binding, the quiet window, a forced GC."""
    for name in ("kube-scheduler", "kube-controller-manager"):  # the bounds the report states are the ones used
        if ctx.adopt is None and not set(QPS_ARGS) <= set(state.process(name).cmd):
            raise ScenarioError(f"{name} runs without {' '.join(QPS_ARGS)}: {state.process(name).cmd}")
    if arm.drop_slices:
        _drop_slices(state)
    identities = cluster.tenants(state, NS, 2, ctx.work)
    _wait_default_sa(state)
    ca = SandboxPKI(Path(state.certs_dir)).ca
    label = f"{arm.name}#{run}"
    scheduler_url = state.process("kube-scheduler").urls["server"]
    sampler = Sampler(state, label, components=COMPONENTS, interval=0.5, heap_urls={"kube-scheduler": scheduler_url})
    result = ArmResult(arm, run, sampler)
    spec = {"user_classes": ["loadtest.harness.users:RampGpuPodUser"], "users": p["users"], "spawn_rate": p["users"],
            "run_time": p["timeout"], "until_done": True, "targets": state.apiserver_urls, "identities": identities,
            "namespace": NS, "ca": str(ca), "total": p["total"], "rate": p["rate"], "request_timeout": 60}
    with sampler, PodWatch(state, NS, sampler.t0) as watch:
        time.sleep(2)  # a baseline before the first create
        sampler.mark("first create")
        started = time.monotonic()
        result.rows = run_locust(ctx, label.replace("#", "-run"), spec, timeout=p["timeout"])
        created = int(ms(result.rows.get("CREATE gpu pod"), "Request Count")) - int(
            ms(result.rows.get("CREATE gpu pod"), "Failure Count"))
        left = max(30.0, p["timeout"] - (time.monotonic() - started))
        if not watch.wait_bound(created, left):
            ctx.say(f"  {label}: only {len(watch.bound)}/{p['total']} pods bound after {p['timeout']:.0f} s")
        result.quiet_from = sampler.mark("all bound")
        time.sleep(p["quiet"])
        result.quiet_to = sampler.mark("quiet window ends")
        result.load = os.getloadavg()
    result.gc_heap = {"kube-scheduler": forced_gc_heap(state, scheduler_url),
                      "kube-apiserver": forced_gc_heap(state, state.apiserver_urls[0])}
    pods, result.claims_allocated = _final(state)
    result.sli = _scheduler_sli(state)
    for name in sorted(set(watch.created) | set(pods)):
        c, b = watch.created.get(name), watch.bound.get(name)
        result.pods.append({
            "arm": arm.name, "run": run, "pod": name, "created_s": "" if c is None else c,
            "bound_s": "" if b is None else b, "latency_s": "" if c is None or b is None else round(b - c, 4),
            "condition_latency_s": _condition_latency(pods[name]) if name in pods else "",
            "node": pods.get(name, {}).get("spec", {}).get("nodeName", ""),
        })
    if watch.created:
        result.first_create = min(watch.created.values())
        result.last_create = max(watch.created.values())
    if watch.bound and len(watch.bound) >= p["total"]:
        result.completion = max(watch.bound.values()) - result.first_create
    if watch.errors:
        ctx.say(f"  {label}: pod watch restarted {len(watch.errors)} times: {watch.errors[:2]}")
    return result


def run(ctx: RunContext) -> None:
    p = plan(ctx.scale)
    report = Report(ctx.out, f"dra-scale: {p['total']} one-GPU pods, device plugin vs DRA (webhook, KEP-5004), "
                             f"{p['runs']} interleaved runs per arm", dra_report.CLAIM)
    results: list[ArmResult] = []
    schedule = order(ARMS, p["runs"])
    if ctx.adopt is not None:
        schedule = [(_adopted_arm(SandboxState.load(ctx.adopt)), 1)]
        ctx.say(f"  --state-dir: one run of {schedule[0][0].name}, in the adopted sandbox")
    for arm, k in schedule:
        ctx.say(f"  {arm.name} run {k}/{p['runs']}: sandbox with {p['nodes']} KWOK nodes x {GPUS_PER_NODE} GPUs, "
                f"{p['total']} pods at {p['rate']:g}/s")
        with cluster.sandbox(ctx.work / f"{arm.name}-{k}", ctx.adopt, ctx.log, apiservers=1, with_scheduler=True,
                             gpu_nodes=p["nodes"], gpus_per_node=GPUS_PER_NODE, addons=arm.addons,
                             gpu_extended_resource_mapping=arm.mapping, controller_manager_args=QPS_ARGS,
                             scheduler_args=QPS_ARGS, apiserver_args=APISERVER_ARGS) as state:
            report.use_sandbox(state)
            r = run_arm(ctx, arm, k, state, p)
            results.append(r)
            f = dra_report.figures(r)
            ctx.say(f"  {arm.name} run {k}: {f['bound']:.0f}/{p['total']} bound, p50 {f['p50'] * 1000:.0f} ms, "
                    f"completion {f['completion']:.1f} s, scheduler quiet RSS {f['sched_quiet'] / MIB:.0f} MiB "
                    f"(peak {f['sched'] / MIB:.0f})")
    dra_report.write(ctx, report, results, p, {"qps": QPS, "burst": BURST, "gpus_per_node": GPUS_PER_NODE})
