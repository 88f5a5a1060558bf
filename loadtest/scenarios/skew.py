"""``skew``: "Large skew ... the LB balances connections, not requests", fixed with goaway-chance.

Long-lived clients issue steady small requests: Python HTTP/2 clients (httpx,
one connection each) and client-go (``kubectl proxy`` processes: client-go's
transport, one HTTP/2 connection upstream, Locust users behind each on
loopback). Mid-run one apiserver restarts; its clients reconnect to the other
two, and when it is back an L4 balancer sends it nothing until connections are
re-made. Each apiserver's own ``apiserver_request_total`` gives its share.
Arms: HAProxy TCP (the seeds' setup), HAProxy TCP with the apiservers'
``--goaway-chance=0.001`` (the seeds' fix), gatekeeper (per-request balancing),
gatekeeper with its own goaway chance towards clients.

Healing through GOAWAY takes a few connection lifetimes, and a lifetime is
1 / (chance x requests per second on that connection): the report states the
achieved per-connection rate, hence the expected lifetime, beside the measured
time. ``haproxy-goaway-0.02`` (the apiserver's maximum chance) shows the same
mechanism on a time scale a short run can see.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import kubectl_binary
from loadtest.harness import cluster
from loadtest.harness.cluster import ScenarioError, kit
from loadtest.harness.report import Report, line_plot
from loadtest.harness.run import RunContext, ms, run_locust
from loadtest.harness.sampler import Sampler, write_rows

NAME = "skew"
NS = "loadtest-skew"
RESTARTED = "kube-apiserver-2"
BALANCED = 1.2
ARMS: dict[str, dict[str, Any]] = {
    "haproxy": {"flags": ("--goaway-chance=0",)},
    "haproxy-goaway": {"flags": ("--goaway-chance=0.001",)},
    # kube-apiserver's maximum: the same fix with 20x the recycling rate, so healing fits in a short run
    "haproxy-goaway-0.02": {"flags": ("--goaway-chance=0.02",)},
    "gatekeeper": {"flags": ("--goaway-chance=0",), "proxy": {}},
    "gatekeeper-goaway": {"flags": ("--goaway-chance=0",), "proxy": {"goawayChance": 0.001}},
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
        with cluster.haproxy(state, work / arm, balance="roundrobin") as url:
            yield url
        return
    with cluster.proxy(state, work / arm, None, conf["proxy"] or None) as p:
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


def run(ctx: RunContext) -> None:
    duration = max(20.0, 240 * ctx.scale)
    restart_at = duration / 6
    python_clients, gogo_clients, rate = ctx.n(16, 2), ctx.n(4, 1), 12.0
    window = max(4.0, duration / 24)
    report = Report(ctx.out, "skew: an L4 balancer balances connections, not requests", CLAIM)
    samplers: list[Sampler] = []
    results = []
    with cluster.sandbox(ctx.work / "sandbox", ctx.adopt, ctx.log) as state:
        report.use_sandbox(state)
        identities = cluster.tenants(state, NS, python_clients, ctx.work)
        for arm, conf in ARMS.items():
            cluster.restart_apiservers(state, flags=conf["flags"])
            with front(arm, state, ctx.work) as url, \
                    kubectl_proxies(state, ctx.work, url, gogo_clients) as gogo:
                sampler = Sampler(state, arm, count={"verb": "LIST", "resource": "configmaps"}, interval=1.0)
                spec = {"user_classes": ["loadtest.harness.users:SteadyUser"],
                        "users": python_clients + gogo_clients, "spawn_rate": 20, "run_time": duration,
                        "rate": rate, "http2": True, "targets": gogo + [url] * python_clients,
                        "identities": identities, "namespace": NS, "request_timeout": 30,
                        "ca": str(SandboxPKI(Path(state.certs_dir)).ca)}
                restarted: list[float] = []

                def restart(s: Sampler = sampler, flags: tuple[str, ...] = conf["flags"],
                            restarted: list[float] = restarted) -> None:
                    s.mark(f"restart {RESTARTED}")
                    cluster.restart_apiservers(state, which=[RESTARTED], flags=flags)
                    restarted.append(s.mark(f"{RESTARTED} ready"))

                timer = threading.Timer(restart_at, restart)
                with sampler:
                    timer.start()
                    rows = run_locust(ctx, arm, spec, timeout=duration)
                    timer.join()
            samplers.append(sampler)
            sh = shares(sampler, window)
            since = restarted[0] if restarted else restart_at
            healed = time_to_balance(sh, since)
            final = {n: pts[-1][1] for n, pts in sh.items() if pts}
            agg = rows.get("Aggregated")
            chance = float(next((f.split("=")[1] for f in conf["flags"] if f.startswith("--goaway-chance=")), 0))
            chance = max(chance, float((conf.get("proxy") or {}).get("goawayChance", 0)))
            per_conn = ms(agg, "Requests/s") / (python_clients + gogo_clients)
            results.append({"arm": arm, "healed": healed, "final": final, "rps": ms(agg, "Requests/s"),
                            "lifetime": 1 / (chance * per_conn) if chance and per_conn > 0 else None,
                            "p99": ms(agg, "99%"), "failures": int(ms(agg, "Failure Count")),
                            "requests": int(ms(agg, "Request Count")), "since": since, "shares": sh})
            ctx.say(f"  {arm}: balanced after {healed}s, final shares {final}")
    _write(ctx, report, samplers, results, duration, python_clients, gogo_clients, rate, window)


def _write(ctx: RunContext, report: Report, samplers: list[Sampler], results: list[dict[str, Any]],
           duration: float, python_clients: int, gogo_clients: int, rate: float, window: float) -> None:
    write_rows(ctx.out / "samples.csv", samplers)
    report.csvs += ["samples.csv", *[f"{r['arm']}_stats.csv" for r in results]]
    with (ctx.out / "shares.csv").open("w") as fh:
        fh.write("arm,t,apiserver,share\n")
        for r in results:
            for n, pts in r["shares"].items():
                fh.writelines(f"{r['arm']},{t:.1f},{n},{v:.4f}\n" for t, v in pts)
    report.csvs.append("shares.csv")
    report.setup["load"] = (f"{python_clients} Python HTTP/2 clients (httpx, one connection each) + {gogo_clients} "
                            f"client-go clients (kubectl proxy), each {rate:.0f} LIST configmaps?limit=1 per second, "
                            f"{duration:.0f} s per arm; {RESTARTED} restarted at {duration / 6:.0f} s; shares over "
                            f"{window:.0f} s windows from each apiserver's apiserver_request_total")

    def fmt(h: float | None) -> str:
        return f"{h:.0f} s" if h is not None else f"not within the run (> {duration - r['since']:.0f} s)"

    rows = []
    for r in results:
        final = r["final"]
        low = min(final.values()) if final else 0.0
        ratio = f"{max(final.values()) / low:.2f}" if low > 0 else "inf (one apiserver idle)"
        rows.append([r["arm"], fmt(r["healed"]), " / ".join(f"{v:.2f}" for _, v in sorted(final.items())),
                     ratio, r["rps"], r["p99"], r["requests"], r["failures"],
                     f"{r['lifetime']:.0f} s" if r["lifetime"] else "-"])
    report.table(["arm", f"time until max/min share <= {BALANCED} after the restart",
                  "final shares (1/2/3)", "final max/min", "req/s", "p99 ms", "requests", "failed",
                  "expected connection lifetime (1 / (goaway chance x req/s per connection))"], rows)
    by = {r["arm"]: r for r in results}
    for arm, seed in (("haproxy", "large skew (seed)"), ("haproxy-goaway", "heals within ~15 min (seed)"),
                      ("haproxy-goaway-0.02", "(not in the seed)"), ("gatekeeper", "n/a (the project's fix)")):
        if arm in by:
            r = by[arm]
            report.seed_vs_ours.append((f"time to balance after an apiserver restart, {arm}", seed, fmt(r["healed"])))
    for s, r in zip(samplers, results, strict=True):
        line_plot(report.plot(f"share_{s.arm}.png", f"Per-apiserver share of requests over time, {s.arm}"),
                  f"Share of requests per apiserver ({s.arm})", "share", r["shares"], events=s.events)
    report.write()
