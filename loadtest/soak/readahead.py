"""``python -m loadtest bench read-ahead-memory``: a worker's RSS with its read-ahead budget full.

The sizing table (docs/proxy/memory.md) needs what a worker weighs when slow LIST readers have filled
``readAheadBytes``. One proxy process (``--workers 1``: the same code as a worker) with the seeds' policy and a
budget of ``--budget-mib`` (``readAheadBytesPerConnection`` a quarter of it); tenants (client certificates, never
system:masters) LIST a namespace of Secrets that fits a connection's share (so each LIST is read to its end and
its seat goes back) and read the answer at 1 KiB/s, one more of them than it takes to fill the budget. Printed:
the process's RSS at rest (after one fast LIST), its peak while the read ahead is full, the bytes the proxy says
it holds (``gatekeeper_flowcontrol_read_ahead_bytes``), and RSS per byte held, which scales the full default
budget (256 MiB). Bounded: the readers stop after ``--seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import tempfile
import time
from pathlib import Path

import httpx

from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess, metric_sum
from gatekeeper.sandbox.with_proxy import default_flow_control
from loadtest.harness.cluster import kit
from loadtest.soak.procmem import status_fields

MIB = 1 << 20
HELD = "gatekeeper_flowcontrol_read_ahead_bytes"


async def _fill(proxy: ProxyProcess, state: SandboxState, namespace: str, readers: int, seconds: float,
                pid: int) -> tuple[float, float]:
    """Peak RSS (MiB) and the most bytes held (MiB) while ``readers`` slow readers read the namespace's LIST."""
    port = int(proxy.url.rsplit(":", 1)[1])
    path = f"/api/v1/namespaces/{namespace}/secrets"
    tasks = [asyncio.create_task(kit.slow_reader(port, kit.tenant_ctx(state, f"ra-{i}"), path, 1024, seconds))
             for i in range(readers)]
    peak_rss = peak_held = 0.0
    end = time.monotonic() + seconds
    while time.monotonic() < end and not all(t.done() for t in tasks):
        await asyncio.sleep(2)
        fields = status_fields(pid)
        if fields:
            peak_rss = max(peak_rss, fields["VmRSS"] / MIB)
        page = await asyncio.to_thread(proxy.metrics)
        peak_held = max(peak_held, metric_sum(page, HELD) / MIB)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return peak_rss, peak_held


def measure(state: SandboxState, work: Path, *, budget_mib: int, secrets: int, size_kib: int,
            seconds: float) -> dict[str, float]:
    per_connection = budget_mib // 4
    list_mib = secrets * size_kib / 1024
    if list_mib > per_connection:  # else the upstream read pauses and the reader keeps its seat (2 in the seeds)
        raise SystemExit(f"the LIST ({list_mib:.0f} MiB) must fit a connection's share ({per_connection} MiB)")
    flow = {**default_flow_control(), "readAheadBytes": budget_mib * MIB,
            "readAheadBytesPerConnection": per_connection * MIB}
    with kit.big_namespace(state, "ra-mem", secrets, size_kib * 1024) as namespace:
        proxy = ProxyProcess(state, work, name="ra-proxy", user_config={"flowControl": flow}, workers=1)
        proxy.start(timeout=120)
        assert proxy.proc is not None
        try:
            ctx = kit.tenant_ctx(state, "ra-warm")
            with httpx.Client(verify=ctx, timeout=120) as client:  # one fast LIST: pools, memos, buffers warm
                r = client.get(f"{proxy.url}/api/v1/namespaces/{namespace}/secrets")
                assert r.status_code == 200, r.text[:200]
            time.sleep(2)
            rest = (status_fields(proxy.proc.pid) or {"VmRSS": 0})["VmRSS"] / MIB
            readers = math.ceil(budget_mib / list_mib) + 1
            peak, held = asyncio.run(_fill(proxy, state, namespace, readers, seconds, proxy.proc.pid))
        finally:
            proxy.stop()
    return {"rest": rest, "peak": peak, "held": held, "readers": readers, "per_connection": per_connection}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest bench read-ahead-memory",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-dir", required=True, type=Path, help="a running sandbox")
    ap.add_argument("--budget-mib", type=int, default=64, help="readAheadBytes in MiB (default 64)")
    ap.add_argument("--secrets", type=int, default=60, help="Secrets in the LISTed namespace (default 60)")
    ap.add_argument("--size-kib", type=int, default=200, help="size of each Secret (default 200 KiB)")
    ap.add_argument("--seconds", type=float, default=60, help="how long the slow readers read (default 60)")
    args = ap.parse_args()
    state = SandboxState.load(args.state_dir)
    load_before = os.getloadavg()
    got = measure(state, Path(tempfile.mkdtemp(prefix="ra-mem-")), budget_mib=args.budget_mib,
                  secrets=args.secrets, size_kib=args.size_kib, seconds=args.seconds)
    grew = got["peak"] - got["rest"]
    print(f"budget {args.budget_mib} MiB ({got['per_connection']:.0f} per connection), {got['readers']:.0f} slow "
          f"readers of a {args.secrets * args.size_kib / 1024:.1f} MiB LIST")
    print(f"RSS at rest {got['rest']:.1f} MiB, peak {got['peak']:.1f} MiB (+{grew:.1f}); read ahead held at most "
          f"{got['held']:.1f} MiB; RSS per byte held {grew / max(got['held'], 1e-9):.2f}")
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
