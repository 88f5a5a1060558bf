"""Benchmark: the upstream clients, beside HAProxy HTTP mode, in one run.

Not a test. One proxy per upstream client arm in front of the same sandbox, each
given the same closed-loop h2load rounds in turn (interleaved, so machine noise
hits all alike): gatekeeper with ``upstream.client: lean`` (HTTP/1.1, one
connection per request in flight), with ``upstream.http2: true`` (lean, plus
multiplexed HTTP/2 for short GETs of verified callers), with
``upstream.client: aiohttp`` (all one worker, the flow-control policy
``sandbox up --with-proxy`` deploys, which verifies the bench's token), and
HAProxy ``nbthread 1``. Prints the median CPU per request (utime and stime from
/proc, so kernel time counts), the ratios, and the median of the per-round
ratios to ``lean`` (the steadier figure on a noisy machine)::

    gatekeeper sandbox up --state-dir /tmp/bench --apiservers 3
    python loadtest/bench_upstream.py --state-dir /tmp/bench [--rounds 5] [--requests 4000] [--arms lean,http2]
    gatekeeper sandbox down --state-dir /tmp/bench

``--client-only`` measures the upstream client alone instead: in this process, no
listener, no pipeline, ``BackendClient.send`` of a small GET to apiserver 1 with 8
concurrent callers (an asserted identity, so ``http2`` multiplexes them), CPU
(``time.process_time``) per request, the arms interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import Env, h2load, load_average, tree_pids

from gatekeeper.proxy.messages import ProxyRequest
from gatekeeper.proxy.settings import UpstreamSettings
from gatekeeper.proxy.upstream.client import BackendClient
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess
from gatekeeper.sandbox.with_proxy import default_flow_control


def cpu_split(pids: list[int]) -> tuple[float, float]:
    """(utime, stime) seconds of ``pids``."""
    tick = os.sysconf("SC_CLK_TCK")
    user = system = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user, system = user + int(fields[11]), system + int(fields[12])
    return user / tick, system / tick


ARMS: dict[str, dict[str, Any]] = {
    "lean": {"client": "lean", "http2": False},
    "http2": {"client": "lean", "http2": True},
    "aiohttp": {"client": "aiohttp", "http2": False},
}
"""Upstream settings of each arm (camelCase, as in the config file). ``http2`` is set in each: it defaults to on,
so an arm without it multiplexed its verified GETs too."""


def start_gatekeeper(env: Env, arm: str) -> tuple[str, int]:
    work = env.work / f"gk-{arm}"
    work.mkdir(exist_ok=True)
    config: dict[str, Any] = {"flowControl": default_flow_control() or {}, "upstream": dict(ARMS[arm])}
    gk = ProxyProcess(env.state, work, name=f"gk-{arm}", health_interval=0.5, user_config=config, workers=1)
    try:
        gk.start(timeout=120)
    finally:
        if gk.proc is not None:
            env.procs.append(gk.proc)
    assert gk.proc is not None
    return gk.url, gk.proc.pid


async def client_round(state: SandboxState, arm: str, n: int, concurrency: int) -> float:
    """CPU milliseconds per small GET through ``BackendClient.send`` alone."""
    certs = Path(state.certs_dir)
    settings = UpstreamSettings(ca_file=str(certs / "ca.crt"), client_cert_file=str(certs / "front-proxy-client.crt"),
                                client_key_file=str(certs / "front-proxy-client.key"), client=ARMS[arm]["client"],
                                http2=bool(ARMS[arm].get("http2")))
    backend = BackendClient("apiserver-1", state.apiserver_urls[0], settings)
    headers = [("x-remote-user", "admin"), ("x-remote-group", "system:masters"), ("accept", "application/json"),
               ("user-agent", "bench"), ("x-forwarded-for", "127.0.0.1")]

    async def caller(count: int) -> None:
        for _ in range(count):
            request = ProxyRequest(method="GET", target="/api/v1/namespaces/default", headers=headers, body=None,
                                   protocol="h2")
            resp = await backend.send(request, headers, identity=True, swallow_body_errors=False,
                                      on_done=lambda _e: None, multiplex=True)
            async for _ in resp.body:
                pass
            assert resp.status == 200, resp.status

    try:
        await asyncio.gather(*(caller(20) for _ in range(concurrency)))  # warm the pool
        started = time.process_time()
        await asyncio.gather(*(caller(n // concurrency) for _ in range(concurrency)))
        return (time.process_time() - started) * 1000 / n
    finally:
        await backend.close()


def to_lean(cpu: dict[str, list[float]]) -> str:
    """Each arm against ``lean``: the median of the per-round ratios (a slow round hits both alike)."""
    if "lean" not in cpu:
        return ""
    parts = [f"{name} x{statistics.median(a / b for a, b in zip(values, cpu['lean'], strict=True)):.2f}"
             for name, values in cpu.items() if name != "lean"]
    return "per-round ratio to lean (median): " + ", ".join(parts)


def client_only(state_dir: str, rounds: int, n: int, arms: list[str]) -> None:
    import uvloop

    state = SandboxState.load(state_dir)
    print(f"load average before: {load_average()}")
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm in cpu:
            cpu[arm].append(uvloop.run(client_round(state, arm, n, 8)))
    print(f"load average after: {load_average()}")
    med = {k: statistics.median(v) for k, v in cpu.items()}
    for arm, values in cpu.items():
        print(f"{arm:8s} upstream client CPU {med[arm]:.3f} ms/req   rounds: " + " ".join(f"{v:.3f}" for v in values))
    print(to_lean(cpu))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--client-only", action="store_true", help="the upstream client alone, in this process")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        sys.exit(f"unknown arms: {', '.join(sorted(unknown))}")
    if args.client_only:
        client_only(args.state_dir, args.rounds, args.requests, arms)
        return
    env = Env(args.state_dir, Path(tempfile.mkdtemp(prefix="gk-bench-upstream-")))
    env.make_token()
    try:
        targets = {arm: start_gatekeeper(env, arm) for arm in arms}
        targets["haproxy"] = env.start_haproxy(nbthread=1, name="hap-t1")
        for url, _ in targets.values():
            h2load(env, url, 400, 4, 4)  # warm-up
        print(f"load average before: {load_average()}")
        cpu: dict[str, list[float]] = {k: [] for k in targets}
        sys_share: dict[str, list[float]] = {k: [] for k in targets}
        rps: dict[str, list[float]] = {k: [] for k in targets}
        for _ in range(args.rounds):
            for name, (url, pid) in targets.items():
                pids = tree_pids(pid)
                u0, s0 = cpu_split(pids)
                r = h2load(env, url, args.requests, args.clients, args.streams)
                u1, s1 = cpu_split(pids)
                ok = max(1.0, r["ok2xx"])
                cpu[name].append((u1 - u0 + s1 - s0) * 1000 / ok)
                sys_share[name].append((s1 - s0) / max(1e-9, u1 - u0 + s1 - s0))
                rps[name].append(r["rps"])
        print(f"load average after: {load_average()}")
        print(f"\n== closed loop h2load -n {args.requests} -c {args.clients} -m {args.streams}, "
              f"{args.rounds} interleaved rounds, medians ==")
        med = {k: statistics.median(v) for k, v in cpu.items()}
        for name in targets:
            print(f"{name:8s} CPU {med[name]:.3f} ms/req (kernel {statistics.median(sys_share[name]):.0%})  "
                  f"{statistics.median(rps[name]):6.0f} req/s   rounds: "
                  + " ".join(f"{c:.3f}" for c in cpu[name]))
        hap, hap_rps = med["haproxy"], statistics.median(rps["haproxy"])
        print("CPU per request vs HAProxy: " + ", ".join(f"{arm} x{med[arm] / hap:.2f}" for arm in arms))
        print("req/s vs HAProxy: " + ", ".join(f"{arm} x{statistics.median(rps[arm]) / hap_rps:.2f}" for arm in arms))
        print(to_lean({arm: cpu[arm] for arm in arms}))
    finally:
        env.stop()


if __name__ == "__main__":
    main()
