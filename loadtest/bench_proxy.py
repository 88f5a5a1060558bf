"""Benchmark: gatekeeper proxy beside Caddy and HAProxy in front of the same sandbox apiservers.

Not a test: it prints figures and ratios measured in one run on one machine.

    gatekeeper sandbox up --state-dir /tmp/bench --apiservers 3
    python -m loadtest bench proxy --state-dir /tmp/bench
    gatekeeper sandbox down --state-dir /tmp/bench

Needs Debian's ``haproxy`` and ``nghttp2-client`` (h2load), and Go for Caddy v2.11.9 (built from
``gatekeeper/sandbox/gomod/caddy`` on first use, then cached with the sandbox's binaries). The parts:

1. **Small GET throughput and latency**: h2load (HTTP/2, bearer token, because h2load
   cannot present client certificates) against one apiserver directly (the reference),
   gatekeeper, HAProxy TCP and HAProxy HTTP. p50/p99 from h2load's per-request log.
2. **Memory while streaming a big LIST** (>= 200 MB of ConfigMaps): peak RSS growth of
   the proxy process during the LIST, gatekeeper vs HAProxy.
3. **Per-backend share after a backend restarts** (the seeds' skew): long-lived HTTP/2
   clients keep issuing GETs; apiserver 3 is killed and restarted; the share of requests
   it serves in the following window is read from every apiserver's own
   ``apiserver_request_total``. A connection balancer leaves it idle; per-request
   balancing gives it its third back.

4. **Open loop, closed loop, CPU per request, against Caddy** (``--only-modes`` runs just this;
   :mod:`loadtest.bench.rates`): in each of ``--rounds`` interleaved rounds, gatekeeper ``--workers N``,
   Caddy ``GOMAXPROCS=N`` and HAProxy ``nbthread N`` (``--compare-workers 1,2``) at each fixed rate
   (``--rates 200,600``) and in a closed loop, each with p50/p99 and the proxy's CPU per request
   (utime+stime of its processes from /proc); ratios to Caddy, medians over rounds; throughput by
   gatekeeper worker count (``--workers-table 1,2,3``). Gatekeeper runs with the flow-control policy
   ``sandbox up --with-proxy`` deploys; Caddy and HAProxy with TLS on both sides and HTTP/2 to the clients.

5. **Scaling with workers, the proxy as the bottleneck** (``--static-scaling``): on a small
   machine the apiservers and h2load take most of the cores, so throughput cannot grow
   with workers there. This mode puts three static backends (one HAProxy answering every
   request with a fixed Namespace-sized JSON, TLS, no apiserver work) behind gatekeeper
   and HAProxy HTTP, and runs the closed loop with ``--workers 1..N`` beside ``nbthread
   1..N``, printing the machine's busy share during each run.

Restarting apiserver 3 updates sandbox.json, so ``sandbox down`` still stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import tempfile
import time
from pathlib import Path

import httpx

from gatekeeper.sandbox import processes
from loadtest.bench import rates
from loadtest.bench.proxies import Env, h2load, wait_ok

BIG_NS = "gk-bench-big"


# --- 2. big LIST memory -------------------------------------------------------------------------

async def ensure_big_list(env: Env, target_mb: int) -> int:
    ns_url = f"{env.backends[0]}/api/v1/namespaces"
    async with httpx.AsyncClient(verify=env.admin_tls(), timeout=120) as c:
        await c.post(ns_url, json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": BIG_NS}})
        have = (await c.get(f"{ns_url}/{BIG_NS}/configmaps?limit=500", headers={"accept-encoding": "identity"}))
        existing = len(have.json().get("items", []))
        want = target_mb + 10
        value = "x" * 1_000_000
        sem = asyncio.Semaphore(4)

        async def make(i: int) -> None:
            async with sem:
                r = await c.post(f"{ns_url}/{BIG_NS}/configmaps", json={
                    "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"big-{i:04d}"},
                    "data": {"v": value}})
                if r.status_code not in (201, 409):
                    raise SystemExit(f"creating configmap big-{i}: {r.status_code} {r.text[:200]}")

        await asyncio.gather(*(make(i) for i in range(existing, want)))
        return want


async def stream_list(env: Env, base: str, pid: int) -> tuple[int, int, int, float]:
    """Read the whole LIST through ``base``; returns (bytes, idle RSS KiB, peak RSS KiB, seconds)."""
    idle = processes.rss_kib(pid) or 0
    peak = idle
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, processes.rss_kib(pid) or 0)
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    total = 0
    t0 = time.monotonic()
    async with httpx.AsyncClient(verify=env.token_tls(), http2=True, timeout=httpx.Timeout(30, read=300)) as c:
        async with c.stream("GET", f"{base}/api/v1/namespaces/{BIG_NS}/configmaps", headers={
                "authorization": f"Bearer {env.token}", "accept": "application/json",
                "accept-encoding": "identity"}) as r:
            if r.status_code != 200:
                raise SystemExit(f"LIST through {base}: {r.status_code} {(await r.aread())[:300]!r}")
            async for chunk in r.aiter_raw():
                total += len(chunk)
    done.set()
    await sampler
    return total, idle, peak, time.monotonic() - t0


# --- 3. share after restart ---------------------------------------------------------------------

def apiserver_get_counts(env: Env) -> list[float]:
    out = []
    for url in env.backends:
        try:
            text = httpx.get(f"{url}/metrics", verify=env.admin_tls(), timeout=10).text
        except httpx.HTTPError:
            out.append(0.0)
            continue
        total = 0.0
        for m in re.finditer(r'^apiserver_request_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
            labels = m.group(1)
            if 'resource="namespaces"' in labels and 'verb="GET"' in labels:
                total += float(m.group(2))
        out.append(total)
    return out


def restart_apiserver(env: Env, index: int, down_seconds: float) -> None:
    """SIGKILL apiserver ``index`` (0-based), keep it down, start it again from its recorded command."""
    rec = [p for p in env.state.processes if p.name.startswith("kube-apiserver")][index]
    try:
        os.killpg(rec.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 10
    while processes.is_alive(rec.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(down_seconds)  # long enough for every client to notice and move to a survivor
    new = processes.start(rec.name, rec.cmd, Path(rec.log), env=rec.env, ports=rec.ports, urls=rec.urls,
                          health=rec.health, cwd=Path(env.state.dir))
    rec.pid = new.pid
    env.state.save()
    wait_ok(f"{env.backends[index]}/readyz", env.admin_tls())


async def share_after_restart(
    env: Env, base: str, clients: int, window: float, down_seconds: float,
) -> tuple[list[float], int]:
    errors = 0
    stop = asyncio.Event()

    async def client_loop() -> None:
        nonlocal errors
        async with httpx.AsyncClient(verify=env.token_tls(), http2=True, timeout=10,
                                     headers={"authorization": f"Bearer {env.token}"}) as c:
            while not stop.is_set():
                try:
                    r = await c.get(f"{base}/api/v1/namespaces/default")
                    if r.status_code != 200:
                        errors += 1
                except httpx.HTTPError:
                    errors += 1
                    await asyncio.sleep(0.1)
                await asyncio.sleep(0.02)

    tasks = [asyncio.create_task(client_loop()) for _ in range(clients)]
    await asyncio.sleep(3)
    await asyncio.to_thread(restart_apiserver, env, 2, down_seconds)
    await asyncio.sleep(2)
    before = await asyncio.to_thread(apiserver_get_counts, env)
    await asyncio.sleep(window)
    after = await asyncio.to_thread(apiserver_get_counts, env)
    stop.set()
    await asyncio.gather(*tasks)
    delta = [a - b for a, b in zip(after, before, strict=True)]
    total = sum(delta) or 1.0
    return [d / total for d in delta], errors


# --- 4. open loop, closed loop, CPU per request, workers ----------------------------------------

# --- main ---------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", required=True, help="a running sandbox with >= 3 apiservers")
    ap.add_argument("--requests", type=int, default=4000, help="h2load requests per target")
    ap.add_argument("--clients", type=int, default=8, help="h2load connections")
    ap.add_argument("--streams", type=int, default=8, help="h2load concurrent streams per connection")
    ap.add_argument("--list-mb", type=int, default=200, help="size of the big LIST in MB (>= 200)")
    ap.add_argument("--share-clients", type=int, default=12, help="long-lived clients in the restart scenario")
    ap.add_argument("--share-window", type=float, default=10.0, help="seconds measured after the restart")
    ap.add_argument("--down-seconds", type=float, default=8.0, help="how long apiserver 3 stays down")
    ap.add_argument("--skip", action="append", default=[],
                    choices=["throughput", "memory", "share", "rates", "closed"])
    ap.add_argument("--only-modes", action="store_true",
                    help="run only the open-loop / closed-loop / workers comparison (skip parts 1-3)")
    ap.add_argument("--rates", type=lambda v: [int(x) for x in v.split(",")], default=[200, 600],
                    help="open-loop rates in req/s (comma-separated)")
    ap.add_argument("--rate-seconds", type=float, default=10.0, help="seconds per open-loop rate")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds of the rate and closed-loop comparisons; ratios are medians over rounds")
    ap.add_argument("--compare-workers", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2],
                    help="worker counts compared with Caddy GOMAXPROCS=N and HAProxy nbthread N (comma-separated)")
    ap.add_argument("--workers-table", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2],
                    help="gatekeeper worker counts for the closed-loop table (1 and 2 always run)")
    ap.add_argument("--static-scaling", action="store_true",
                    help="run only the scaling table with static backends (the proxy as the bottleneck)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gk-bench-"))
    env = Env(args.state_dir, work)
    env.make_token()
    try:
        if args.static_scaling:
            rates.static_scaling(env, args)
            return
        if args.only_modes:
            rates.modes(env, args)
            return
        env.start_gatekeeper()
        env.start_haproxy()
        targets = {"direct": env.backends[0], "gatekeeper": env.gk_url, "haproxy-tcp": env.hap_tcp_url,
                   "haproxy-http": env.hap_http_url}
        if "throughput" not in args.skip:
            print(f"\n== small GET: h2load -n {args.requests} -c {args.clients} -m {args.streams} ==")
            res = {}
            for name, url in targets.items():
                h2load(env, url, max(200, args.requests // 10), args.clients, args.streams)  # warm-up
                res[name] = h2load(env, url, args.requests, args.clients, args.streams)
                r = res[name]
                print(f"{name:13s} {r['rps']:8.0f} req/s  p50 {r['p50']:7.2f} ms  p99 {r['p99']:7.2f} ms  "
                      f"2xx {r['ok2xx']:.0f} failed {r['failed']:.0f}")
            for ref in ("direct", "haproxy-tcp", "haproxy-http"):
                g, o = res["gatekeeper"], res[ref]
                print(f"gatekeeper / {ref:12s}: throughput x{g['rps'] / o['rps']:.2f}, "
                      f"p50 x{g['p50'] / o['p50']:.2f}, p99 x{g['p99'] / o['p99']:.2f}")
        if "memory" not in args.skip:
            n = asyncio.run(ensure_big_list(env, args.list_mb))
            print(f"\n== proxy RSS while streaming a LIST of {n} x 1 MB ConfigMaps ==")
            mem = {}
            for name, url, pid in (("gatekeeper", env.gk_url, env.gk_pid),
                                   ("haproxy-http", env.hap_http_url, env.hap_pid),
                                   ("haproxy-tcp", env.hap_tcp_url, env.hap_pid)):
                size, idle, peak, secs = asyncio.run(stream_list(env, url, pid))
                mem[name] = (size, idle, peak)
                print(f"{name:13s} {size / 1e6:7.1f} MB in {secs:5.1f} s  RSS idle {idle / 1024:6.1f} MiB  "
                      f"peak {peak / 1024:6.1f} MiB  growth {(peak - idle) / 1024:6.1f} MiB "
                      f"({(peak - idle) * 1024 / size:.3%} of the body)")
            gsize, gidle, gpeak = mem["gatekeeper"]
            hpeak = mem["haproxy-http"][2]
            print(f"gatekeeper RSS growth / body size: {(gpeak - gidle) * 1024 / gsize:.4f}; "
                  f"gatekeeper peak RSS / haproxy peak RSS: x{gpeak / max(hpeak, 1):.2f}")
        if "share" not in args.skip:
            print(f"\n== share of apiserver 3 after it was down {args.down_seconds:.0f} s and came back "
                  f"({args.share_clients} long-lived h2 clients, {args.share_window:.0f} s window; even = 33%) ==")
            for name in ("gatekeeper", "haproxy-tcp", "haproxy-http"):
                shares, errors = asyncio.run(share_after_restart(env, targets[name], args.share_clients,
                                                                 args.share_window, args.down_seconds))
                print(f"{name:13s} shares " + " ".join(f"{s:5.1%}" for s in shares)
                      + f"   apiserver-3 / even: x{shares[2] * 3:.2f}   client errors: {errors}")
        if not {"rates", "closed"} <= set(args.skip):
            rates.modes(env, args)
    finally:
        env.stop()
        print(f"\n(logs and configs in {work}; p50/p99 from h2load --log-file; "
              "ratios are gatekeeper divided by the reference)")


if __name__ == "__main__":
    main()
