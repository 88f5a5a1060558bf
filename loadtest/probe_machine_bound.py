"""Is closed-loop throughput limited by the proxy or by the machine? Not a test: it prints figures.

A flat throughput-by-workers table means nothing until we know whether the cores are already used. This drives
one gatekeeper (1 worker, the flow-control policy ``sandbox up --with-proxy`` deploys) and one apiserver directly
with h2load at rising concurrency, and reads the whole machine's busy share from /proc/stat during each run::

    gatekeeper sandbox up --state-dir /tmp/bench --apiservers 3
    python loadtest/probe_machine_bound.py --state-dir /tmp/bench
    gatekeeper sandbox down --state-dir /tmp/bench
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import Env, cpu_ticks, h2load

LEVELS = ((1, 1), (8, 1), (8, 8), (32, 8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--requests", type=int, default=3000)
    args = ap.parse_args()
    env = Env(args.state_dir, Path(tempfile.mkdtemp(prefix="gk-probe-")))
    env.make_token()
    try:
        url, _ = env.start_gatekeeper("gk-probe", workers=1, deployed_flow_control=True)
        h2load(env, url, 500, 4, 4)  # warm-up
        for name, base in (("gatekeeper", url), ("direct apiserver", env.backends[0])):
            for clients, streams in LEVELS:
                total0, idle0 = cpu_ticks()
                r = h2load(env, base, args.requests, clients, streams)
                total1, idle1 = cpu_ticks()
                busy = 1 - (idle1 - idle0) / max(1, total1 - total0)
                print(f"{name:18s} -c {clients:2d} -m {streams}: {r['rps']:7.0f} req/s  p50 {r['p50']:7.2f} ms"
                      f"  machine busy {busy:6.1%}", flush=True)
    finally:
        env.stop()


if __name__ == "__main__":
    main()
