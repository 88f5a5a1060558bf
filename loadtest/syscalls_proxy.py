"""Syscalls per proxied request: gatekeeper (1 worker) beside HAProxy HTTP mode (nbthread 1), same load.

Not a test. The pinned py-spy profile (``profile_proxy.py --pin``) puts a quarter of
the proxy's CPU in the event loop's own C code, which py-spy cannot see into:
epoll, socket reads and writes, TLS records. This counts the syscalls behind it
with ``strace -c -f`` while h2load runs a closed loop of small GETs (bearer token),
and prints each proxy's syscalls per request by name::

    gatekeeper sandbox up --state-dir /tmp/bench --apiservers 3
    python loadtest/syscalls_proxy.py --state-dir /tmp/bench [--requests 4000]
    gatekeeper sandbox down --state-dir /tmp/bench

strace slows the traced process a lot, so read counts per request, never times.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import Env, h2load


def traced(env: Env, url: str, pid: int, n: int) -> tuple[float, dict[str, int]]:
    """(2xx answered, syscall counts) of ``pid`` and its threads during ``n`` requests."""
    out = Path(tempfile.mktemp(dir=env.work, suffix=".strace"))
    st = subprocess.Popen(["strace", "-c", "-f", "-o", str(out), "-p", str(pid)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached
    r = h2load(env, url, n, 8, 8)
    st.terminate()
    st.wait(30)
    counts: dict[str, int] = {}
    for line in out.read_text().splitlines():
        m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)$", line)
        if m and m.group(2) != "total":
            counts[m.group(2)] = int(m.group(1))
    return r["ok2xx"], counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--requests", type=int, default=4000)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gk-syscalls-"))
    env = Env(args.state_dir, work)
    env.make_token()
    try:
        gk = env.start_gatekeeper("gk-syscalls", workers=1, deployed_flow_control=True)
        hap = env.start_haproxy(nbthread=1, name="hap-syscalls")
        per: dict[str, dict[str, float]] = {}
        for label, (url, pid) in (("gatekeeper", gk), ("haproxy", hap)):
            h2load(env, url, 400, 4, 4)  # warm-up: pools, caches
            ok, counts = traced(env, url, pid, args.requests)
            per[label] = {k: v / max(ok, 1.0) for k, v in counts.items()}
        names = sorted(set(per["gatekeeper"]) | set(per["haproxy"]),
                       key=lambda k: -max(per["gatekeeper"].get(k, 0), per["haproxy"].get(k, 0)))
        print(f"\nsyscalls per request, h2load -n {args.requests} -c 8 -m 8 (strace -c -f)")
        print(f"{'syscall':18s} {'gatekeeper':>11s} {'haproxy':>9s}")
        for k in names:
            g, h = per["gatekeeper"].get(k, 0.0), per["haproxy"].get(k, 0.0)
            if g >= 0.01 or h >= 0.01:
                print(f"{k:18s} {g:11.2f} {h:9.2f}")
        print(f"{'total':18s} {sum(per['gatekeeper'].values()):11.2f} {sum(per['haproxy'].values()):9.2f}")
    finally:
        env.stop()
        print(f"\n(work directory {work})")


if __name__ == "__main__":
    main()
