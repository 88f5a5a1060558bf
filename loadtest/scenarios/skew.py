"""``skew``: "Large skew ... the LB balances connections, not requests", fixed with goaway-chance.

Long-lived clients issue steady small requests: Python HTTP/2 clients (httpx,
one connection each) and client-go (``kubectl proxy`` processes: client-go's
transport, one HTTP/2 connection upstream, Locust users behind each on
loopback). Mid-run one apiserver restarts; its clients reconnect to the other
two, and when it is back an L4 balancer sends it nothing until connections are
re-made. Each apiserver's own ``apiserver_request_total`` gives its share.
Arms: HAProxy TCP (the seeds' setup), HAProxy TCP with the apiservers'
``--goaway-chance=0.001`` (the seeds' fix), HAProxy TCP with the seeds' APF objects in the apiservers
(``haproxy-kube-apf``, their other fix), gatekeeper (per-request balancing
alone, flow control off), gatekeeper with the flow control it is deployed with
(the seeds' policy and at most 2 expensive LISTs per apiserver).

The seeds' symptom is memory skew, so two thirds into each arm every client
sends one full LIST of the namespace's big Secrets (``--watch-cache-sizes=secrets#0``:
each LIST reads etcd, the storage reads of the seeds' incident) on its own
connection: behind an L4 balancer the storm lands where the connections are
pinned (a 429 is retried after its Retry-After, as client-go does). Each
apiserver's RSS and Go heap, the front's connections to each apiserver (from
/proc) and each apiserver's requests are sampled every second.

Healing through GOAWAY takes a few connection lifetimes, and a lifetime is
1 / (chance x requests per second on that connection): the report states the
achieved per-connection rate, hence the expected lifetime, beside the measured
time. ``haproxy-goaway-0.02`` (the apiserver's maximum chance) shows the same
mechanism on a time scale a short run can see.

``--arms`` picks arms and ``--runs N`` runs them interleaved N times; the verdicts (:mod:`.skew_report`) judge
every run of an arm against thresholds fixed before the runs, and ranges that overlap are not distinguished.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import resource
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import kubectl_binary
from loadtest.harness import cluster
from loadtest.harness.cluster import ScenarioError, kit
from loadtest.harness.report import Report
from loadtest.harness.rounds import interleave, run_label
from loadtest.harness.run import RunContext, ms, run_locust
from loadtest.harness.sampler import Sampler

NAME = "skew"
NS = "loadtest-skew"
RESTARTED = "kube-apiserver-2"
BALANCED = 1.2
STORAGE_READS = ("--watch-cache-sizes=secrets#0",)
"""Every arm's apiservers run with these besides the arm's own flags: each Secret LIST reads etcd."""
SECRET_KIB = 200
ARMS: dict[str, dict[str, Any]] = {
    "haproxy": {"flags": ("--goaway-chance=0",)},
    "haproxy-goaway": {"flags": ("--goaway-chance=0.001",)},
    # the seeds' other fix, in the apiservers themselves: their APF objects (2 concurrent secret LISTs per
    # apiserver; their FlowSchema also takes the clients' small configmap LISTs)
    "haproxy-kube-apf": {"flags": ("--goaway-chance=0",), "kube_apf": True},
    # kube-apiserver's maximum: the same fix with 20x the recycling rate, so healing fits in a short run
    "haproxy-goaway-0.02": {"flags": ("--goaway-chance=0.02",)},
    "gatekeeper": {"flags": ("--goaway-chance=0",), "proxy": {}},
    # deploy/proxy/config.yaml's flow control: the seeds' policy (2 secret LISTs at a time, the rest queued or
    # answered 429 + Retry-After) and at most 2 expensive LISTs per apiserver
    "gatekeeper-policy": {"flags": ("--goaway-chance=0",), "proxy": {},
                          "flow": {"files": [str(kit.SEEDS)], "expensiveLists": {"maxInFlightPerBackend": 2}}},
}
CLAIM = """Large skew in memory utilization across apiserver pods. Root cause: the LB in front of the apiservers
has long-living TCP connections and balances based on connections, not requests. Fix: the --goaway-chance
parameter of the apiserver: random GOAWAYs tear connections down gracefully and clients re-create them.
(seed 000, KubeCon EU 2025; the incident healed within about 15 minutes)"""


@contextlib.contextmanager
def kubectl_proxies(state: SandboxState, work: Path, server: str, count: int) -> Iterator[list[str]]:
    """``count`` ``kubectl proxy`` processes (client-go) to ``server``, as tenants; yields their http URLs."""
    procs: list[subprocess.Popen[str]] = []
    urls = []
    try:
        for i in range(count):
            kc = kit.storm_kubeconfig(state, work, f"client-go-{i}", server)
            p = subprocess.Popen([kubectl_binary(state), "--kubeconfig", str(kc), "proxy", "--port=0",
                                  "--address=127.0.0.1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, start_new_session=True)
            procs.append(p)
            line = p.stdout.readline() if p.stdout else ""
            m = re.search(r"127\.0\.0\.1:(\d+)", line)
            if not m:
                raise ScenarioError(f"kubectl proxy did not start: {line.strip()}")
            urls.append(f"http://127.0.0.1:{m.group(1)}")
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


@contextlib.contextmanager
def front(arm: str, state: SandboxState, work: Path) -> Iterator[str]:
    conf = ARMS[arm]
    if "proxy" not in conf:
        with contextlib.ExitStack() as stack:
            if conf.get("kube_apf"):
                stack.enter_context(cluster.seeds_apf(state, NS))
            yield stack.enter_context(cluster.haproxy(state, work / arm, balance="roundrobin"))
        return
    with cluster.proxy(state, work / arm, conf.get("flow"), conf["proxy"] or None) as p:
        yield p.url


def shares(sampler: Sampler, window: float) -> dict[str, list[tuple[float, float]]]:
    """Each apiserver's share of the requests in trailing ``window``-second windows (counter resets handled)."""
    per = sampler.series("kube-apiserver", "requests")
    names = sorted(per)
    ticks = sorted({t for pts in per.values() for t, _ in pts})
    if not names or not ticks:
        return {}
    deltas: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for n in names:
        prev = None
        for t, v in per[n]:
            d = 0.0 if prev is None else (v - prev if v >= prev else v)
            deltas[n].append((t, d))
            prev = v
    out: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    t, end = ticks[0] + window, ticks[-1]
    while t <= end:
        sums = {n: sum(d for tt, d in deltas[n] if t - window < tt <= t) for n in names}
        total = sum(sums.values())
        if total > 0:
            for n in names:
                out[n].append((t, sums[n] / total))
        t += window / 2
    return out


def time_to_balance(sh: dict[str, list[tuple[float, float]]], since: float, hold: int = 3) -> float | None:
    """Seconds after ``since`` until max/min share <= 1.2 held for ``hold`` consecutive windows."""
    names = list(sh)
    if not names:
        return None
    points = len(sh[names[0]])
    run = 0
    for i in range(points):
        t = sh[names[0]][i][0]
        if t < since:
            continue
        vals = [sh[n][i][1] for n in names]
        run = run + 1 if min(vals) > 0 and max(vals) / min(vals) <= BALANCED else 0
        if run == hold:
            return sh[names[0]][i - hold + 1][0] - since
    return None


def per_apiserver(sampler: Sampler, column: str, since: float, until: float = math.inf) -> dict[str, list[float]]:
    """Each apiserver's samples of ``column`` within [since, until]."""
    return {n: [v for t, v in pts if since <= t <= until]
            for n, pts in sorted(sampler.series("kube-apiserver", column).items())}


def spread(values: dict[str, float]) -> float:
    """max / min across apiservers (inf when one has nothing)."""
    vals = list(values.values())
    if not vals:
        return float("nan")
    return max(vals) / min(vals) if min(vals) > 0 else math.inf


def memory_figures(sampler: Sampler, storm: float) -> dict[str, Any]:
    """The memory skew the storm leaves: per apiserver the RSS just before it, the peak during and after it,
    the RSS at the end, the Go heap peak, and the front's connections just before it."""
    before = {n: (vs[-1] if vs else 0.0) for n, vs in per_apiserver(sampler, "rss_bytes", storm - 5, storm).items()}
    after = per_apiserver(sampler, "rss_bytes", storm)
    peak = {n: max(vs, default=0.0) for n, vs in after.items()}
    end = {n: (vs[-1] if vs else 0.0) for n, vs in after.items()}
    heap = {n: max(vs, default=0.0) for n, vs in per_apiserver(sampler, "heap_bytes", storm).items()}
    conns = {n: (vs[-1] if vs else 0.0) for n, vs in per_apiserver(sampler, "connections", 0, storm).items()}
    growth = {n: max(0.0, peak[n] - before.get(n, 0.0)) for n in peak}
    return {"before": before, "peak": peak, "end": end, "heap": heap, "conns": conns, "growth": growth}


def run(ctx: RunContext) -> None:
    duration = max(30.0, 240 * ctx.scale)
    restart_at, storm_at = duration / 6, duration * 2 / 3
    python_clients, gogo_clients, rate = ctx.n(16, 2), ctx.n(4, 1), 12.0
    secrets = ctx.n(200, 4)
    window = max(4.0, duration / 24)
    arms = list(ctx.arms or ARMS)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ScenarioError(f"unknown arms {', '.join(unknown)}; known: {', '.join(ARMS)}")
    report = Report(ctx.out, "skew: an L4 balancer balances connections, not requests", CLAIM)
    samplers: list[Sampler] = []
    results: list[dict[str, Any]] = []
    with cluster.sandbox(ctx.work / "sandbox", ctx.adopt, ctx.log, apiserver_args=STORAGE_READS) as state:
        report.use_sandbox(state)
        identities = cluster.tenants(state, NS, python_clients, ctx.work)
        asyncio.run(kit.create_secrets(state, NS, secrets, SECRET_KIB * 1024))
        for round_, arm in interleave(arms, ctx.runs):
            label = run_label(arm, round_, ctx.runs)
            conf = ARMS[arm]
            flags = (*conf["flags"], *STORAGE_READS)
            cluster.restart_apiservers(state, flags=flags)
            load0, cpu0 = os.getloadavg()[0], resource.getrusage(resource.RUSAGE_CHILDREN)
            with front(arm, state, ctx.work / label) as url, \
                    kubectl_proxies(state, ctx.work, url, gogo_clients) as gogo:
                sampler = Sampler(state, label, count={"verb": "LIST", "resource": "configmaps"}, interval=1.0,
                                  front_port=urlsplit(url).port or 443)
                spec = {"user_classes": ["loadtest.harness.users:SteadyUser"],
                        "users": python_clients + gogo_clients, "spawn_rate": 20, "run_time": duration,
                        "rate": rate, "http2": True, "targets": gogo + [url] * python_clients,
                        "identities": identities, "namespace": NS, "request_timeout": 120,
                        "ca": str(SandboxPKI(Path(state.certs_dir)).ca), "storm_lists": 1}
                restarted: list[float] = []
                storm: list[float] = []

                def restart(s: Sampler = sampler, flags: tuple[str, ...] = flags,
                            restarted: list[float] = restarted) -> None:
                    s.mark(f"restart {RESTARTED}")
                    cluster.restart_apiservers(state, which=[RESTARTED], flags=flags)
                    restarted.append(s.mark(f"{RESTARTED} ready"))

                timers = [threading.Timer(restart_at, restart),
                          threading.Timer(storm_at, lambda s=sampler, st=storm: st.append(s.mark("LIST storm")))]
                with sampler:
                    spec["storm_epoch"] = time.time() + storm_at
                    for timer in timers:
                        timer.start()
                    rows = run_locust(ctx, label, spec, timeout=duration)
                    for timer in timers:
                        timer.join()
            cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            samplers.append(sampler)
            sh = shares(sampler, window)
            since = restarted[0] if restarted else restart_at
            healed = time_to_balance(sh, since)
            final = {n: pts[-1][1] for n, pts in sh.items() if pts}
            agg = rows.get("Aggregated")
            chance = float(next((f.split("=")[1] for f in conf["flags"] if f.startswith("--goaway-chance=")), 0))
            chance = max(chance, float((conf.get("proxy") or {}).get("goawayChance", 0)))
            per_conn = ms(agg, "Requests/s") / (python_clients + gogo_clients)
            lists = rows.get("LIST secrets (storm)")
            results.append({"arm": arm, "label": label, "round": round_, "load": (load0, os.getloadavg()[0]),
                            "generator_cpu": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
                            "healed": healed, "final": final, "rps": ms(agg, "Requests/s"),
                            "lifetime": 1 / (chance * per_conn) if chance and per_conn > 0 else None,
                            "p99": ms(rows.get("LIST configmaps"), "99%"),
                            "failures": int(ms(agg, "Failure Count")),
                            "requests": int(ms(agg, "Request Count")), "since": since, "shares": sh,
                            "storm_at": storm[0] if storm else storm_at,
                            "mem": (mem := memory_figures(sampler, storm[0] if storm else storm_at)),
                            "skew": spread(mem["peak"]),
                            "lists_ok": int(ms(lists, "Request Count") - ms(lists, "Failure Count")) if lists else 0,
                            "list_p99": ms(lists, "99%") / 1000,
                            "throttled": int(ms(rows.get("throttled (429)"), "Request Count") or 0)
                            if rows.get("throttled (429)") else 0})
            m = results[-1]["mem"]
            ctx.say(f"  {label}: balanced after {healed}s, final shares {final}, peak RSS max/min "
                    f"{spread(m['peak']):.2f}, connections {m['conns']}")
    from loadtest.scenarios.skew_report import write  # it imports this module's figures

    write(ctx, report, samplers, results, duration, python_clients, gogo_clients, rate, window, secrets)
