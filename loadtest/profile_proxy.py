"""Profile the proxy under closed-loop load: where does the CPU of a small GET go?

Not a test. Starts one gatekeeper proxy (one worker, the flow-control policy
``sandbox up --with-proxy`` deploys) in front of a running sandbox, drives it with
h2load (small GETs, bearer token), samples it with py-spy (``pip install py-spy``),
and prints the functions with the largest inclusive and self shares::

    gatekeeper sandbox up --state-dir /tmp/bench --apiservers 3
    python loadtest/profile_proxy.py --state-dir /tmp/bench [--seconds 20] [--svg out.svg]
    gatekeeper sandbox down --state-dir /tmp/bench

The raw collapsed stacks stay in the printed work directory (``flamegraph.pl`` or
speedscope read them).

``--pin`` puts the proxy alone on CPU 0 and the sandbox's processes and h2load on
the other CPUs (``taskset``). Why: py-spy samples wall-clock time of a thread that is
not asleep, and a proxy sharing a core with the apiservers is preempted right after
each write that wakes one of them (a loopback send runs the receiver's wake-up in the
sender's syscall). Unpinned, that waiting shows up as the writing function's own time
(``Conn.begin`` at about 40% on a 2-core machine); pinned, the samples approximate the
proxy's CPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadtest.bench.proxies import Env, h2load


def summarize(collapsed: Path, top: int) -> None:
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0] + " " + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1]
                  for f in stack.split(";")]
        for f in set(frames):
            inclusive[f] += n
        own[frames[-1]] += n
    print(f"\n{total} samples; inclusive share (top {top}):")
    for f, n in inclusive.most_common(top):
        print(f"  {n / total:6.1%}  {f}")
    print(f"\nself share (top {top}):")
    for f, n in own.most_common(top):
        print(f"  {n / total:6.1%}  {f}")


def pin(proxy_pid: int, env: Env) -> str:
    """Proxy (every thread) on CPU 0, the sandbox's processes on the rest; returns the rest for h2load."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("--pin needs at least 2 CPUs")
    others = ",".join(str(c) for c in cpus[1:])
    subprocess.run(["taskset", "-a", "-p", "-c", str(cpus[0]), str(proxy_pid)], check=True, capture_output=True)
    for rec in env.state.processes:
        subprocess.run(["taskset", "-a", "-p", "-c", others, str(rec.pid)], capture_output=True)
    return others


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--requests", type=int, default=200_000, help="upper bound; h2load is stopped after --seconds")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--svg", default="", help="also write a flame graph here")
    ap.add_argument("--pin", action="store_true", help="proxy alone on CPU 0, everything else on the others")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gk-profile-"))
    env = Env(args.state_dir, work)
    env.make_token()
    try:
        url, pid = env.start_gatekeeper("gk-profile", workers=1, deployed_flow_control=True)
        others = ""
        if args.pin:
            others = pin(pid, env)
        h2load(env, url, 500, 4, 4)  # warm-up
        load = threading.Thread(target=lambda: subprocess.run(
            [*(["taskset", "-c", others] if others else []), "timeout", str(args.seconds + 5),
             "h2load", "-n", str(args.requests), "-c", "8", "-m", "8",
             "-H", f"authorization: Bearer {env.token}", f"{url}/api/v1/namespaces/default"],
            capture_output=True), daemon=True)
        load.start()
        raw = work / "profile.txt"
        subprocess.run(["py-spy", "record", "--pid", str(pid), "--duration", str(args.seconds), "--rate", "200",
                        "--format", "raw", "-o", str(raw), "--nonblocking"], check=True, capture_output=True)
        if args.svg:
            subprocess.run(["py-spy", "record", "--pid", str(pid), "--duration", "5", "-o", args.svg,
                            "--nonblocking"], check=True, capture_output=True)
        load.join()
        summarize(raw, args.top)
    finally:
        env.stop()
        print(f"\n(collapsed stacks in {work})")


if __name__ == "__main__":
    main()
