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
* ``proxied GET, flow control off``: the same without the flow-control middleware,
  so the difference is what flow control costs per request;
* ``answered by the proxy``: ``GET /metrics`` with a bearer token, which the
  proxy answers itself (403: the page needs an admin certificate) after the
  client-facing TLS, HTTP/2 codec, target check, identity and RequestInfo, with
  no upstream exchange; the difference to the flow-control-off GET is the cost
  of the upstream leg (balancer, request head, backend TLS write and read,
  response parsing, the response's passage back, and the loop wake-ups it needs);
* HAProxy 2.6 HTTP mode, ``nbthread 1``, TLS on both sides: the reference.

HAProxy's figure covers its whole proxied request, so the local answer's ratio
says how much of the x3 budget the client-facing side alone uses.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import Env, cpu_seconds, load_average, sh, start_warm, tree_pids

GET_PATH = "/api/v1/namespaces/default"
LOCAL_PATH = "/metrics"


def closed_loop_cpu(env: Env, base: str, pid: int, path: str, n: int) -> tuple[float, float]:
    """(CPU ms per finished request, req/s) of ``h2load -n n -c 8 -m 8`` on ``base + path``."""
    pids = tree_pids(pid)
    before = cpu_seconds(pids)
    out = sh("h2load", "-n", str(n), "-c", "8", "-m", "8", "-H", f"authorization: Bearer {env.token}",
             "-H", "accept: application/json", f"{base}{path}").stdout
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done", out)
    rate = re.search(r"finished in [\d.]+m?s, ([\d.]+) req/s", out)
    if not done or not rate or int(done.group(1)) == 0:
        raise SystemExit(f"h2load output not understood:\n{out}")
    return (cpu_seconds(pids) - before) * 1000 / int(done.group(1)), float(rate.group(1))


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", required=True, help="a running sandbox with >= 3 apiservers")
    ap.add_argument("--requests", type=int, default=20000, help="h2load requests per arm and round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    args = ap.parse_args()
    env = Env(args.state_dir, Path(tempfile.mkdtemp(prefix="gk-layers-")))
    env.make_token()
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
        print(f"\n== CPU per request by layer: h2load -n {args.requests} -c 8 -m 8, {args.rounds} interleaved "
              f"rounds; load average before: {load_average()} ==")
        cpu: dict[str, list[float]] = {k: [] for k in arms}
        rps: dict[str, list[float]] = {k: [] for k in arms}
        for _ in range(args.rounds):
            for name, (url, pid, path) in arms.items():
                c, r = closed_loop_cpu(env, url, pid, path, args.requests)
                cpu[name].append(c)
                rps[name].append(r)
        med = {k: median(v) for k, v in cpu.items()}
        ref = med["haproxy nbthread 1, proxied GET"]
        for name in arms:
            print(f"{name:52s} {med[name]:.3f} ms/req x{med[name] / max(ref, 1e-6):.2f} of HAProxy  "
                  f"(rounds {', '.join(f'{x:.3f}' for x in cpu[name])}; {median(rps[name]):.0f} req/s)")
        full = med["gatekeeper, proxied GET, flow control as deployed"]
        nofc = med["gatekeeper, proxied GET, flow control off"]
        local = med["gatekeeper, answered by the proxy (no upstream)"]
        print(f"flow control:        {full - nofc:+.3f} ms/req (x{(full - nofc) / max(ref, 1e-6):.2f} of HAProxy's "
              f"whole request)")
        print(f"upstream leg:        {nofc - local:+.3f} ms/req (x{(nofc - local) / max(ref, 1e-6):.2f})")
        print(f"client-facing side:  {local:.3f} ms/req (x{local / max(ref, 1e-6):.2f})")
        print(f"load average after: {load_average()}")
    finally:
        env.stop()


if __name__ == "__main__":
    main()
