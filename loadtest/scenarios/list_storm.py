"""``list-storm``: "Secret list calls go up and control plane goes down", fixed with APF at 2 concurrent LISTs.

Storage-read conditions (design.md §4): apiservers with
``--watch-cache-sizes=secrets#0``, so every LIST of Secrets reads etcd and
decodes all of them; big Secrets; tenant listers with their own identities
(client certificates and ServiceAccount tokens, never system:masters); each
arm on freshly restarted apiservers. Arms: ``direct`` (listers spread over the
apiservers), ``haproxy`` (TCP, the seeds' LB), ``gatekeeper`` (the seeds'
policy: 2 concurrent secret LISTs), ``gatekeeper-coalescing`` (same policy,
listers sharing two identities so identical LISTs coalesce), ``gatekeeper-fleet`` (the deployed topology:
3 proxies sharing the seeds' budget through Leases behind HAProxy TCP; one is killed mid-storm).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from loadtest.harness import cluster
from loadtest.harness.cluster import kit
from loadtest.harness.report import MIB, Report, bar_plot, line_plot
from loadtest.harness.run import RunContext, ms, run_locust
from loadtest.harness.sampler import Sampler, write_rows

NAME = "list-storm"
NS = "loadtest-storm"
STORAGE_READS = ("--watch-cache-sizes=secrets#0",)
ARMS = ("direct", "haproxy", "gatekeeper", "gatekeeper-coalescing", "gatekeeper-fleet")
FLEET = 3
"""Proxies in the fleet arm, behind HAProxy TCP, sharing the seeds' budget through Leases."""
FLEET_TTL = 15
"""The fleet arm's Lease duration, the default (renewed every 5 s)."""
KILL_AFTER = 8.0
"""Seconds into the fleet arm's storm when one proxy is killed (SIGKILL: no goodbye)."""
CLAIM = """Secret list calls go up and control plane goes down. Scenario: high number of list calls with
larger secrets. Problem: OOM apiserver. Fix: API Priority & Fairness (only allow two concurrent list calls,
queue the rest). Result: decreased number of OOM crashes. (seed 000, KubeCon EU 2025)
Issue 12, measured from outside: direct grows peak apiserver RSS by about 2.1 GiB; through gatekeeper with
the seeds' policy by about 0.45 GiB, with the same completion time (150 x 200 KiB Secrets, 20 listers)."""


@contextlib.contextmanager
def target(arm: str, state: SandboxState, ctx: RunContext) -> Iterator[tuple[list[str], dict[str, Any]]]:
    """The URLs listers use in ``arm`` and a dict the arm fills with its own figures."""
    notes: dict[str, Any] = {}
    if arm == "direct":
        yield list(state.apiserver_urls), notes
    elif arm == "haproxy":
        with cluster.haproxy(state, ctx.work, balance="leastconn") as url:
            yield [url], notes
    elif arm == "gatekeeper-fleet":
        with fleet_front(state, ctx) as (url, fleet_notes):
            yield [url], notes
        notes.update(fleet_notes)
    else:
        flow: dict[str, Any] = {"files": [str(kit.SEEDS)]}
        if arm == "gatekeeper-per-apiserver":  # what lands on one apiserver: one storage LIST at a time
            flow.update(storageOnlyResources=["secrets"], expensiveLists={"maxInFlightPerBackend": 1})
        with cluster.proxy(state, ctx.work / arm, flow) as p:
            notes["pid"] = p.proc.pid
            yield [p.url], notes
            text = p.metrics()
            notes["coalesced"] = kit.metric_sum(text, "gatekeeper_flowcontrol_coalesced_requests_total")
            notes["peak upstream secret LISTs"] = kit.metric_sum(
                text, "gatekeeper_flowcontrol_peak_executing_requests", priority_level="secrets-list")


@contextlib.contextmanager
def fleet_front(state: SandboxState, ctx: RunContext) -> Iterator[tuple[str, dict[str, Any]]]:
    """3 proxies with ``flowControl.fleet`` behind HAProxy TCP; one is SIGKILLed ``KILL_AFTER`` s in, and the
    notes say how long the survivors took to count 2 and what they then held of the secret-LIST level."""
    notes: dict[str, Any] = {}
    run = uuid.uuid4().hex[:8]  # a fleet of this arm's own: Leases of an earlier run never count
    rbac = kit.kubectl(state, "apply", "-f", str(kit.REPO / "deploy" / "examples" / "proxy-identity-rbac.yaml"))
    if rbac.returncode != 0:  # without it every proxy runs on the conservative share and the arm shows nothing
        raise cluster.ScenarioError(f"proxy identity RBAC: {rbac.stderr.strip()}")
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(cluster.proxy(state, ctx.work / f"fleet-{i}", {
            "files": [str(kit.SEEDS)],
            "fleet": {"enabled": True, "name": f"storm-{run}", "identity": f"storm-proxy-{i}",
                      "leaseDurationSeconds": FLEET_TTL, "renewIntervalSeconds": FLEET_TTL / 3}}))
                   for i in range(1, FLEET + 1)]
        url = stack.enter_context(cluster.haproxy(state, ctx.work / "fleet-front", balance="leastconn",
                                                  targets=[p.url for p in proxies]))
        stop = threading.Event()

        def members(p: kit.ProxyProcess) -> float:
            return kit.metric_sum(p.metrics(), "gatekeeper_fleet_members")

        def kill_one() -> None:
            try:
                takeover()
            except Exception as exc:  # a thread's exception is lost otherwise: say it in the report
                notes["kill or takeover failed"] = repr(exc)

        def takeover() -> None:
            if stop.wait(KILL_AFTER):
                return
            victim, survivors = proxies[-1], proxies[:-1]
            notes["fleet size before the kill"] = min(members(p) for p in proxies)
            os.killpg(victim.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            # Measured to its end even if the storm is over first: the takeover is bounded by the TTL, not the storm.
            while time.monotonic() - killed < 10 * FLEET_TTL:
                with contextlib.suppress(OSError):
                    if all(members(p) == FLEET - 1 for p in survivors):
                        notes["survivors took the share after s"] = time.monotonic() - killed
                        notes["secret-LIST seats per survivor"] = min(kit.metric_sum(
                            p.metrics(), "gatekeeper_fleet_share_seats", priority_level="secrets-list")
                            for p in survivors)
                        return
                time.sleep(0.25)

        killer = threading.Thread(target=kill_one, name="fleet-kill", daemon=True)
        killer.start()
        try:
            yield url, notes
        finally:
            stop.set()
            killer.join(12 * FLEET_TTL)
            for p in proxies[:-1]:
                with contextlib.suppress(OSError):
                    notes["peak upstream secret LISTs (per survivor)"] = max(
                        notes.get("peak upstream secret LISTs (per survivor)", 0),
                        kit.metric_sum(p.metrics(), "gatekeeper_flowcontrol_peak_executing_requests",
                                       priority_level="secrets-list"))


def run(ctx: RunContext) -> None:
    secrets, size_kib = ctx.n(150, 4), 200
    listers, rounds = ctx.n(20, 2), 2
    report = Report(ctx.out, "list-storm: secret LISTs that read storage", CLAIM)
    samplers: list[Sampler] = []
    results: list[dict[str, Any]] = []
    with cluster.sandbox(ctx.work / "sandbox", ctx.adopt, ctx.log, apiserver_args=STORAGE_READS) as state:
        report.use_sandbox(state)
        ctx.say(f"{NAME}: {secrets} Secrets x {size_kib} KiB, {listers} listers x {rounds} rounds")
        asyncio.run(kit.create_secrets(state, NS, secrets, size_kib * 1024))
        identities = cluster.tenants(state, NS, listers, ctx.work)
        shared = identities[:2]
        for arm in ARMS:
            ready_s = cluster.restart_apiservers(state, flags=STORAGE_READS)
            ctx.say(f"  {arm}: apiservers restarted ({ready_s:.1f}s)")
            time.sleep(2)  # let the restarted servers settle: the baseline is their idle heap
            with target(arm, state, ctx) as (urls, notes):
                sampler = Sampler(state, arm, count={"verb": "LIST", "resource": "secrets"}, interval=0.25,
                                  metrics_interval=0.5, apf_level=kit.OBSERVE,
                                  extra_pids={"gatekeeper-proxy": notes["pid"]} if "pid" in notes else {})
                spec = {"user_classes": ["loadtest.harness.users:ListerUser"], "users": listers,
                        "spawn_rate": listers, "run_time": 900, "until_done": True, "rounds": rounds,
                        "targets": urls, "identities": shared if arm.endswith("coalescing") else identities,
                        "namespace": NS, "ca": str(SandboxPKI(Path(state.certs_dir)).ca)}
                t0 = time.monotonic()
                with sampler:
                    time.sleep(1.0)
                    rows = run_locust(ctx, arm, spec, timeout=900)
                    wall = time.monotonic() - t0
                    time.sleep(1.0)
            samplers.append(sampler)
            lst, throttled = rows.get("LIST secrets"), rows.get("throttled (429)")
            reqs = sampler.summed("kube-apiserver", "requests")
            results.append({
                "arm": arm, "baseline": sampler.first("kube-apiserver", "rss_bytes"),
                "peak": sampler.peak("kube-apiserver", "rss_bytes"),
                "heap0": sampler.first("kube-apiserver", "heap_bytes"),
                "heap": sampler.peak("kube-apiserver", "heap_bytes"),
                "p50": ms(lst, "50%") / 1000, "p99": ms(lst, "99%") / 1000,
                "ok": int(ms(lst, "Request Count") - ms(lst, "Failure Count")),
                "failed": int(ms(lst, "Failure Count")), "429": int(ms(throttled, "Request Count") or 0)
                if throttled else 0,
                "upstream": (reqs[-1][1] - reqs[0][1]) if reqs else float("nan"), "wall": wall,
                "concurrent": sampler.peak("apf-sum", "executing"),
                "relisted": int(ms(rows.get("re-listed after an error"), "Request Count") or 0)
                if rows.get("re-listed after an error") else 0,
                "notes": ", ".join(f"{k}={v:.0f}" for k, v in notes.items() if k != "pid"),
            })
            ctx.say(f"  {arm}: +{(results[-1]['peak'] - results[-1]['baseline']) / MIB:.0f} MiB peak RSS")
    _write(ctx, report, samplers, results, secrets, size_kib, listers, rounds)


def _write(ctx: RunContext, report: Report, samplers: list[Sampler], results: list[dict[str, Any]],
           secrets: int, size_kib: int, listers: int, rounds: int) -> None:
    write_rows(ctx.out / "samples.csv", samplers)
    report.csvs += ["samples.csv", *[f"{r['arm']}_stats.csv" for r in results],
                    *[f"{r['arm']}_stats_history.csv" for r in results]]
    report.setup.update({
        "load": f"{secrets} Secrets x {size_kib} KiB (type helm.sh/release.v1), {listers} tenant listers "
                f"(half client certificates, half ServiceAccount tokens) x {rounds} full LISTs each, "
                "429 retried after Retry-After as client-go does",
        "apiservers": "3 kube-apiservers on one etcd, flags + " + " ".join(STORAGE_READS)
                      + ", restarted before every arm",
        "fleet arm": f"{FLEET} gatekeeper proxies (flowControl.fleet, Lease duration {FLEET_TTL} s, renewed every "
                     f"{FLEET_TTL / 3:g} s) behind HAProxy TCP leastconn; one SIGKILLed {KILL_AFTER:g} s into the "
                     "storm, the survivors' takeover measured to its end"})
    ref = results[0]
    gib = float(1 << 30)
    rows = []
    for r in results:
        growth = r["peak"] - r["baseline"]
        rows.append([r["arm"], f"{r['baseline'] / MIB:.0f}", f"{r['peak'] / MIB:.0f}", f"{growth / MIB:.0f}",
                     f"{(r['heap'] - r['heap0']) / MIB:.0f}", r["p50"], r["p99"], r["ok"], r["failed"], r["429"],
                     f"{r['upstream']:.0f}", f"{r['concurrent']:.0f}", r["relisted"], r["wall"],
                     f"x{growth / max(1.0, ref['peak'] - ref['baseline']):.2f}",
                     f"x{r['wall'] / max(0.001, ref['wall']):.2f}", r["notes"]])
    report.table(["arm", "idle RSS MiB", "peak RSS MiB", "+RSS MiB", "+Go heap MiB", "LIST p50 s", "LIST p99 s",
                  "LISTs ok", "failed", "429s", "upstream LISTs", "peak concurrent LISTs (apiservers' APF)",
                  "re-listed", "wall s", "+RSS vs direct", "wall vs direct", "gatekeeper"], rows,
                 "Sum over the 3 apiservers; concurrent LISTs: the executing requests of the tenants' observer "
                 "priority level in the apiservers' own APF (dump_priority_levels), read from the 3 at once every "
                 "0.1 s and summed")
    by = {r["arm"]: r for r in results}
    direct, gk = by.get("direct"), by.get("gatekeeper")
    if direct and gk:
        report.seed_vs_ours += [
            ("peak apiserver RSS growth, direct", "OOM (seed); +2.1 GiB (issue 12)",
             f"+{(direct['peak'] - direct['baseline']) / gib:.2f} GiB"),
            ("peak apiserver RSS growth, APF 2 concurrent LISTs (gatekeeper, seeds' policy)",
             "fewer OOMs (seed); +0.45 GiB (issue 12)", f"+{(gk['peak'] - gk['baseline']) / gib:.2f} GiB"),
            ("completion time, gatekeeper vs direct", "same (issue 12)",
             f"x{gk['wall'] / max(0.001, direct['wall']):.2f}"),
        ]
    fleet = by.get("gatekeeper-fleet")
    if direct and fleet:
        report.seed_vs_ours += [
            (f"fleet of {FLEET} proxies behind HAProxy TCP: peak apiserver RSS growth vs direct", "<= x0.3 (issue 29)",
             f"x{(fleet['peak'] - fleet['baseline']) / max(1.0, direct['peak'] - direct['baseline']):.2f}"),
            ("fleet: cluster-wide concurrent secret LISTs (apiservers' APF gauge)",
             f"<= budget 2 + rounding = {max(2, FLEET)} (issue 29)", f"{fleet['concurrent']:.0f}"),
        ]
    series = {s.arm: [(t, v) for t, v in s.summed("kube-apiserver", "rss_bytes")] for s in samplers}
    line_plot(report.plot("rss.png", "Apiserver RSS (sum of 3) over time, per arm"),
              "Apiserver RSS, sum of 3 (seconds from arm start)", "MiB", series, scale=MIB)
    heap = {s.arm: s.summed("kube-apiserver", "heap_bytes") for s in samplers}
    line_plot(report.plot("heap.png", "Apiserver Go heap (go_memstats_heap_alloc_bytes, sum of 3) over time"),
              "Apiserver Go heap in use, sum of 3", "MiB", heap, scale=MIB)
    bar_plot(report.plot("peak_growth.png", "Peak apiserver RSS growth over the idle baseline, per arm"),
             "Peak apiserver RSS growth (MiB)", "MiB",
             {r["arm"]: (r["peak"] - r["baseline"]) / MIB for r in results})
    report.write()
