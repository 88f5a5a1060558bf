"""``list-storm-oom``: the seeds' incident as it happened: secret LISTs OOM-kill an apiserver, its clients fail
over to the others, and those are killed in turn. Then the same storm through gatekeeper.

The same storage-read conditions as ``list-storm`` (``--watch-cache-sizes=secrets#0``: every LIST of Secrets
reads etcd and decodes all of them), tenant identities, freshly restarted apiservers per arm. What is new: each
apiserver runs in a memory cgroup (``sandbox up --apiserver-memory-limit``) and the sandbox's supervisor
restarts one the kernel OOM-killed, with kubelet's back-off, as a static pod would be. Kills are read from
the supervisor's events (the cgroups' own counters), not guessed from RSS.

Arms: ``haproxy`` (TCP, the seeds' load balancer: a killed apiserver's clients reconnect to the others),
``direct`` (each lister pinned to one apiserver), ``gatekeeper`` (the seeds' policy: 2 concurrent secret
LISTs), ``gatekeeper-per-apiserver`` (the same, and at most one storage LIST per apiserver:
``expensiveLists.maxInFlightPerBackend: 1`` with ``storageOnlyResources: [secrets]``), ``gatekeeper-coalescing``
(the seeds' policy, listers sharing two identities so identical LISTs coalesce). Listers re-list after an error
as client-go's reflector does, with its back-off, for as long as the arm lasts.

The ``informers-*`` arms (``--arms``) send the storm as today's clients do: one real client-go v0.37 Secrets
informer per tenant, syncing with a watch-list (``-watch-list``) or a LIST (``-list``,
``KUBE_FEATURE_WatchListClient=false``) through ``haproxy``, ``direct`` or ``gatekeeper``; client-go retries a
failed sync with its own back-off until the arm's time is up. ``--runs N`` runs the arms interleaved N times.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.supervisor import EVENTS
from loadtest.harness import cluster
from loadtest.harness.cluster import ScenarioError, kit
from loadtest.harness.report import MIB, Report, line_plot
from loadtest.harness.rounds import interleave, run_label
from loadtest.harness.run import RunContext, ms, run_locust
from loadtest.harness.sampler import Sampler, write_rows
from loadtest.scenarios.list_storm import NS, STORAGE_READS, informer_run, target

NAME = "list-storm-oom"
ARMS = ("haproxy", "direct", "gatekeeper", "gatekeeper-per-apiserver", "gatekeeper-coalescing")
"""Locust listers; what runs without ``--arms``."""
INFORMER_ARMS = tuple(f"informers-{t}-{kind}" for kind in ("watch-list", "list")
                      for t in ("haproxy", "direct", "gatekeeper"))
ALL_ARMS = ARMS + INFORMER_ARMS
SECRETS = 1000
SECRET_KIB = 200
MEMORY_LIMIT = 2560 << 20
"""Per apiserver. One 1,000 x 200 KiB LIST (260 MiB of JSON) grows an apiserver by about 0.7 GiB from its
0.3-0.7 GiB idle: one at a time fits, two on one apiserver barely, four do not."""
ETCD_QUOTA = ("--quota-backend-bytes=8589934592",)
"""etcd's default 2 GiB quota would be the first thing the seed's object scale fills."""
ARM_SECONDS = 300
"""An arm's bound: a LIST not done by then counts as failed (a cascade can keep every apiserver down)."""
CLAIM = """Secret list calls go up and control plane goes down. Scenario: high number of list calls with
larger secrets. Problem: OOM apiserver. Fix: API Priority & Fairness (only allow two concurrent list calls,
queue the rest). Result: decreased number of OOM crashes. (seed 000, KubeCon EU 2025)
The incident: one apiserver is OOM-killed, the load balancer sends its clients to the other two, and those
are OOM-killed in turn (the cascade). Seed scale: 5,000 Secrets of 0.2 MB, about 1 GB per LIST."""


def read_events(directory: str | Path) -> list[dict[str, Any]]:
    """The supervisor's events (``apiserver-events.jsonl``); a torn last line is skipped."""
    out = []
    path = Path(directory) / EVENTS
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def kills_between(events: Sequence[dict[str, Any]], start: float, end: float) -> list[tuple[float, str]]:
    """(seconds from ``start``, apiserver) of every OOM kill in [start, end] (wall clock), in order."""
    return sorted((e["time"] - start, str(e["component"])) for e in events
                  if e.get("event") == "oom_kill" and start <= e["time"] <= end)


def cascaded(kills: Sequence[tuple[float, str]]) -> bool:
    """The seeds' cascade: after the first apiserver was killed, another one was killed too."""
    return len({name for _, name in kills}) >= 2


def downtime(events: Sequence[dict[str, Any]], names: Sequence[str], start: float, end: float
             ) -> tuple[dict[str, float], float]:
    """Seconds each apiserver was down (from an OOM kill in [start, end] to its restart) and seconds all of them
    were down at once (the control plane gone). Kills before ``start`` belong to an earlier arm: every arm
    starts on apiservers the harness has just restarted."""
    down: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    since: dict[str, float] = {}
    for e in sorted(events, key=lambda e: e["time"]):
        name, t = str(e.get("component")), float(e["time"])
        if name not in down or not start <= t <= end:
            continue
        if e.get("event") == "oom_kill":
            since.setdefault(name, t)
        elif e.get("event") == "restart" and name in since:
            down[name].append((since.pop(name), t))
    for name, begun in since.items():
        down[name].append((begun, end))
    per = {n: sum(b - a for a, b in spans) for n, spans in down.items()}
    edges = sorted({start, end, *(x for spans in down.values() for span in spans for x in span)})
    together = sum(b - a for a, b in itertools.pairwise(edges)
                   if all(any(s <= a and b <= e for s, e in down[n]) for n in names))
    return per, together


def run(ctx: RunContext) -> None:
    secrets, listers = ctx.n(SECRETS, 4), ctx.n(12, 2)
    limit = MEMORY_LIMIT if ctx.scale >= 0.5 else 4 << 30  # a tiny run checks the machinery, it cannot OOM
    arm_seconds = max(60, round(ARM_SECONDS * min(1.0, ctx.scale)))
    report = Report(ctx.out, "list-storm-oom: the OOM kills and the cascade, then the fix", CLAIM)
    samplers: list[Sampler] = []
    results: list[dict[str, Any]] = []
    arm_events: list[tuple[str, dict[str, Any]]] = []
    with cluster.sandbox(ctx.work / "sandbox", ctx.adopt, ctx.log, apiserver_args=STORAGE_READS,
                         apiserver_memory_limit=limit, etcd_args=ETCD_QUOTA) as state:
        if "memory_cgroup_version" not in state.extra:
            raise ScenarioError("the sandbox has no memory-limited apiservers: bring one up with "
                                "--apiserver-memory-limit, or leave out --state-dir")
        report.use_sandbox(state)
        ctx.say(f"{NAME}: {secrets} Secrets x {SECRET_KIB} KiB, {listers} listers, apiservers limited to "
                f"{limit / MIB:.0f} MiB each")
        asyncio.run(kit.create_secrets(state, NS, secrets, SECRET_KIB * 1024, concurrency=12))
        identities = cluster.tenants(state, NS, listers, ctx.work)
        names = [r.name for r in cluster.apiserver_records(state)]
        arms = list(ctx.arms or ARMS)
        unknown = [a for a in arms if a not in ALL_ARMS]
        if unknown:
            raise ScenarioError(f"unknown arms {', '.join(unknown)}; known: {', '.join(ALL_ARMS)}")
        ca = str(SandboxPKI(Path(state.certs_dir)).ca)
        for round_, base in interleave(arms, ctx.runs):
            arm = run_label(base, round_, ctx.runs)
            state, ready_s = cluster.restart_limited_apiservers(state, flags=STORAGE_READS)
            ctx.say(f"  {arm}: apiservers restarted ({ready_s:.1f}s)")
            time.sleep(2)
            wall0 = time.time()
            with target(base, state, ctx.work / arm) as (urls, notes):
                sampler = Sampler(state, arm, count={"verb": "LIST", "resource": "secrets"}, interval=0.25,
                                  metrics_interval=1.0, follow_restarts=True,
                                  extra_pids={"gatekeeper-proxy": notes["pid"]} if "pid" in notes else {})
                spec = {"user_classes": ["loadtest.harness.users:ListerUser"], "users": listers,
                        "spawn_rate": listers, "run_time": arm_seconds, "until_done": True, "rounds": 1,
                        "relist": "reflector",
                        "targets": urls, "identities": identities[:2] if arm.endswith("coalescing") else identities,
                        "namespace": NS, "ca": ca}
                with sampler:
                    time.sleep(1.0)
                    if base.startswith("informers-"):
                        figures = informer_run(base, urls, ca, identities, ctx.work / arm / "informers",
                                               timeout=arm_seconds)[0]
                    else:
                        figures = _locust_figures(run_locust(ctx, arm, spec, timeout=arm_seconds + 60))
                    time.sleep(1.0)
            wall1 = time.time()
            events = read_events(state.dir)
            arm_events.extend((arm, e) for e in events if wall0 <= e["time"] <= wall1)
            kills = kills_between(events, wall0, wall1)
            for t, name in kills:
                sampler.events.append((t, f"OOM kill {name}"))
            per_down, all_down = downtime(events, names, wall0, wall1)
            samplers.append(sampler)
            results.append({
                "arm": arm, "kills": kills, "per_apiserver": {n: sum(1 for _, k in kills if k == n) for n in names},
                "cascade": cascaded(kills), "down": per_down, "all_down": all_down,
                "peak": {n: max((v for _, v in pts), default=0.0)
                         for n, pts in sampler.series("kube-apiserver", "rss_bytes").items()},
                **figures,
                "wall": wall1 - wall0, "load": f"{report_load()}", "start": wall0,
            })
            ctx.say(f"  {arm}: {len(kills)} OOM kills, cascade={results[-1]['cascade']}, "
                    f"{results[-1]['ok']}/{listers} LISTs ok")
    _write(ctx, report, samplers, results, secrets, listers, limit, arm_seconds, names)
    with open(ctx.out / "events.csv", "w") as out:  # every kill and restart, with its time from the arm's start
        out.write("arm,seconds_from_arm_start,apiserver,event\n")
        starts = {r["arm"]: r["start"] for r in results}
        for arm, e in arm_events:
            out.write(f"{arm},{e['time'] - starts[arm]:.1f},{e['component']},{e['event']}\n")


def _locust_figures(rows: dict[str, dict[str, str]]) -> dict[str, Any]:
    lst, throttled = rows.get("LIST secrets"), rows.get("throttled (429)")
    relisted = rows.get("re-listed after an error")
    return {  # no row at all: not one LIST ended (completed or given up) within the arm
        "ok": int(ms(lst, "Request Count") - ms(lst, "Failure Count")) if lst else 0,
        "failed": int(ms(lst, "Failure Count")) if lst else 0,
        "p50": ms(lst, "50%") / 1000, "p99": ms(lst, "99%") / 1000,
        "429": int(ms(throttled, "Request Count")) if throttled else 0,
        "relisted": int(ms(relisted, "Request Count")) if relisted else 0}


def report_load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _write(ctx: RunContext, report: Report, samplers: list[Sampler], results: list[dict[str, Any]],
           secrets: int, listers: int, limit: int, arm_seconds: int, names: list[str]) -> None:
    write_rows(ctx.out / "samples.csv", samplers)
    with open(ctx.out / "kills.csv", "w") as out:
        out.write("arm,seconds_from_arm_start,apiserver\n")
        for r in results:
            for t, name in r["kills"]:
                out.write(f"{r['arm']},{t:.1f},{name}\n")
    report.csvs += ["samples.csv", *(["kills.csv", "events.csv"] if any(r["kills"] for r in results) else []),
                    *[f"{r['arm']}_stats.csv" for r in results if not r["arm"].startswith("informers-")]]
    report.setup.update({
        "load": f"{secrets} Secrets x {SECRET_KIB} KiB (type helm.sh/release.v1; one LIST is about "
                f"{secrets * SECRET_KIB * 4 // 3 // 1024} MiB of JSON), {listers} tenant listers (half client "
                "certificates, half ServiceAccount tokens), one full LIST each; 429 retried after Retry-After and a "
                "cut LIST re-sent with client-go's reflector back-off (0.8 s doubling to 30 s) until it completes; "
                f"an arm ends after {arm_seconds} s (a LIST not done by then is not ok)",
        "apiservers": f"3 kube-apiservers on one etcd, each in a memory cgroup of {limit / MIB:.0f} MiB (swap "
                      "excluded), restarted after an OOM kill with kubelet's back-off (10 s doubling, fresh per "
                      "arm), flags + " + " ".join(STORAGE_READS) + "; etcd " + " ".join(ETCD_QUOTA),
        "scale": f"{secrets} Secrets, a fifth of the seed's 5,000. Tried at 2,500 (650 MiB per LIST, +2 GiB in an "
                 "apiserver, 4 GiB limits): one LIST alone took 46 s here, and twelve at once did not finish within "
                 "the clients' 300 s timeout from CPU alone (etcd and three apiservers decoding on 2 cores), so the "
                 "arms would have measured this machine's CPU, not the apiservers' memory",
        "load average (1/5/15 min) after each arm": "; ".join(f"{r['arm']} {r['load']}" for r in results),
    })
    rows = []
    for r in results:
        rows.append([r["arm"], len(r["kills"]), " ".join(f"{r['per_apiserver'][n]}" for n in names),
                     "yes" if r["cascade"] else "no", f"{r['all_down']:.0f}",
                     " ".join(f"{r['down'][n]:.0f}" for n in names),
                     f"{r['ok']}/{listers}", r["p50"], r["p99"], r["429"], r["relisted"],
                     " ".join(f"{r['peak'].get(n, 0) / MIB:.0f}" for n in names), f"{r['wall']:.0f}"])
    report.table(["arm", "OOM kills", "kills per apiserver (1 2 3)", "cascade", "s all apiservers down",
                  "s down per apiserver", "LISTs (informers: syncs) ok", "LIST p50 s",
                  "LIST p99 s (informers: last sync)", "429s", "LISTs re-sent after an error (informers: LISTs "
                  "of a watch-list informer)",
                  "peak RSS MiB per apiserver", "wall s"], rows,
                 "Kills from the apiservers' memory cgroups (supervisor events); cascade: after the first kill, "
                 "another apiserver was killed too; down: from a kill to its restart")
    by = {r["arm"]: r for r in results}
    worst = by.get("haproxy") or by.get("direct")
    gk, per = by.get("gatekeeper"), by.get("gatekeeper-per-apiserver")
    if worst and gk:
        report.seed_vs_ours += [
            ("OOM kills, HAProxy TCP (the seed's load balancer)", "OOM crashes (seed)",
             f"{len(worst['kills'])}, {worst['all_down']:.0f} s with every apiserver down"),
            ("the cascade: a kill followed by kills of the others", "yes (seed)",
             f"{'yes' if worst['cascade'] else 'no'} ({len({n for _, n in worst['kills']})} of {len(names)} apiservers "
             "killed)"),
            ("OOM kills through gatekeeper (seeds' policy, 2 concurrent LISTs)", "decreased (seed)",
             f"{len(gk['kills'])}, {gk['ok']}/{listers} LISTs ok"),
            ("429s a client without retries would have seen (gatekeeper)", "-", f"{gk['429']}"),
        ]
    if worst and per:
        report.seed_vs_ours.append(
            ("OOM kills through gatekeeper, seeds' policy + at most one storage LIST per apiserver", "-",
             f"{len(per['kills'])}, {per['ok']}/{listers} LISTs ok"))
    for s in samplers:
        line_plot(report.plot(f"rss-{s.arm}.png", f"{s.arm}: apiserver RSS, OOM kills marked"),
                  f"{s.arm}: RSS per apiserver (seconds from arm start; gaps: down)", "MiB",
                  s.series("kube-apiserver", "rss_bytes"), events=s.events, scale=MIB)
    report.write()
