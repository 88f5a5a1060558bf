"""Benchmark: where the proxy's CPU per request goes, by layer, beside HAProxy in the same run.

Not a test: it prints figures and ratios measured on one machine, rounds interleaved.

    gatekeeper sandbox up --state-dir /tmp/bench --apiservers 3
    python loadtest/bench_layers.py --state-dir /tmp/bench --rounds 5
    gatekeeper sandbox down --state-dir /tmp/bench

Issue 9's target is CPU per small GET <= 3x HAProxy HTTP mode. A profile of the
whole proxy is flat (no function of ours above ~3%), so this script splits the
cost by what a request passes through instead, each figure from /proc (utime +
stime of the proxy process) over a closed loop of ``h2load -c 8 -m 8``:

* ``proxied GET, flow control as deployed``: the whole path;
* ``proxied GET, flow control off``: the same without the flow-control middleware.
  Without flow control no token is verified, so these GETs take the HTTP/1.1 pool,
  not the multiplexed HTTP/2 upstream (it only carries callers the apiserver will
  authenticate). The difference to the first arm is therefore flow control *and*
  the upstream protocol;
* ``answered by the proxy``: ``GET /metrics`` with a bearer token, which the
  proxy answers itself (403: the page needs an admin certificate) after the
  client-facing TLS, HTTP/2 codec, target check, identity and RequestInfo, with
  no upstream exchange; the difference to the flow-control-off GET is the cost
  of the upstream leg (balancer, request head, backend TLS write and read,
  response parsing, the response's passage back, and the loop wake-ups it needs);
* HAProxy 2.6 HTTP mode, ``nbthread 1``, TLS on both sides: the reference.

HAProxy's figure covers its whole proxied request, so the local answer's ratio
says how much of the x3 budget the client-facing side alone uses.

``--pin`` runs every arm twice: as the issue measures (everything shares the
cores) and with the proxy under test alone on CPU 0, the sandbox's processes and
h2load on the others, as a proxy with a dedicated core (Guaranteed QoS, static
CPU manager) would run. On a 2-core machine the shared run preempts the proxy
at about every write that wakes an apiserver thread; the voluntary and
involuntary context switches per request are printed to show it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadtest.bench.proxies import Env, cpu_seconds, load_average, start_warm, tree_pids

GET_PATH = "/api/v1/namespaces/default"
LOCAL_PATH = "/metrics"


def switches(pids: list[int]) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of ``pids`` so far, all their threads."""
    vol = invol = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            vol += int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
            invol += int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    return vol, invol


def set_affinity(pids: list[int], cpus: set[int]) -> None:
    """Every thread of ``pids`` (a Go apiserver has dozens) on ``cpus``."""
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def pinned(proxy_pid: int, sandbox_pids: list[int], on: bool) -> Iterator[set[int] | None]:
    """With ``on``: the proxy alone on CPU 0, the sandbox on the other CPUs; yields h2load's CPUs."""
    everything = os.sched_getaffinity(0)
    if not on:
        yield None
        return
    rest = everything - {0}
    set_affinity(tree_pids(proxy_pid), {0})
    set_affinity([p for s in sandbox_pids for p in tree_pids(s)], rest)
    try:
        yield rest
    finally:
        set_affinity(tree_pids(proxy_pid), everything)
        set_affinity([p for s in sandbox_pids for p in tree_pids(s)], everything)


def closed_loop_cpu(env: Env, base: str, pid: int, path: str, n: int,
                    cpus: set[int] | None = None) -> tuple[float, float, float, float]:
    """(CPU ms, voluntary and involuntary context switches per finished request, req/s) of
    ``h2load -n n -c 8 -m 8`` on ``base + path`` (h2load on ``cpus`` when given)."""
    pids = tree_pids(pid)
    before, (vol0, invol0) = cpu_seconds(pids), switches(pids)
    out = subprocess.run(
        ["h2load", "-n", str(n), "-c", "8", "-m", "8", "-H", f"authorization: Bearer {env.token}",
         "-H", "accept: application/json", f"{base}{path}"],
        capture_output=True, text=True, check=False,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    ).stdout
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done", out)
    rate = re.search(r"finished in [\d.]+m?s, ([\d.]+) req/s", out)
    if not done or not rate or int(done.group(1)) == 0:
        raise SystemExit(f"h2load output not understood:\n{out}")
    count = int(done.group(1))
    vol1, invol1 = switches(pids)
    return ((cpu_seconds(pids) - before) * 1000 / count, (vol1 - vol0) / count, (invol1 - invol0) / count,
            float(rate.group(1)))


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def report(title: str, arms: list[str], cpu: dict[str, list[float]], extra: dict[str, list[tuple[float, ...]]]) -> None:
    med = {k: median(v) for k, v in cpu.items()}
    ref = med[arms[0]]
    print(f"\n-- {title} --")
    for name in arms:
        vol, invol, rps = (median([x[i] for x in extra[name]]) for i in range(3))
        print(f"{name:52s} {med[name]:.3f} ms/req x{med[name] / max(ref, 1e-6):.2f} of HAProxy  (rounds "
              f"{', '.join(f'{x:.3f}' for x in cpu[name])}; {rps:.0f} req/s; context switches per request "
              f"{vol:.2f} voluntary, {invol:.2f} involuntary)")
    full, nofc, local = med[arms[1]], med[arms[2]], med[arms[3]]
    print(f"flow control + HTTP/2 upstream: {full - nofc:+.3f} ms/req (x{(full - nofc) / max(ref, 1e-6):.2f} of "
          f"HAProxy's whole request)")
    print(f"upstream leg:        {nofc - local:+.3f} ms/req (x{(nofc - local) / max(ref, 1e-6):.2f})")
    print(f"client-facing side:  {local:.3f} ms/req (x{local / max(ref, 1e-6):.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", required=True, help="a running sandbox with >= 3 apiservers")
    ap.add_argument("--requests", type=int, default=20000, help="h2load requests per arm and round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--pin", action="store_true",
                    help="also measure each arm with the proxy alone on CPU 0 (needs >= 2 CPUs)")
    args = ap.parse_args()
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        sys.exit("--pin needs at least 2 usable CPUs")
    env = Env(args.state_dir, Path(tempfile.mkdtemp(prefix="gk-layers-")))
    env.make_token()
    sandbox_pids = [p.pid for p in env.state.processes]
    try:
        gk, hap = start_warm(env, {"fc": {"name": "gk-fc", "workers": 1}}, {"hap": {"nbthread": 1}})
        nofc_url, nofc_pid = env.start_gatekeeper("gk-nofc", workers=1, deployed_flow_control=False)
        arms = {
            "haproxy nbthread 1, proxied GET": (hap["hap"][0], hap["hap"][1], GET_PATH),
            "gatekeeper, proxied GET, flow control as deployed": (gk["fc"][0], gk["fc"][1], GET_PATH),
            "gatekeeper, proxied GET, flow control off": (nofc_url, nofc_pid, GET_PATH),
            "gatekeeper, answered by the proxy (no upstream)": (gk["fc"][0], gk["fc"][1], LOCAL_PATH),
        }
        for url, pid, path in arms.values():
            closed_loop_cpu(env, url, pid, path, 400)  # warm every arm, the local answer included
        placements = ["shared", "pinned"] if args.pin else ["shared"]
        print(f"\n== CPU per request by layer: h2load -n {args.requests} -c 8 -m 8, {args.rounds} interleaved "
              f"rounds ({', '.join(placements)}); load average before: {load_average()} ==")
        cpu: dict[tuple[str, str], list[float]] = {}
        extra: dict[tuple[str, str], list[tuple[float, ...]]] = {}
        for _ in range(args.rounds):
            for placement in placements:
                for name, (url, pid, path) in arms.items():
                    with pinned(pid, sandbox_pids, placement == "pinned") as cpus:
                        c, vol, invol, r = closed_loop_cpu(env, url, pid, path, args.requests, cpus)
                    cpu.setdefault((placement, name), []).append(c)
                    extra.setdefault((placement, name), []).append((vol, invol, r))
        for placement in placements:
            title = ("everything shares the cores" if placement == "shared"
                     else "the proxy under test alone on CPU 0, the sandbox and h2load on the others")
            report(title, list(arms), {n: cpu[(placement, n)] for n in arms},
                   {n: extra[(placement, n)] for n in arms})
        print(f"load average after: {load_average()}")
    finally:
        with contextlib.suppress(OSError):
            set_affinity([p for s in sandbox_pids for p in tree_pids(s)], os.sched_getaffinity(0))
        env.stop()


if __name__ == "__main__":
    main()
