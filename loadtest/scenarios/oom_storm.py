"""``list-storm-oom``: the seeds' incident as it happened: secret LISTs OOM-kill an apiserver, its clients fail
over to the others, and those are killed in turn. Then the same storm through gatekeeper.

The same storage-read conditions as ``list-storm`` (``--watch-cache-sizes=secrets#0``: every LIST of Secrets
reads etcd and decodes all of them), tenant identities, freshly restarted apiservers per arm. What is new: each
apiserver runs in a memory cgroup (``sandbox up --apiserver-memory-limit``) and the sandbox's supervisor
restarts one the kernel OOM-killed, with kubelet's back-off, as a static pod would be. Kills are read from
the supervisor's events (the cgroups' own counters), not guessed from RSS.

Arms: ``haproxy`` (TCP, the seeds' load balancer: a killed apiserver's clients reconnect to the others),
``haproxy-kube-apf`` (the same, with the seeds' own fix in the apiservers: their FlowSchema and
PriorityLevelConfiguration, 2 concurrent secret LISTs, in kube-apiserver's APF), ``direct`` (each lister pinned
to one apiserver), ``gatekeeper`` (the seeds' policy: 2 concurrent secret
LISTs), ``gatekeeper-per-apiserver`` (the same, and at most one storage LIST per apiserver:
``expensiveLists.maxInFlightPerBackend: 1`` with ``storageOnlyResources: [secrets]``), ``gatekeeper-coalescing``
(the seeds' policy, listers sharing two identities so identical LISTs coalesce). Listers re-list after an error
as client-go's reflector does, with its back-off, for as long as the arm lasts.

The ``informers-*`` arms (``--arms``) send the storm as today's clients do: one real client-go v0.37 Secrets
informer per tenant, syncing with a watch-list (``-watch-list``) or a LIST (``-list``,
``KUBE_FEATURE_WatchListClient=false``) through ``haproxy``, ``haproxy-kube-apf``, ``direct`` or
``gatekeeper``; client-go retries a failed sync with its own back-off until the arm's time is up. ``--runs N``
runs the arms interleaved N times.

Every arm runs at each of three memory limits (``--memory-limits``; :data:`MEMORY_LIMITS`), limits and arms
interleaved in every round, so the report shows where each arm's protection ends. Each kill is classified as
own-load or failover (:mod:`loadtest.scenarios.oom_kills`), and the verdicts come from thresholds fixed there.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from pathlib import Path
from typing import Any

from gatekeeper.sandbox.pki import SandboxPKI
from loadtest.harness import cluster
from loadtest.harness.cluster import ScenarioError, kit
from loadtest.harness.report import MIB, Report
from loadtest.harness.rounds import interleave, run_label
from loadtest.harness.run import RunContext, ms, run_locust
from loadtest.harness.sampler import Sampler
from loadtest.scenarios.list_storm import NS, STORAGE_READS, base_arm, informer_run, target
from loadtest.scenarios.oom_kills import (
    classify_kills,
    downtime,
    failover_possible,
    kills_between,
    read_events,
)
from loadtest.scenarios.oom_report import write

NAME = "list-storm-oom"
ARMS = ("haproxy", "haproxy-kube-apf", "direct", "gatekeeper", "gatekeeper-per-apiserver", "gatekeeper-coalescing")
"""Locust listers; what runs without ``--arms``."""
INFORMER_ARMS = tuple(f"informers-{t}-{kind}" for kind in ("watch-list", "list")
                      for t in ("haproxy", "haproxy-kube-apf", "direct", "gatekeeper"))
ALL_ARMS = ARMS + INFORMER_ARMS
SECRETS = 1000
SECRET_KIB = 200
MEMORY_LIMIT = 2560 << 20
"""Per apiserver, the checked-in report's. One 1,000 x 200 KiB LIST (260 MiB of JSON) grows an apiserver by about
0.7 GiB from its 0.3-0.7 GiB idle: one at a time fits, two on one apiserver barely, four do not."""
MEMORY_LIMITS = (2048 << 20, MEMORY_LIMIT, 4096 << 20)
"""The default sweep: 2 GiB holds one LIST, 2.5 GiB two barely, 4 GiB four (0.7 + 2.8). Not lower: kube-apiserver
reads every Secret from etcd as it starts, and at 1.5 GiB it was OOM-killed while starting. A single limit chosen so
that one LIST fits and four do not would build the verdict in."""
TINY_LIMIT = 4 << 30
"""Below ``--scale 0.5`` a run checks the machinery: one limit nothing reaches."""
ETCD_QUOTA = ("--quota-backend-bytes=8589934592",)
"""etcd's default 2 GiB quota would be the first thing the seed's object scale fills."""
ARM_SECONDS = 300
"""An arm's bound: a LIST not done by then counts as failed (a cascade can keep every apiserver down)."""
CLAIM = """Secret list calls go up and control plane goes down. Scenario: high number of list calls with
larger secrets. Problem: OOM apiserver. Fix: API Priority & Fairness (only allow two concurrent list calls,
queue the rest). Result: decreased number of OOM crashes. (seed 000, KubeCon EU 2025)
The incident: one apiserver is OOM-killed, the load balancer sends its clients to the other two, and those
are OOM-killed in turn (the cascade). Seed scale: 5,000 Secrets of 0.2 MB, about 1 GB per LIST."""


def plan(arms: list[str], limits: tuple[int, ...], runs: int) -> list[tuple[int, int, str, str]]:
    """``(round, limit, arm, label)`` in the order to run: every (limit, arm) once per round. A label carries the
    limit only when there are several, so a one-limit run keeps the checked-in reports' names."""
    return [(r, limit, arm, run_label(arm if len(limits) == 1 else f"{arm}-{limit >> 20}Mi", r, runs))
            for r, (limit, arm) in interleave([(limit, arm) for limit in limits for arm in arms], runs)]


def run(ctx: RunContext) -> None:
    secrets, listers = ctx.n(SECRETS, 4), ctx.n(12, 2)
    limits = ctx.memory_limits or (MEMORY_LIMITS if ctx.scale >= 0.5 else (TINY_LIMIT,))
    arm_seconds = max(60, round(ARM_SECONDS * min(1.0, ctx.scale)))
    arms = list(ctx.arms or ARMS)
    unknown = [a for a in arms if a not in ALL_ARMS]
    if unknown:
        raise ScenarioError(f"unknown arms {', '.join(unknown)}; known: {', '.join(ALL_ARMS)}")
    report = Report(ctx.out, "list-storm-oom: the OOM kills and the cascade, then the fix", CLAIM)
    samplers: list[Sampler] = []
    results: list[dict[str, Any]] = []
    arm_events: list[tuple[str, dict[str, Any]]] = []
    with cluster.sandbox(ctx.work / "sandbox", ctx.adopt, ctx.log, apiserver_args=STORAGE_READS,
                         apiserver_memory_limit=limits[0], etcd_args=ETCD_QUOTA) as state:
        if "memory_cgroup_version" not in state.extra:
            raise ScenarioError("the sandbox has no memory-limited apiservers: bring one up with "
                                "--apiserver-memory-limit, or leave out --state-dir")
        report.use_sandbox(state)
        ctx.say(f"{NAME}: {secrets} Secrets x {SECRET_KIB} KiB, {listers} listers, apiservers limited to "
                f"{', '.join(f'{x / MIB:.0f}' for x in limits)} MiB each, {len(arms)} arms x {ctx.runs} runs")
        asyncio.run(kit.create_secrets(state, NS, secrets, SECRET_KIB * 1024, concurrency=12))
        identities = cluster.tenants(state, NS, listers, ctx.work)
        names = [r.name for r in cluster.apiserver_records(state)]
        ca = str(SandboxPKI(Path(state.certs_dir)).ca)
        for round_, limit, base, arm in plan(arms, limits, ctx.runs):
            state, ready_s = cluster.restart_limited_apiservers(state, flags=STORAGE_READS, memory_limit=limit)
            ctx.say(f"  {arm}: apiservers restarted at {limit / MIB:.0f} MiB ({ready_s:.1f}s)")
            time.sleep(2)
            load0, cpu0 = os.getloadavg()[0], resource.getrusage(resource.RUSAGE_CHILDREN)
            wall0 = time.time()
            with target(base, state, ctx.work / arm) as (urls, notes):
                sampler = Sampler(state, arm, count={"verb": "LIST", "resource": "secrets"}, interval=0.25,
                                  metrics_interval=1.0, follow_restarts=True,
                                  extra_pids={"gatekeeper-proxy": notes["pid"]} if "pid" in notes else {})
                spec = {"user_classes": ["loadtest.harness.users:ListerUser"], "users": listers,
                        "spawn_rate": listers, "run_time": arm_seconds, "until_done": True, "rounds": 1,
                        "relist": "reflector",
                        "targets": urls, "identities": identities[:2] if base.endswith("coalescing") else identities,
                        "namespace": NS, "ca": ca}
                sampler_from = time.time() - wall0  # the sampler's clock starts here, the kills' at wall0
                with sampler:
                    time.sleep(1.0)
                    if base.startswith("informers-"):
                        figures = informer_run(base, urls, ca, identities, ctx.work / arm / "informers",
                                               timeout=arm_seconds)[0]
                    else:
                        figures = _locust_figures(run_locust(ctx, arm, spec, timeout=arm_seconds + 60))
                    time.sleep(1.0)
            wall1 = time.time()
            cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            events = read_events(state.dir)
            arm_events.extend((arm, e) for e in events if wall0 <= e["time"] <= wall1)
            kills = kills_between(events, wall0, wall1)
            # in flight: the tenants' executing requests per apiserver (the observer FlowSchema, deleted in the
            # kube-apf arms, where the timing alone tells a failover kill)
            inflight = None if "kube-apf" in base else {
                n: [(t + sampler_from, v) for t, v in pts]
                for n, pts in sampler.series("kube-apiserver", "executing").items()}
            classified = classify_kills(kills, failover=failover_possible(base_arm(base)), inflight=inflight)
            for k in classified:
                sampler.events.append((k.t - sampler_from, f"OOM kill {k.apiserver} ({k.kind})"))
            per_down, all_down = downtime(events, names, wall0, wall1)
            samplers.append(sampler)
            failover = sum(1 for k in classified if k.kind == "failover")
            results.append({
                "arm": base, "label": arm, "round": round_, "limit": limit, "kills": kills, "classified": classified,
                "failover": failover, "own": len(kills) - failover,
                "per_apiserver": {n: sum(1 for _, k in kills if k == n) for n in names},
                "cascade": failover > 0, "down": per_down, "all_down": all_down,
                "peak": {n: max((v for _, v in pts), default=0.0)
                         for n, pts in sampler.series("kube-apiserver", "rss_bytes").items()},
                **figures,
                "generator_cpu": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
                "wall": wall1 - wall0, "load": (load0, os.getloadavg()[0]), "start": wall0,
            })
            ctx.say(f"  {arm}: {len(kills)} OOM kills ({failover} failover), {results[-1]['ok']}/{listers} LISTs ok")
    write(ctx, report, samplers, results, arm_events, names,
          {"secrets": secrets, "secret_kib": SECRET_KIB, "listers": listers, "limits": limits,
           "arm_seconds": arm_seconds, "storage_reads": STORAGE_READS, "etcd": ETCD_QUOTA})


def _locust_figures(rows: dict[str, dict[str, str]]) -> dict[str, Any]:
    lst, throttled = rows.get("LIST secrets"), rows.get("throttled (429)")
    relisted = rows.get("re-listed after an error")
    return {  # no row at all: not one LIST ended (completed or given up) within the arm
        "ok": int(ms(lst, "Request Count") - ms(lst, "Failure Count")) if lst else 0,
        "failed": int(ms(lst, "Failure Count")) if lst else 0,
        "p50": ms(lst, "50%") / 1000, "p99": ms(lst, "99%") / 1000,
        "429": int(ms(throttled, "Request Count")) if throttled else 0,
        "relisted": int(ms(relisted, "Request Count")) if relisted else 0}
