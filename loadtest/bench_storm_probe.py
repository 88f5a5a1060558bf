"""Other traffic during the seeds' Secret-LIST storm: direct vs HAProxy vs gatekeeper, arms interleaved.

Not a test: it prints figures and ratios measured in one run on one machine.

The question it answers: while 20 tenants LIST big Secrets, how long does an
ordinary GET of someone else wait, and how much of that wait does the proxy
add? ``tests/flowcontrol/test_sandbox_storm.py`` asserts that such GETs keep
completing through gatekeeper; this script puts a number beside the same GETs
sent straight to the apiservers and through HAProxy, in the same run.

Conditions (design.md §4): one private 3-apiserver sandbox with storage reads
(``--watch-cache-sizes=secrets#0``: every LIST reads etcd), N Secrets of SIZE
KiB, C tenant listers with client certificates (group ``gatekeeper:storm``,
never system:masters) each LISTing once, and P probe connections (HTTP/2,
their own certificates) each GETting one ConfigMap every 50 ms until the storm
ends. Every arm starts on freshly restarted apiservers. Arms, in this order in
every round:

* ``direct``: listers spread round-robin over the apiservers, probe i on apiserver i mod 3;
* ``haproxy``: TCP mode, leastconn (the seeds' load balancer);
* ``gatekeeper``: gatekeeper, 2 workers, the seeds' policy.

Printed per round and arm: storm wall time, LISTs ok/failed/429, probe GET
count, p50/p90/p99/max; then the medians over rounds and each arm's ratio to
``direct`` of the same round::

    python loadtest/bench_storm_probe.py [--rounds 3] [--secrets 150] [--size-kib 200] [--clients 20] [--probes 4]

Bounded: each LIST has a 300 s limit, probes stop with the storm, the sandbox is
torn down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gatekeeper.sandbox.lifecycle import down
from gatekeeper.sandbox.state import SandboxState
from loadtest.bench_list_storm import NS, Result, client_context, lister, pct
from loadtest.harness import cluster
from loadtest.harness.cluster import kit
from loadtest.scenarios.list_storm import STORAGE_READS

ARMS = ("direct", "haproxy", "gatekeeper")
PROBE_PAUSE = 0.05


@dataclass
class Arm:
    name: str
    storm: Result
    probes: list[float] = field(default_factory=list)
    probe_errors: int = 0


async def probe(url: str, ctx: ssl.SSLContext, stop: asyncio.Event, arm: Arm) -> None:
    """GET one ConfigMap over one HTTP/2 connection until ``stop``; each GET's latency."""
    async with httpx.AsyncClient(base_url=url, verify=ctx, http2=True, timeout=httpx.Timeout(60, connect=10)) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                r = await c.get(f"/api/v1/namespaces/{NS}/configmaps/probe")
                if r.status_code == 200:
                    arm.probes.append(time.monotonic() - t0)
                else:
                    arm.probe_errors += 1
            except (httpx.HTTPError, OSError):
                arm.probe_errors += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PROBE_PAUSE)


async def storm_with_probes(lister_urls: list[str], probe_urls: list[str], listers: list[ssl.SSLContext],
                            probers: list[ssl.SSLContext], expect: int, arm: Arm) -> None:
    stop = asyncio.Event()
    probing = [asyncio.create_task(probe(probe_urls[i % len(probe_urls)], ctx, stop, arm))
               for i, ctx in enumerate(probers)]
    await asyncio.sleep(0.5)  # probe connections are up before the first LIST
    t0 = time.monotonic()
    try:
        await asyncio.gather(*(lister(lister_urls[i % len(lister_urls)], ctx, 1, expect, arm.storm)
                               for i, ctx in enumerate(listers)))
    finally:
        arm.storm.wall = time.monotonic() - t0
        stop.set()
        await asyncio.gather(*probing)


@contextlib.contextmanager
def arm_urls(name: str, state: SandboxState,
             work: Path) -> Iterator[tuple[list[str], list[str], kit.ProxyProcess | None]]:
    """(lister URLs, probe URLs, the gatekeeper proxy if any) for ``name``; a proxy stops when the arm ends."""
    if name == "direct":
        yield list(state.apiserver_urls), list(state.apiserver_urls), None
    elif name == "haproxy":
        with cluster.haproxy(state, work, balance="leastconn") as url:
            yield [url], [url], None
    else:
        with kit.run_proxy(state, work / name, {"files": [str(kit.SEEDS)]}, workers=2) as proxy:
            yield [proxy.url], [proxy.url], proxy


def setup(work: Path, args: argparse.Namespace) -> SandboxState:
    with open(work / "sandbox.log", "w") as log:
        state = cluster.bring_up(work / "sandbox", log, apiservers=3, apiserver_args=STORAGE_READS)
    asyncio.run(kit.create_secrets(state, NS, args.secrets, args.size_kib * 1024))
    rbac = kit.kubectl(state, "apply", "-f", "-", input=kit.storm_rbac_and_observer())
    if rbac.returncode != 0:
        raise SystemExit(rbac.stderr)
    made = kit.kubectl(state, "create", "configmap", "probe", "-n", NS, "--from-literal=a=b")
    if made.returncode != 0:
        raise SystemExit(made.stderr)
    return state


def report(rounds: list[dict[str, Arm]]) -> None:
    print("\nper round (probe GET latency in ms):")
    print(f"{'round':>5} {'arm':10} {'storm s':>8} {'LIST ok':>7} {'err':>4} {'429':>4} {'GETs':>5} {'GET err':>7} "
          f"{'p50':>7} {'p90':>7} {'p99':>7} {'max':>7}")
    for i, arms in enumerate(rounds, 1):
        for a in arms.values():
            print(f"{i:5d} {a.name:10} {a.storm.wall:8.1f} {len(a.storm.latencies):7d} {a.storm.errors:4d} "
                  f"{a.storm.throttled:4d} {len(a.probes):5d} {a.probe_errors:7d} "
                  + " ".join(f"{pct(a.probes, q) * 1000:7.0f}" for q in (0.5, 0.9, 0.99))
                  + f" {max(a.probes, default=float('nan')) * 1000:7.0f}")
    print("\nmedian over rounds, and the median of each round's ratio to direct:")
    for name in rounds[0]:
        row = [arms[name] for arms in rounds]
        figs = {q: statistics.median(pct(a.probes, q) for a in row) for q in (0.5, 0.99)}
        wall = statistics.median(a.storm.wall for a in row)
        line = f"  {name:10} storm {wall:6.1f} s  GET p50 {figs[0.5] * 1000:6.0f} ms  p99 {figs[0.99] * 1000:6.0f} ms"
        if name != "direct":
            r50 = statistics.median(pct(arms[name].probes, 0.5) / pct(arms["direct"].probes, 0.5) for arms in rounds)
            r99 = statistics.median(pct(arms[name].probes, 0.99) / pct(arms["direct"].probes, 0.99)
                                    for arms in rounds)
            rw = statistics.median(arms[name].storm.wall / arms["direct"].storm.wall for arms in rounds)
            line += f"  (x{r50:.2f} / x{r99:.2f} of direct; storm x{rw:.2f})"
        print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--secrets", type=int, default=150)
    ap.add_argument("--size-kib", type=int, default=200)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--probes", type=int, default=4)
    ap.add_argument("--arms", type=lambda v: v.split(","), default=list(ARMS))
    args = ap.parse_args()
    if args.arms[0] != "direct":
        raise SystemExit("--arms must start with direct (the reference)")
    work = Path(tempfile.mkdtemp(prefix="gk-storm-probe-"))
    state = setup(work, args)
    listers = [client_context(state, f"lister-{i}") for i in range(args.clients)]
    probers = [client_context(state, f"probe-{i}") for i in range(args.probes)]
    expect = args.secrets * args.size_kib * 1024 * 4 // 3
    rounds: list[dict[str, Arm]] = []
    try:
        for r, name in itertools.product(range(args.rounds), args.arms):
            if name == args.arms[0]:
                rounds.append({})
            cluster.restart_apiservers(state, flags=STORAGE_READS)
            time.sleep(2)
            arm = Arm(name, Result(name))
            with arm_urls(name, state, work / f"r{r}") as (lurls, purls, proxy):
                asyncio.run(storm_with_probes(lurls, purls, listers, probers, expect, arm))
                if proxy is not None:
                    peak = kit.metric_sum(proxy.metrics(), "gatekeeper_flowcontrol_peak_executing_requests",
                                          priority_level="secrets-list")
                    arm.storm.notes = f"peak upstream secret LISTs {peak:.0f}"
            rounds[-1][name] = arm
            print(f"round {r + 1} {name}: storm {arm.storm.wall:.1f} s, {len(arm.probes)} GETs, "
                  f"p50 {pct(arm.probes, 0.5) * 1000:.0f} ms, p99 {pct(arm.probes, 0.99) * 1000:.0f} ms, "
                  f"max {max(arm.probes, default=float('nan')) * 1000:.0f} ms; {arm.storm.notes}; load average "
                  f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}", flush=True)
    finally:
        down(work / "sandbox", say=lambda s: None)
    print(f"\nconditions: 3 apiservers {' '.join(STORAGE_READS)}, {args.secrets} Secrets x {args.size_kib} KiB, "
          f"{args.clients} tenant listers (client certificates) x 1 LIST, {args.probes} HTTP/2 probe connections "
          f"GETting a ConfigMap every {PROBE_PAUSE * 1000:.0f} ms; gatekeeper: 2 workers, seeds' policy; "
          f"work dir {work}")
    report(rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
