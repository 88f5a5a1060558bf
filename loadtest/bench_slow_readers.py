"""Slow readers on the seeds' 2-seat secret-LIST level: the read ahead, no read ahead, and the apiservers direct.

Not a test: it prints figures measured in one run on one machine, arms interleaved.

The question (issue 28): what does a seat protect, and when should it go back? Two tenants LIST N Secrets of
SIZE KiB and take the answer at RATE bytes/s through small socket buffers; after 2 s a third tenant LISTs the
same Secrets. Arms, each on freshly restarted apiservers with storage reads
(``--watch-cache-sizes=secrets#0``, every LIST reads etcd), tenant client certificates (never system:masters):

* ``direct``: everything straight to apiserver 1 (the apiservers' own APF and --request-timeout);
* ``read-ahead``: gatekeeper, one worker, the seeds' policy, defaults (the kept design);
* ``no-read-ahead``: the same with ``readAheadBytesPerConnection: 0`` (seats held until the client took the
  response, or its deadline).

Printed per arm: the third tenant's status and wait (and its ratio to ``direct``), the slow readers' bytes and
whether they were cut, the level's seats in use while they read, peak RSS of the apiservers and of the
proxy (whose read ahead holds what the slow clients have not taken)::

    python -m loadtest bench slow-readers [--rounds 2] [--secrets 40] [--size-kib 200] [--rate 1024]

Bounded: the slow readers read for at most the deadline plus 30 s; the sandbox is torn down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gatekeeper.sandbox.lifecycle import down
from gatekeeper.sandbox.state import SandboxState
from loadtest.bench_list_storm import NS, client_context
from loadtest.harness import cluster
from loadtest.harness.cluster import kit
from loadtest.scenarios.list_storm import STORAGE_READS

ARMS: dict[str, dict[str, Any] | None] = {
    "direct": None,
    "read-ahead": {},
    "no-read-ahead": {"readAheadBytesPerConnection": 0},
}
DEADLINE = 60.0
"""kube-apiserver's --request-timeout and the proxy's requestTimeoutSeconds, both defaults."""


@dataclass
class Outcome:
    arm: str
    status: int = 0
    wait: float = 0.0
    readers: list[tuple[int, bool]] = field(default_factory=list)
    seats: float = float("nan")
    apiserver_rss: int = 0
    proxy_rss: int = 0


async def scenario(state: SandboxState, url: str, proxy: kit.ProxyProcess | None, args: argparse.Namespace,
                   out: Outcome) -> None:
    port = int(url.rsplit(":", 1)[1])
    path = f"/api/v1/namespaces/{NS}/secrets"
    sampler = kit.ApiserverSampler(state)
    sampling = asyncio.create_task(sampler.run(with_metrics=False))
    stop = asyncio.Event()

    async def proxy_rss() -> None:
        while proxy is not None and not stop.is_set():
            out.proxy_rss = max(out.proxy_rss, kit.tree_rss(proxy.proc.pid))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)

    watching = asyncio.create_task(proxy_rss())
    readers = [asyncio.create_task(kit.slow_reader(port, args.contexts[f"slow-{i}"], path, args.rate,
                                                   DEADLINE + 30)) for i in range(2)]
    await asyncio.sleep(2.0)
    if proxy is not None:
        out.seats = kit.metric_sum(proxy.metrics(), "gatekeeper_flowcontrol_current_executing_seats",
                                   priority_level="secrets-list")
    async with httpx.AsyncClient(base_url=url, verify=args.contexts["third"], http2=True,
                                 timeout=httpx.Timeout(DEADLINE + 60, connect=10)) as c:
        t0 = time.monotonic()
        r = await c.get(path, headers={"accept": "application/json"})
        out.wait, out.status = time.monotonic() - t0, r.status_code
    out.readers = list(await asyncio.gather(*readers))
    stop.set()
    sampler.stop()
    await asyncio.gather(sampling, watching)
    out.apiserver_rss = sampler.peak_rss_total


@contextlib.contextmanager
def arm_url(name: str, state: SandboxState, work: Path) -> Iterator[tuple[str, kit.ProxyProcess | None]]:
    flow = ARMS[name]
    if flow is None:
        yield state.apiserver_urls[0], None
        return
    with kit.run_proxy(state, work / name, {"files": [str(kit.SEEDS)], **flow}, workers=1) as proxy:
        yield proxy.url, proxy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--secrets", type=int, default=40)
    ap.add_argument("--size-kib", type=int, default=200)
    ap.add_argument("--rate", type=float, default=1024, help="bytes per second each slow reader takes")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gk-slow-readers-"))
    with open(work / "sandbox.log", "w") as log:
        state = cluster.bring_up(work / "sandbox", log, apiservers=3, apiserver_args=STORAGE_READS)
    results: list[Outcome] = []
    try:
        asyncio.run(kit.create_secrets(state, NS, args.secrets, args.size_kib * 1024))
        rbac = kit.kubectl(state, "apply", "-f", "-", input=kit.storm_rbac_and_observer())
        if rbac.returncode != 0:
            raise SystemExit(rbac.stderr)
        args.contexts = {u: client_context(state, u) for u in ("slow-0", "slow-1", "third")}
        for ctx in (args.contexts["slow-0"], args.contexts["slow-1"]):
            ctx.set_alpn_protocols(["http/1.1"])
        for r in range(args.rounds):
            for name in ARMS:
                cluster.restart_apiservers(state, flags=STORAGE_READS)
                time.sleep(2)
                out = Outcome(name)
                with arm_url(name, state, work / f"r{r}") as (url, proxy):
                    asyncio.run(scenario(state, url, proxy, args, out))
                results.append(out)
                print(f"round {r + 1} {name}: third tenant {out.status} after {out.wait:.1f} s; slow readers "
                      f"{[f'{got >> 10} KiB cut={closed}' for got, closed in out.readers]}; seats in use "
                      f"{out.seats:g}; apiserver RSS {out.apiserver_rss >> 20} MiB, proxy RSS "
                      f"{out.proxy_rss >> 20} MiB; load average "
                      f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}", flush=True)
    finally:
        down(work / "sandbox", say=lambda s: None)
    print(f"\nconditions: 3 apiservers {' '.join(STORAGE_READS)}, {args.secrets} Secrets x {args.size_kib} KiB, "
          f"2 slow readers at {args.rate:g} B/s (HTTP/1.1, 16 KiB receive buffer), third tenant over HTTP/2; "
          f"deadline {DEADLINE:g} s both sides; gatekeeper: 1 worker, seeds' policy; work dir {work}")
    print("\nmedian over rounds (ratio of the third tenant's wait to direct's in the same round):")
    for name in ARMS:
        mine = [o for o in results if o.arm == name]
        direct = [o for o in results if o.arm == "direct"]
        ratio = statistics.median(m.wait / d.wait for m, d in zip(mine, direct, strict=True))
        print(f"  {name:14} status {[o.status for o in mine]} wait {statistics.median(o.wait for o in mine):6.1f} s "
              f"(x{ratio:.2f})  apiserver RSS {statistics.median(o.apiserver_rss for o in mine) / 2**20:6.0f} MiB"
              f"  proxy RSS {statistics.median(o.proxy_rss for o in mine) / 2**20:5.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
