"""Benchmark: the upstream client alone, lean vs aiohttp, beside HAProxy HTTP mode, in one run.

Not a test. Three proxies in front of the same sandbox, each given the same
closed-loop h2load rounds in turn (interleaved, so machine noise hits all
three alike): gatekeeper with ``upstream.client: lean``, gatekeeper with
``upstream.client: aiohttp`` (both one worker, the flow-control policy
``sandbox up --with-proxy`` deploys) and HAProxy ``nbthread 1``. Prints the
median CPU per request (utime and stime from /proc, so kernel time counts)
and the ratios::

    gatekeeper sandbox up --state-dir /tmp/bench --apiservers 3
    python loadtest/bench_upstream.py --state-dir /tmp/bench [--rounds 5] [--requests 4000]
    gatekeeper sandbox down --state-dir /tmp/bench

``--client-only`` measures the upstream client alone instead: in this process, no
listener, no pipeline, ``BackendClient.send`` of a small GET to apiserver 1 with 8
concurrent callers, CPU (``time.process_time``) per request, lean and aiohttp
interleaved.
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


def start_gatekeeper(env: Env, client: str) -> tuple[str, int]:
    work = env.work / f"gk-{client}"
    work.mkdir(exist_ok=True)
    config: dict[str, Any] = {"flowControl": default_flow_control() or {}, "upstream": {"client": client}}
    gk = ProxyProcess(env.state, work, name=f"gk-{client}", health_interval=0.5, user_config=config, workers=1)
    try:
        gk.start(timeout=120)
    finally:
        if gk.proc is not None:
            env.procs.append(gk.proc)
    assert gk.proc is not None
    return gk.url, gk.proc.pid


async def client_round(state: SandboxState, client: str, n: int, concurrency: int) -> float:
    """CPU milliseconds per small GET through ``BackendClient.send`` alone."""
    certs = Path(state.certs_dir)
    settings = UpstreamSettings(ca_file=str(certs / "ca.crt"), client_cert_file=str(certs / "front-proxy-client.crt"),
                                client_key_file=str(certs / "front-proxy-client.key"), client=client)
    backend = BackendClient("apiserver-1", state.apiserver_urls[0], settings)
    headers = [("x-remote-user", "admin"), ("x-remote-group", "system:masters"), ("accept", "application/json"),
               ("user-agent", "bench"), ("x-forwarded-for", "127.0.0.1")]

    async def caller(count: int) -> None:
        for _ in range(count):
            request = ProxyRequest(method="GET", target="/api/v1/namespaces/default", headers=headers, body=None,
                                   protocol="h2")
            resp = await backend.send(request, headers, identity=True, swallow_body_errors=False,
                                      on_done=lambda _e: None)
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


def client_only(state_dir: str, rounds: int, n: int) -> None:
    import uvloop

    state = SandboxState.load(state_dir)
    print(f"load average before: {load_average()}")
    cpu: dict[str, list[float]] = {"lean": [], "aiohttp": []}
    for _ in range(rounds):
        for client in cpu:
            cpu[client].append(uvloop.run(client_round(state, client, n, 8)))
    print(f"load average after: {load_average()}")
    med = {k: statistics.median(v) for k, v in cpu.items()}
    for client, values in cpu.items():
        print(f"{client:8s} upstream client CPU {med[client]:.3f} ms/req   rounds: "
              + " ".join(f"{v:.3f}" for v in values))
    print(f"lean / aiohttp x{med['lean'] / med['aiohttp']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--client-only", action="store_true", help="the upstream client alone, in this process")
    args = ap.parse_args()
    if args.client_only:
        client_only(args.state_dir, args.rounds, args.requests)
        return
    env = Env(args.state_dir, Path(tempfile.mkdtemp(prefix="gk-bench-upstream-")))
    env.make_token()
    try:
        targets = {"lean": start_gatekeeper(env, "lean"), "aiohttp": start_gatekeeper(env, "aiohttp"),
                   "haproxy": env.start_haproxy(nbthread=1, name="hap-t1")}
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
        hap = med["haproxy"]
        print(f"CPU per request vs HAProxy: lean x{med['lean'] / hap:.1f}, aiohttp x{med['aiohttp'] / hap:.1f}; "
              f"lean / aiohttp x{med['lean'] / med['aiohttp']:.2f}")
        print(f"req/s vs HAProxy: lean x{statistics.median(rps['lean']) / statistics.median(rps['haproxy']):.2f}, "
              f"aiohttp x{statistics.median(rps['aiohttp']) / statistics.median(rps['haproxy']):.2f}")
    finally:
        env.stop()


if __name__ == "__main__":
    main()
