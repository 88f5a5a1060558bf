"""CPU per request (user/sys, from /proc) of two gatekeeper builds and HAProxy, interleaved in one run.

Not a test: the A/B harness for hot-path changes. ``--base DIR`` runs a second
gatekeeper from another source tree (``git archive <commit> gatekeeper | tar -x -C DIR``)
through ``PYTHONPATH``; both proxies run one worker with the flow-control policy
``sandbox up --with-proxy`` deploys. Each figure is printed with its ratio to the
HAProxy (``nbthread 1``) round before it::

    python loadtest/split_ab.py --state-dir /tmp/bench [--base /tmp/base] [-n 40000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadtest.bench.proxies import Env, h2load, tree_pids


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    user = system = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        user += int(fields[11])
        system += int(fields[12])
    hz = os.sysconf("SC_CLK_TCK")
    return user / hz, system / hz


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--base", help="source tree of the baseline gatekeeper (holds gatekeeper/)")
    ap.add_argument("-n", type=int, default=40000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    env = Env(args.state_dir, Path(tempfile.mkdtemp(prefix="split-ab-")))
    env.make_token()
    try:
        targets: list[tuple[str, str, int]] = []
        url, pid = env.start_haproxy(1)
        targets.append(("haproxy", url, pid))
        if args.base:
            # PYTHONSAFEPATH: `python -m gatekeeper` puts its working directory first on sys.path, so run
            # from the repository root the "base" proxy loaded this tree's gatekeeper, not --base's.
            os.environ["PYTHONPATH"], os.environ["PYTHONSAFEPATH"] = args.base, "1"
            loaded = subprocess.run([sys.executable, "-c", "import gatekeeper; print(gatekeeper.__file__)"],
                                    capture_output=True, text=True, check=True).stdout.strip()
            if not Path(loaded).resolve().is_relative_to(Path(args.base).resolve()):
                sys.exit(f"--base {args.base}: the proxy would load {loaded} instead")
            url, pid = env.start_gatekeeper("gk-base", workers=1, deployed_flow_control=True)
            del os.environ["PYTHONPATH"], os.environ["PYTHONSAFEPATH"]
            targets.append(("gk-base", url, pid))
        url, pid = env.start_gatekeeper("gk-new", workers=1, deployed_flow_control=True)
        targets.append(("gk-new", url, pid))
        per: dict[str, list[float]] = {name: [] for name, _, _ in targets}
        ratios: dict[str, list[float]] = {name: [] for name, _, _ in targets[1:]}
        for r in range(args.rounds):
            order = targets[1:] if r % 2 == 0 else targets[:0:-1]
            got: dict[str, float] = {}
            for name, url, pid in [targets[0], *order]:
                h2load(env, url, 2000, 4, 4)
                pids = tree_pids(pid)
                u0, s0 = cpu_seconds(pids)
                res = h2load(env, url, args.n, 8, 8)
                u1, s1 = cpu_seconds(pids)
                total = got[name] = 1e3 * ((u1 - u0) + (s1 - s0)) / args.n
                per[name].append(total)
                print(f"round {r} {name:8s} user {1e3 * (u1 - u0) / args.n:.3f} sys {1e3 * (s1 - s0) / args.n:.3f} "
                      f"total {total:.3f} ms/req  x{total / got['haproxy']:.2f}  {res['rps']:.0f} req/s "
                      f"fail {res['failed']:.0f}  load {os.getloadavg()[0]:.2f}", flush=True)
            for name in ratios:
                ratios[name].append(got[name] / got["haproxy"])
            if "gk-base" in got:
                print(f"round {r} gk-new/gk-base {got['gk-new'] / got['gk-base']:.3f}", flush=True)
        for name, values in per.items():
            line = f"{name:8s} median {statistics.median(values):.3f} ms/req"
            if name in ratios:
                line += f"  x{statistics.median(ratios[name]):.2f} of HAProxy (median of per-round ratios)"
            print(line)
        if "gk-base" in per:
            paired = [n / b for n, b in zip(per["gk-new"], per["gk-base"], strict=True)]
            print(f"gk-new/gk-base: median {statistics.median(paired):.3f} over {len(paired)} rounds")
    finally:
        env.stop()


if __name__ == "__main__":
    main()
