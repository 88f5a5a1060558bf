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

The ``informers-*`` arms send the storm the way today's clients do: one real client-go v0.37 Secrets informer
per tenant, which syncs with a streaming watch-list (``informers-<target>-watch-list``) or, with
``KUBE_FEATURE_WatchListClient=false``, with the LIST the seeds' clients sent (``informers-<target>-list``);
targets ``direct``, ``haproxy``, ``gatekeeper`` and ``fleet`` (the fleet arm's 3 proxies, none killed: a sync
takes seconds), and ``haproxy-kube-apf`` (HAProxy with the seeds' APF objects applied to the apiservers
themselves, as the seeds deployed their fix). ``--arms`` picks arms and ``--runs N`` runs them interleaved
N times; every run's RSS growth is
compared with the direct arm of its own kind in its own round, and a bound holds only when every run keeps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import math
import os
import resource
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from loadtest.harness import cluster, informers
from loadtest.harness.cluster import kit
from loadtest.harness.report import MIB, Report, bar_plot, line_plot
from loadtest.harness.rounds import bound_verdict, interleave, run_label, spread
from loadtest.harness.run import RunContext, ms, run_locust
from loadtest.harness.sampler import Sampler, write_rows

NAME = "list-storm"
NS = "loadtest-storm"
STORAGE_READS = ("--watch-cache-sizes=secrets#0",)
ARMS = ("direct", "haproxy", "gatekeeper", "gatekeeper-coalescing", "gatekeeper-fleet")
"""Locust listers."""
INFORMER_TARGETS = {"direct": "direct", "haproxy": "haproxy", "haproxy-kube-apf": "haproxy-kube-apf",
                    "gatekeeper": "gatekeeper", "fleet": "gatekeeper-fleet"}
KUBE_LEVEL = "secrets-list"
"""The seeds' priority level: in the ``haproxy-kube-apf`` arms its objects are in the apiservers' own APF."""
INFORMER_ARMS = tuple(f"informers-{t}-{kind}" for kind in ("watch-list", "list") for t in INFORMER_TARGETS)
ALL_ARMS = ARMS + INFORMER_ARMS
"""What ``--arms`` may name, and what runs without it."""
BOUND = 0.3
"""Issue 40's bound on peak apiserver RSS growth through gatekeeper, against direct in the same round."""
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


def base_arm(arm: str) -> str:
    """The target an arm's clients go through: an informer arm's is one of the Locust arms'."""
    if not arm.startswith("informers-"):
        return arm
    name = arm.removeprefix("informers-")
    name = name.removesuffix("-watch-list") if name.endswith("-watch-list") else name.removesuffix("-list")
    return INFORMER_TARGETS[name]


@contextlib.contextmanager
def target(arm: str, state: SandboxState, work: Path) -> Iterator[tuple[list[str], dict[str, Any]]]:
    """The URLs listers use in ``arm`` and a dict the arm fills with its own figures."""
    notes: dict[str, Any] = {}
    base = base_arm(arm)
    if base == "direct":
        yield list(state.apiserver_urls), notes
    elif base == "haproxy":
        with cluster.haproxy(state, work, balance="leastconn") as url:
            yield [url], notes
    elif base == "haproxy-kube-apf":  # the seeds' fix as they deployed it: APF objects in every apiserver
        with cluster.seeds_apf(state, NS), cluster.haproxy(state, work, balance="leastconn") as url:
            yield [url], notes
    elif base == "gatekeeper-fleet":
        with fleet_front(state, work, kill=arm == base) as (url, fleet_notes):
            yield [url], notes
        notes.update(fleet_notes)
    else:
        flow: dict[str, Any] = {"files": [str(kit.SEEDS)]}
        if base == "gatekeeper-per-apiserver":  # what lands on one apiserver: one storage LIST at a time
            flow.update(storageOnlyResources=["secrets"], expensiveLists={"maxInFlightPerBackend": 1})
        with cluster.proxy(state, work / "proxy", flow) as p:
            notes["pid"] = p.proc.pid
            yield [p.url], notes
            text = p.metrics()
            notes["coalesced"] = kit.metric_sum(text, "gatekeeper_flowcontrol_coalesced_requests_total")
            notes["peak upstream secret LISTs"] = kit.metric_sum(
                text, "gatekeeper_flowcontrol_peak_executing_requests", priority_level="secrets-list")


@contextlib.contextmanager
def fleet_front(state: SandboxState, work: Path, *, kill: bool = True) -> Iterator[tuple[str, dict[str, Any]]]:
    """3 proxies with ``flowControl.fleet`` behind HAProxy TCP; with ``kill`` one is SIGKILLed ``KILL_AFTER`` s in,
    and the notes say how long the survivors took to count 2 and what they then held of the secret-LIST level."""
    notes: dict[str, Any] = {}
    run = uuid.uuid4().hex[:8]  # a fleet of this arm's own: Leases of an earlier run never count
    rbac = kit.kubectl(state, "apply", "-f", str(kit.REPO / "deploy" / "examples" / "proxy-identity-rbac.yaml"))
    if rbac.returncode != 0:  # without it every proxy runs on the conservative share and the arm shows nothing
        raise cluster.ScenarioError(f"proxy identity RBAC: {rbac.stderr.strip()}")
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(cluster.proxy(state, work / f"fleet-{i}", {
            "files": [str(kit.SEEDS)],
            "fleet": {"enabled": True, "name": f"storm-{run}", "identity": f"storm-proxy-{i}",
                      "leaseDurationSeconds": FLEET_TTL, "renewIntervalSeconds": FLEET_TTL / 3}}))
                   for i in range(1, FLEET + 1)]
        url = stack.enter_context(cluster.haproxy(state, work / "fleet-front", balance="leastconn",
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
            if not kill or stop.wait(KILL_AFTER):
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
            key = "peak upstream secret LISTs (per survivor)" if kill else "peak upstream secret LISTs (per proxy)"
            for p in proxies[:-1] if kill else proxies:
                with contextlib.suppress(OSError):
                    notes[key] = max(
                        notes.get(key, 0),
                        kit.metric_sum(p.metrics(), "gatekeeper_flowcontrol_peak_executing_requests",
                                       priority_level="secrets-list"))


def reference(arm: str) -> str:
    """The arm a run is compared with in its own round: direct, with clients of the same kind."""
    if arm.startswith("informers-"):
        return "informers-direct-watch-list" if arm.endswith("-watch-list") else "informers-direct-list"
    return "direct"


def run(ctx: RunContext) -> None:
    secrets, size_kib = ctx.n(150, 4), 200
    listers, rounds = ctx.n(20, 2), 2
    arms = list(ctx.arms or ALL_ARMS)
    unknown = [a for a in arms if a not in ALL_ARMS]
    if unknown:
        raise cluster.ScenarioError(f"unknown arms {', '.join(unknown)}; known: {', '.join(ALL_ARMS)}")
    report = Report(ctx.out, "list-storm: secret LISTs that read storage", CLAIM)
    samplers: list[Sampler] = []
    results: list[dict[str, Any]] = []
    synced: list[tuple[str, informers.InformerResult]] = []
    with cluster.sandbox(ctx.work / "sandbox", ctx.adopt, ctx.log, apiserver_args=STORAGE_READS) as state:
        report.use_sandbox(state)
        ctx.say(f"{NAME}: {secrets} Secrets x {size_kib} KiB, {listers} listers x {rounds} rounds, "
                f"{len(arms)} arms x {ctx.runs} runs")
        asyncio.run(kit.create_secrets(state, NS, secrets, size_kib * 1024))
        identities = cluster.tenants(state, NS, listers, ctx.work)
        shared = identities[:2]
        ca = str(SandboxPKI(Path(state.certs_dir)).ca)
        for round_, arm in interleave(arms, ctx.runs):
            label = run_label(arm, round_, ctx.runs)
            ready_s = cluster.restart_apiservers(state, flags=STORAGE_READS)
            ctx.say(f"  {label}: apiservers restarted ({ready_s:.1f}s)")
            time.sleep(2)  # let the restarted servers settle: the baseline is their idle heap
            load0 = os.getloadavg()[0]
            verb = "WATCH" if arm.endswith("-watch-list") else "LIST"
            with target(arm, state, ctx.work / label) as (urls, notes):
                sampler = Sampler(state, label, count={"verb": verb, "resource": "secrets"}, interval=0.25,
                                  metrics_interval=0.5,
                                  apf_level=KUBE_LEVEL if "kube-apf" in arm else kit.OBSERVE,
                                  extra_pids={"gatekeeper-proxy": notes["pid"]} if "pid" in notes else {})
                with sampler:
                    time.sleep(1.0)
                    sampler.wait_metrics()  # the request counters' baseline read before the load, not during it
                    t0 = time.monotonic()
                    if arm.startswith("informers-"):
                        figures, got = informer_run(arm, urls, ca, identities, ctx.work / label / "informers")
                        synced += [(label, r) for r in got]
                    else:
                        spec = {"user_classes": ["loadtest.harness.users:ListerUser"], "users": listers,
                                "spawn_rate": listers, "run_time": 900, "until_done": True, "rounds": rounds,
                                "targets": urls, "identities": shared if arm.endswith("coalescing") else identities,
                                "namespace": NS, "ca": ca}
                        figures = _locust_figures(run_locust(ctx, label, spec, timeout=900))
                    wall = time.monotonic() - t0
                    time.sleep(1.0)
                    sampler.wait_metrics()
            samplers.append(sampler)
            reqs = sampler.summed("kube-apiserver", "requests")
            results.append({
                "arm": arm, "round": round_, "label": label, "load": (load0, os.getloadavg()[0]),
                "baseline": sampler.first("kube-apiserver", "rss_bytes"),
                "peak": sampler.peak("kube-apiserver", "rss_bytes"),
                "heap0": sampler.first("kube-apiserver", "heap_bytes"),
                "heap": sampler.peak("kube-apiserver", "heap_bytes"),
                "upstream": (reqs[-1][1] - reqs[0][1]) if reqs else float("nan"), "wall": wall,
                "concurrent": sampler.peak("apf-held", "executing"), "seen": sampler.peak("apf-sum", "executing"),
                "notes": ", ".join(f"{k}={v:.0f}" for k, v in notes.items() if k != "pid"), **figures,
            })
            ctx.say(f"  {label}: +{(results[-1]['peak'] - results[-1]['baseline']) / MIB:.0f} MiB peak RSS")
    _ratios(results)
    _write(ctx, report, samplers, results, synced, secrets, size_kib, listers, rounds)


def informer_run(arm: str, urls: list[str], ca: str, identities: list[dict[str, str]], work: Path, *,
                 timeout: float = 600) -> tuple[dict[str, Any], list[informers.InformerResult]]:
    """One informer arm's run: its figures (as the Locust arms') and every informer's line."""
    watch_list = arm.endswith("-watch-list")
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if len(urls) > 1:  # direct: the informers dealt over the apiservers, as the Locust listers are
        got = informers.run_spread(urls, ca, NS, identities, work, watch_list=watch_list, timeout=timeout)
    else:
        got = informers.run(urls[0], ca, NS, identities, work, watch_list=watch_list, timeout=timeout)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = [r.seconds for r in got if r.synced]
    lists = sum(r.count("list") for r in got)
    return {"p50": statistics.median(seconds) if seconds else math.nan, "p99": max(seconds, default=math.nan),
            "ok": len(seconds), "failed": len(got) - len(seconds),
            "429": sum(r.count(kind, "429") for r in got for kind in ("watch-list", "list")),
            # a watch-list informer that LISTs fell back to the old path; a LIST informer LISTs once when all is well
            "relisted": lists if watch_list else max(0, lists - sum(r.count("list", "429") for r in got) - len(got)),
            "generator_cpu": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)}, got


def _locust_figures(rows: dict[str, dict[str, str]]) -> dict[str, Any]:
    lst, throttled, relisted = rows.get("LIST secrets"), rows.get("throttled (429)"), rows.get(
        "re-listed after an error")
    return {"p50": ms(lst, "50%") / 1000, "p99": ms(lst, "99%") / 1000,
            "ok": int(ms(lst, "Request Count") - ms(lst, "Failure Count")), "failed": int(ms(lst, "Failure Count")),
            "429": int(ms(throttled, "Request Count") or 0) if throttled else 0,
            "relisted": int(ms(relisted, "Request Count") or 0) if relisted else 0, "generator_cpu": math.nan}


def _ratios(results: list[dict[str, Any]]) -> None:
    """Each run's RSS growth against its reference arm's in the same round (``None`` without one)."""
    growth = {(r["round"], r["arm"]): r["peak"] - r["baseline"] for r in results}
    for r in results:
        ref = growth.get((r["round"], reference(r["arm"])))
        r["ratio"] = (r["peak"] - r["baseline"]) / max(1.0, ref) if ref is not None else None


def _write(ctx: RunContext, report: Report, samplers: list[Sampler], results: list[dict[str, Any]],
           synced: list[tuple[str, informers.InformerResult]], secrets: int, size_kib: int, listers: int,
           rounds: int) -> None:
    write_rows(ctx.out / "samples.csv", samplers)
    _write_runs(ctx.out, results, synced)
    locust_runs = [r["label"] for r in results if not r["arm"].startswith("informers-")]
    report.csvs += ["samples.csv", "runs.csv", *(["informers.csv"] if synced else []),
                    *[f"{label}_stats.csv" for label in locust_runs],
                    *[f"{label}_stats_history.csv" for label in locust_runs]]
    report.setup.update({
        "load": f"{secrets} Secrets x {size_kib} KiB (type helm.sh/release.v1), {listers} tenant identities "
                f"(half client certificates, half ServiceAccount tokens); Locust arms: {rounds} full LISTs per "
                "lister, 429 retried after Retry-After as client-go does; informer arms: one client-go v0.37 "
                "Secrets informer per identity, until all have synced",
        "apiservers": "3 kube-apiservers on one etcd, flags + " + " ".join(STORAGE_READS)
                      + ", restarted before every run",
        "runs": f"{ctx.runs} per arm, interleaved (every arm once per round, in the order of the run table)",
        "fleet arm": f"{FLEET} gatekeeper proxies (flowControl.fleet, Lease duration {FLEET_TTL} s, renewed every "
                     f"{FLEET_TTL / 3:g} s) behind HAProxy TCP leastconn; in the Locust arm one is SIGKILLed "
                     f"{KILL_AFTER:g} s into the storm and the survivors' takeover measured to its end; in the "
                     "informer arms none is killed"})
    _verdicts(report, results)
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    rows = []
    for arm, runs in by_arm.items():
        ratios = [r["ratio"] for r in runs if r["ratio"] is not None]
        rows.append([arm, len(runs), spread([(r["peak"] - r["baseline"]) / MIB for r in runs]).show(".0f"),
                     spread([(r["heap"] - r["heap0"]) / MIB for r in runs]).show(".0f"),
                     f"{sum(r['ok'] for r in runs)}/{sum(r['ok'] + r['failed'] for r in runs)}",
                     spread([r["p50"] for r in runs]).show(".1f"), spread([r["p99"] for r in runs]).show(".1f"),
                     sum(r["429"] for r in runs), sum(r["relisted"] for r in runs),
                     spread([r["upstream"] for r in runs]).show(".0f"),
                     f"{max(r['concurrent'] for r in runs):.0f} [{max(r['seen'] for r in runs):.0f}]",
                     spread([r["wall"] for r in runs]).show(".1f"),
                     spread(ratios).show(".2f", "x") if ratios else "n/a"])
    report.table(["arm", "runs", "+RSS MiB", "+Go heap MiB", "done (LISTs or syncs)", "p50 s",
                  "p99 s (informers: last sync)", "429s", "re-listed (informers: fell back to LIST)",
                  "upstream LISTs (watch-list arms: WATCHes)", "peak concurrent (apiservers' APF) [either read]",
                  "wall s",
                  "+RSS vs direct of its kind, same round"], rows,
                 "Per arm, median [min-max] over its runs; RSS and heap summed over the 3 apiservers; concurrent: "
                 "the executing requests of the tenants' observer priority level (the seeds' level in the kube-apf "
                 "arms) in the apiservers' own APF (dump_priority_levels), summed over the 3 every 0.1 s, read one "
                 "after another and again in reverse: counted when both reads see it (in brackets: when either does, "
                 "which counts a LIST that ends on one apiserver as the next starts on another twice)")
    report.table(["order", "run", "load (1 min) before -> after", "load generator CPU s", "idle RSS MiB",
                  "+RSS MiB", "wall s", "+RSS vs direct", "gatekeeper"],
                 [[i, r["label"], f"{r['load'][0]:.2f} -> {r['load'][1]:.2f}",
                   "Locust: see below" if math.isnan(r["generator_cpu"]) else f"{r['generator_cpu']:.1f}",
                   f"{r['baseline'] / MIB:.0f}", f"{(r['peak'] - r['baseline']) / MIB:.0f}", r["wall"],
                   f"x{r['ratio']:.2f}" if r["ratio"] is not None else "n/a", r["notes"]]
                  for i, r in enumerate(results, 1)], "Runs in the order run")
    _seed_rows(report, by_arm)
    first = {r["label"] for r in results if r["round"] == 1}
    series = {s.arm: list(s.summed("kube-apiserver", "rss_bytes")) for s in samplers if s.arm in first}
    line_plot(report.plot("rss.png", "Apiserver RSS (sum of 3) over time, per arm (round 1)"),
              "Apiserver RSS, sum of 3 (seconds from arm start)", "MiB", series, scale=MIB)
    heap = {s.arm: s.summed("kube-apiserver", "heap_bytes") for s in samplers if s.arm in first}
    line_plot(report.plot("heap.png", "Apiserver Go heap (go_memstats_heap_alloc_bytes, sum of 3) over time "
                                      "(round 1)"),
              "Apiserver Go heap in use, sum of 3", "MiB", heap, scale=MIB)
    bar_plot(report.plot("peak_growth.png", "Peak apiserver RSS growth over the idle baseline, per arm (median)"),
             "Peak apiserver RSS growth (MiB)", "MiB",
             {arm: statistics.median((r["peak"] - r["baseline"]) / MIB for r in runs) for arm, runs in by_arm.items()})
    report.write()


def _verdicts(report: Report, results: list[dict[str, Any]]) -> None:
    """Issue 40's bounds, judged over every run (thresholds fixed here, before any run)."""
    def ratios(arm: str) -> list[float]:
        return [r["ratio"] for r in results if r["arm"] == arm and r["ratio"] is not None]

    lines = []
    for arm, what in (("informers-gatekeeper-watch-list", "the watch-list storm (client-go's default) through one "
                                                          "proxy"),
                      ("informers-fleet-watch-list", f"the watch-list storm through a fleet of {FLEET}"),
                      ("informers-gatekeeper-list", "the informers' LIST storm through one proxy"),
                      ("informers-fleet-list", f"the informers' LIST storm through a fleet of {FLEET}"),
                      ("gatekeeper", "the Locust LIST storm through one proxy")):
        values = ratios(arm)
        if values:
            lines.append(f"- {what} peaks at <= {BOUND}x direct's RSS growth ({arm}): "
                         f"**{bound_verdict(values, BOUND)}**: {spread(values).show('.2f', 'x')}")
    for arm in ("informers-fleet-list", "gatekeeper-fleet"):
        peaks = [r["concurrent"] for r in results if r["arm"] == arm]
        if peaks:
            lines.append(f"- through a fleet of {FLEET}, the apiservers' own APF never runs more than the seeds' 2 "
                         f"tenant LISTs at once ({arm}): **{bound_verdict(peaks, 2)}**: most at once per run "
                         "(both reads) "
                         f"{spread(peaks).show('.0f')}")
    if lines:
        report.text("### Verdicts\n\nA bound holds only when every run keeps it and fails when no run does.\n\n"
                    + "\n".join(lines))


def _seed_rows(report: Report, by_arm: dict[str, list[dict[str, Any]]]) -> None:
    def growth(arm: str) -> float:
        return statistics.median(r["peak"] - r["baseline"] for r in by_arm[arm]) / float(1 << 30)

    if "direct" in by_arm and "gatekeeper" in by_arm:
        walls = [r["wall"] / d["wall"] for r in by_arm["gatekeeper"] for d in by_arm["direct"]
                 if d["round"] == r["round"]]
        report.seed_vs_ours += [
            ("peak apiserver RSS growth, direct", "OOM (seed); +2.1 GiB (issue 12)", f"+{growth('direct'):.2f} GiB"),
            ("peak apiserver RSS growth, APF 2 concurrent LISTs (gatekeeper, seeds' policy)",
             "fewer OOMs (seed); +0.45 GiB (issue 12)", f"+{growth('gatekeeper'):.2f} GiB"),
            ("completion time, gatekeeper vs direct", "same (issue 12)", spread(walls).show(".2f", "x")),
        ]
    if "gatekeeper-fleet" in by_arm and "direct" in by_arm:
        fleet = by_arm["gatekeeper-fleet"]
        report.seed_vs_ours += [
            (f"fleet of {FLEET} proxies behind HAProxy TCP: peak apiserver RSS growth vs direct", "<= x0.3 (issue 29)",
             spread([r["ratio"] for r in fleet]).show(".2f", "x")),
            ("fleet: cluster-wide concurrent secret LISTs (apiservers' APF gauge)",
             f"<= budget 2 + rounding = {max(2, FLEET)} (issue 29)", f"{max(r['concurrent'] for r in fleet):.0f}"),
        ]
    for arm in ("informers-direct-watch-list", "informers-gatekeeper-watch-list", "informers-fleet-watch-list"):
        if arm in by_arm:
            ratios = [r["ratio"] for r in by_arm[arm] if r["ratio"] is not None]
            report.seed_vs_ours.append(
                (f"peak apiserver RSS growth, {arm}", "(not in the seeds: today's client-go sends watch-lists)",
                 f"+{growth(arm):.2f} GiB" + (f", {spread(ratios).show('.2f', 'x')} of direct" if ratios else "")))


def _write_runs(out: Path, results: list[dict[str, Any]], synced: list[tuple[str, informers.InformerResult]]) -> None:
    cols = ["label", "arm", "round", "load", "baseline", "peak", "heap0", "heap", "ok", "failed", "429", "relisted",
            "upstream", "concurrent", "seen", "wall", "p50", "p99", "generator_cpu", "ratio"]
    with (out / "runs.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in results:
            w.writerow([f"{r[c][0]:.2f}/{r[c][1]:.2f}" if c == "load" else r[c] for c in cols])
    if synced:
        with (out / "informers.csv").open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["run", "informer", "synced", "seconds", "objects", "responses", "error"])
            for label, one in synced:
                w.writerow([label, one.name, one.synced, f"{one.seconds:.3f}", one.objects,
                            " ".join(f"{k.replace(' ', ':')}={n}" for k, n in sorted(one.responses.items())),
                            one.error])
