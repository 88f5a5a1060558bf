"""Benchmark: gatekeeper proxy beside HAProxy (TCP and HTTP mode) in front of the same sandbox apiservers.

Not a test: it prints figures and ratios measured in one run on one machine.

    gatekeeper sandbox up --state-dir /tmp/bench --apiservers 3
    python loadtest/bench_proxy.py --state-dir /tmp/bench
    gatekeeper sandbox down --state-dir /tmp/bench

Needs Debian's ``haproxy`` and ``nghttp2-client`` (h2load). Three parts:

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

4. **Open loop, closed loop, CPU per request, workers** (``--only-modes`` runs just this):
   fixed rates (``--rates 200,600``) with p50/p99; closed loop with the proxy's CPU per
   request (utime+stime of the proxy and its workers from /proc); ``--workers 1`` beside
   HAProxy ``nbthread 1`` and ``--workers 2`` beside ``nbthread 2``; throughput by worker
   count (``--workers-table 1,2,3``). Gatekeeper runs with the flow-control policy
   ``sandbox up --with-proxy`` deploys; HAProxy in HTTP mode with TLS on both sides.

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
import json
import os
import re
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, TypeVar

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "flowcontrol"))
import storm_kit as kit

from gatekeeper.certs import PKI
from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess

BIG_NS = "gk-bench-big"


def sh(*argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=True, **kw)


class Env:
    """The sandbox, the two proxies under test, a token and TLS material."""

    def __init__(self, state_dir: str, work: Path) -> None:
        self.state = SandboxState.load(state_dir)
        self.work = work
        self.certs = Path(self.state.certs_dir)
        self.kubectl = str(self.state.extra.get("kubectl") or "kubectl")
        self.backends = list(self.state.apiserver_urls)
        if len(self.backends) < 3:
            sys.exit("the benchmark needs a sandbox with at least 3 apiservers (--apiservers 3)")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.gk_url = self.hap_tcp_url = self.hap_http_url = ""
        self.gk_pid = self.hap_pid = 0
        self.gk_metrics: dict[str, str] = {}
        """Each gatekeeper's metrics listener (``GET /workers``), by its URL."""
        self.token = ""

    def admin_tls(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.certs / "ca.crt"))
        ctx.load_cert_chain(str(self.certs / "admin.crt"), str(self.certs / "admin.key"))
        return ctx

    def token_tls(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.certs / "ca.crt"))

    def make_token(self) -> None:
        kc = self.state.kubeconfig
        subprocess.run([self.kubectl, "--kubeconfig", kc, "create", "serviceaccount", "gk-bench"], capture_output=True)
        subprocess.run([self.kubectl, "--kubeconfig", kc, "create", "clusterrolebinding", "gk-bench",
                        "--clusterrole=cluster-admin", "--serviceaccount=default:gk-bench"], capture_output=True)
        self.token = sh(self.kubectl, "--kubeconfig", kc, "create", "token", "gk-bench", "--duration=2h").stdout.strip()
        # The proxy identity's RBAC, as `sandbox up --with-proxy` applies it: without it the proxy cannot
        # fetch the issuer's keys and classifies every token on its cold path (not the deployed cost).
        from gatekeeper.sandbox.with_proxy import IDENTITY_RBAC

        subprocess.run([self.kubectl, "--kubeconfig", kc, "apply", "-f", "-"], input=IDENTITY_RBAC.read_text(),
                       capture_output=True, text=True)

    def start_gatekeeper(self, name: str = "bench-proxy", workers: int | None = None,
                         deployed_flow_control: bool = False,
                         backends: list[str] | None = None) -> tuple[str, int]:
        """A gatekeeper proxy; ``deployed_flow_control`` gives it the policy ``sandbox up --with-proxy`` deploys."""
        flow: dict[str, Any] = {"enabled": False}
        if deployed_flow_control:
            from gatekeeper.sandbox.with_proxy import default_flow_control

            flow = default_flow_control() or {}
        work = self.work / name
        work.mkdir(exist_ok=True)
        user: dict[str, Any] = {"flowControl": flow}
        gk = ProxyProcess(self.state, work, name=name, health_interval=0.5, user_config=user,
                          workers=workers if workers is not None else 1, backends=backends)
        try:
            gk.start(timeout=120)
        finally:
            if gk.proc is not None:
                self.procs.append(gk.proc)  # stop() ends it even if it never became ready
        assert gk.proc is not None
        if name == "bench-proxy":
            self.gk_pid, self.gk_url = gk.proc.pid, gk.url
        self.gk_metrics[gk.url] = gk.metrics_url
        return gk.url, gk.proc.pid

    def start_haproxy(self, nbthread: int = 1, name: str = "haproxy",
                      backends: list[str] | None = None) -> tuple[str, int]:
        """HAProxy with ``nbthread`` threads; returns (HTTP-mode URL, pid)."""
        pki = PKI(self.certs)
        serving = pki.issue_serving(f"bench-{name}", dns=["localhost"], ips=["127.0.0.1"])
        pem = self.work / f"{name}-serving.pem"
        pem.write_bytes(serving.cert.read_bytes() + serving.key.read_bytes())
        fp = self.work / "front-proxy.pem"
        fp.write_bytes((self.certs / "front-proxy-client.crt").read_bytes()
                       + (self.certs / "front-proxy-client.key").read_bytes())
        tcp, http = processes.free_port(), processes.free_port()
        ca = self.certs / "ca.crt"
        servers = [re.sub(r"^https://", "", u) for u in backends or self.backends]
        cfg = [
            "global", "  maxconn 4000", f"  nbthread {nbthread}", "defaults", "  timeout connect 5s",
            "  timeout client 1h", "  timeout server 1h", "  timeout tunnel 1h",
            "frontend ft_tcp", "  mode tcp", f"  bind 127.0.0.1:{tcp}", "  default_backend bk_tcp",
            "backend bk_tcp", "  mode tcp", "  balance leastconn",
            *[f"  server a{i} {s} check inter 500ms fall 2 rise 1" for i, s in enumerate(servers, 1)],
            "frontend ft_http", "  mode http",
            f"  bind 127.0.0.1:{http} ssl crt {pem} ca-file {ca} verify optional alpn h2,http/1.1",
            "  http-request del-header X-Remote-User", "  http-request del-header X-Remote-Group",
            "  http-request set-header X-Remote-User %[ssl_c_s_dn(CN)] if { ssl_c_used } { ssl_c_verify 0 }",
            "  http-request set-header X-Remote-Group %[ssl_c_s_dn(O)] if { ssl_c_used } { ssl_c_verify 0 }",
            "  default_backend bk_http",
            "backend bk_http", "  mode http", "  balance leastconn", "  http-reuse safe",
            *[f"  server h{i} {s} ssl verify required ca-file {ca} crt {fp} check inter 500ms fall 2 rise 1"
              for i, s in enumerate(servers, 1)],
        ]
        path = self.work / f"{name}.cfg"
        path.write_text("\n".join(cfg) + "\n")
        log = (self.work / f"{name}.log").open("ab")
        proc = subprocess.Popen(["haproxy", "-db", "-f", str(path)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        if name == "haproxy":
            self.hap_pid = proc.pid
            self.hap_tcp_url, self.hap_http_url = f"https://127.0.0.1:{tcp}", f"https://127.0.0.1:{http}"
        time.sleep(1.5)
        if proc.poll() is not None:
            sys.exit(f"haproxy failed: {(self.work / f'{name}.log').read_text()[-2000:]}")
        return f"https://127.0.0.1:{http}", proc.pid

    def start_static_backends(self, count: int = 3, nbthread: int = 1) -> list[str]:
        """One HAProxy answering every request on ``count`` TLS ports with a fixed JSON body.

        A stand-in for apiservers that costs next to no CPU, so that the proxy in front is
        what limits throughput (the scaling table); the body is the size of a Namespace GET.
        """
        pki = PKI(self.certs)
        serving = pki.issue_serving("bench-static", dns=["localhost"], ips=["127.0.0.1"])
        pem = self.work / "static-serving.pem"
        pem.write_bytes(serving.cert.read_bytes() + serving.key.read_bytes())
        ports = [processes.free_port() for _ in range(count)]
        body = ('{"kind":"Namespace","apiVersion":"v1","metadata":{"name":"default","uid":'
                '"8d0c8f2e-0000-4000-8000-000000000000","resourceVersion":"42","creationTimestamp":'
                '"2026-12-01T00:00:00Z","labels":{"kubernetes.io/metadata.name":"default"}},'
                '"spec":{"finalizers":["kubernetes"]},"status":{"phase":"Active"}}')
        cfg = ["global", "  maxconn 4000", f"  nbthread {nbthread}", "defaults", "  mode http",
               "  timeout connect 5s", "  timeout client 1h", "  timeout server 1h"]
        for i, port in enumerate(ports):
            cfg += [f"frontend static{i}", f"  bind 127.0.0.1:{port} ssl crt {pem} alpn http/1.1",
                    f"  http-request return status 200 content-type application/json string '{body}'"]
        path = self.work / "static.cfg"
        path.write_text("\n".join(cfg) + "\n")
        log = (self.work / "static.log").open("ab")
        proc = subprocess.Popen(["haproxy", "-db", "-f", str(path)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        time.sleep(1.0)
        if proc.poll() is not None:
            sys.exit(f"static haproxy failed: {(self.work / 'static.log').read_text()[-2000:]}")
        return [f"https://127.0.0.1:{p}" for p in ports]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                p.kill()


def wait_ok(url: str, ctx: ssl.SSLContext | None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, verify=ctx or True, timeout=3).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} not ready after {timeout}s")


# --- 1. throughput ------------------------------------------------------------------------------

def h2load(env: Env, base: str, n: int, clients: int, streams: int, rps: int = 0) -> dict[str, float]:
    log = Path(tempfile.mktemp(dir=env.work, suffix=".h2load"))
    rate = [f"--rps={rps}"] if rps else []
    out = sh("h2load", *rate, "-n", str(n), "-c", str(clients), "-m", str(streams), "-H",
             f"authorization: Bearer {env.token}", "-H", "accept: application/json",
             f"--log-file={log}", f"{base}/api/v1/namespaces/default").stdout
    m = re.search(r"finished in ([\d.]+)(m?s), ([\d.]+) req/s", out)
    ok = re.search(r"requests: .* (\d+) succeeded, (\d+) failed", out)
    status = re.search(r"status codes: (\d+) 2xx", out)
    lat = sorted(int(line.split("\t")[2]) / 1000 for line in log.read_text().splitlines() if line.strip())
    if not m or not lat:
        raise SystemExit(f"h2load output not understood:\n{out}")
    return {"rps": float(m.group(3)), "p50": lat[len(lat) // 2], "p99": lat[int(len(lat) * 0.99) - 1],
            "ok2xx": float(status.group(1)) if status else 0.0, "failed": float(ok.group(2)) if ok else -1}


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

def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants (the proxy's supervisor and workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of ``pids`` from /proc/PID/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def open_loop(env: Env, base: str, rate: int, seconds: float, clients: int = 4) -> dict[str, float]:
    """``rate`` req/s for ``seconds`` (h2load --rps per client), p50/p99 of the requests' latency."""
    return h2load(env, base, int(rate * seconds), clients, 8, rps=max(1, rate // clients))


def worker_requests(metrics_url: str) -> list[float]:
    """Requests each worker of a gatekeeper has served so far (its private page), in worker order; empty for
    a single process (``--workers 1`` has no supervisor and no ``/workers``)."""
    try:
        with urllib.request.urlopen(f"{metrics_url}/workers", timeout=5) as resp:
            workers = json.load(resp)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return []
        raise
    out = []
    for w in workers:
        page = ""
        if w.get("metricsUrl"):
            with urllib.request.urlopen(f"{w['metricsUrl']}/metrics/worker", timeout=5) as resp:
                page = resp.read().decode()
        out.append(kit.metric_sum(page, "gatekeeper_proxy_requests_total"))
    return out


def closed_loop(env: Env, base: str, pid: int, n: int, clients: int, streams: int) -> dict[str, float]:
    """Closed loop plus the proxy's CPU (all its processes) per request, the CPU the apiservers and etcd
    behind it spent per request (``behind_ms``: on a machine they share, the proxy's protocol toward them
    costs throughput too), and for gatekeeper with several
    workers how the requests split over them (SO_REUSEPORT hashes each connection to a worker; a closed
    loop runs at the speed of the busiest)."""
    pids = tree_pids(pid)
    sandbox = [p.pid for p in env.state.processes if p.pid]  # the apiservers and etcd behind every proxy
    metrics = env.gk_metrics.get(base)
    split0 = worker_requests(metrics) if metrics else []
    cpu0, behind0 = cpu_seconds(pids), cpu_seconds(sandbox)
    r = h2load(env, base, n, clients, streams)
    r["cpu_ms"] = (cpu_seconds(pids) - cpu0) * 1000 / max(1.0, r["ok2xx"])
    r["behind_ms"] = (cpu_seconds(sandbox) - behind0) * 1000 / max(1.0, r["ok2xx"])
    if len(split0) > 1 and metrics:
        split = [b - a for a, b in zip(split0, worker_requests(metrics), strict=True)]
        r["busiest_share"] = max(split) / max(1.0, sum(split))
    return r


Target = tuple[str, int]
"""A proxy under test: its URL and the pid of its process (the supervisor's with several workers)."""
G = TypeVar("G")
H = TypeVar("H")


def start_warm(env: Env, gatekeepers: dict[G, dict[str, Any]], haproxies: dict[H, dict[str, Any]],
               backends: list[str] | None = None) -> tuple[dict[G, Target], dict[H, Target]]:
    """Start the proxies a comparison needs, then warm each up, so that no measured round pays for
    connections, pools and caches.

    One gatekeeper per entry of ``gatekeepers`` (its keyword arguments for :meth:`Env.start_gatekeeper`),
    with the flow-control policy ``sandbox up --with-proxy`` deploys, and one HAProxy per entry of
    ``haproxies`` (for :meth:`Env.start_haproxy`), all in front of ``backends`` (default: the sandbox's
    apiservers); the results are keyed as the arguments are."""
    gk = {key: env.start_gatekeeper(deployed_flow_control=True, backends=backends, **kw)
          for key, kw in gatekeepers.items()}
    hap = {key: env.start_haproxy(backends=backends, **kw) for key, kw in haproxies.items()}
    for url, _ in [*gk.values(), *hap.values()]:
        h2load(env, url, 400, 4, 4)
    return gk, hap


def spread(ratios: list[float]) -> str:
    """A ratio over rounds: the median, and every round when there are several."""
    if len(ratios) == 1:
        return f"x{ratios[0]:.2f}"
    return f"x{statistics.median(ratios):.2f} (rounds {', '.join(f'{r:.2f}' for r in ratios)})"


def modes(env: Env, args: argparse.Namespace) -> None:
    """Open loop at fixed rates, closed loop with CPU per request, and throughput by worker count,
    each beside HAProxy HTTP mode (same TLS on both sides) in the same run, flow control as deployed.

    With ``--rounds R`` every comparison runs R times, gatekeeper and HAProxy back to back in each
    round, and a ratio is the median of the rounds' ratios: on a shared 2-core machine one round's
    ratio moves by 30% with what else runs, and both arms of a round see the same machine."""
    counts = sorted({1, 2, *args.workers_table})
    rounds = max(1, args.rounds)
    gk, hap = start_warm(env, {w: {"name": f"gk-w{w}", "workers": w} for w in counts},
                         {t: {"nbthread": t, "name": f"hap-t{t}"} for t in (1, 2)})
    print(f"\nload average before: {load_average()}; {rounds} interleaved round(s)")
    if "rates" not in args.skip:
        print(f"\n== open loop: fixed rates, {args.rate_seconds:.0f} s each (h2load --rps, 4 connections) ==")
        for rate in args.rates:
            for w, t in ((1, 1), (2, 2)):
                gs, hs = [], []
                for _ in range(rounds):
                    gs.append(open_loop(env, gk[w][0], rate, args.rate_seconds))
                    hs.append(open_loop(env, hap[t][0], rate, args.rate_seconds))
                g50, g99 = statistics.median([g["p50"] for g in gs]), statistics.median([g["p99"] for g in gs])
                h50, h99 = statistics.median([h["p50"] for h in hs]), statistics.median([h["p99"] for h in hs])
                print(f"{rate:4d} req/s  gatekeeper --workers {w}: p50 {g50:6.2f} p99 {g99:6.2f} ms | "
                      f"haproxy nbthread {t}: p50 {h50:6.2f} p99 {h99:6.2f} ms | "
                      f"ratio p50 {spread([g['p50'] / h['p50'] for g, h in zip(gs, hs, strict=True)])} "
                      f"p99 {spread([g['p99'] / h['p99'] for g, h in zip(gs, hs, strict=True)])}")
    if "closed" not in args.skip:
        n, c, m = args.requests, args.clients, args.streams
        print(f"\n== closed loop: h2load -n {n} -c {c} -m {m}; proxy CPU per request from /proc ==")
        runs: dict[str, list[dict[str, float]]] = {}
        for _ in range(rounds):
            for w in counts:
                runs.setdefault(f"gk{w}", []).append(closed_loop(env, gk[w][0], gk[w][1], n, c, m))
            for t in (1, 2):
                runs.setdefault(f"hap{t}", []).append(closed_loop(env, hap[t][0], hap[t][1], n, c, m))
        for key, rs in runs.items():
            label = f"gatekeeper --workers {key[2:]}" if key.startswith("gk") else f"haproxy nbthread {key[3:]}"
            shares = [r["busiest_share"] for r in rs if "busiest_share" in r]
            share = f"  busiest worker {statistics.median(shares):.0%} of requests" if shares else ""
            med = {k: statistics.median([r[k] for r in rs]) for k in ("rps", "p50", "p99", "cpu_ms", "behind_ms")}
            print(f"{label:24s} {med['rps']:7.0f} req/s  p50 {med['p50']:6.2f} p99 {med['p99']:6.2f} ms  "
                  f"CPU {med['cpu_ms']:.3f} ms/req (apiservers+etcd {med['behind_ms']:.3f})  "
                  f"failed {sum(r['failed'] for r in rs):.0f}{share}")
        for w, t in ((1, 1), (2, 2)):
            pairs = list(zip(runs[f"gk{w}"], runs[f"hap{t}"], strict=True))
            print(f"workers {w} / nbthread {t}: throughput {spread([g['rps'] / h['rps'] for g, h in pairs])}, "
                  f"CPU per request {spread([g['cpu_ms'] / max(h['cpu_ms'], 1e-6) for g, h in pairs])}, "
                  f"p50 {spread([g['p50'] / h['p50'] for g, h in pairs])}, apiservers+etcd CPU per request "
                  f"{spread([g['behind_ms'] / max(h['behind_ms'], 1e-6) for g, h in pairs])}")
        print("throughput by workers: " + ", ".join(
            f"{w}: {spread([g['rps'] / b['rps'] for g, b in zip(runs[f'gk{w}'], runs['gk1'], strict=True)])}"
            for w in counts))
    print(f"load average after: {load_average()}")


def cpu_ticks() -> tuple[int, int]:
    """(all ticks, idle + iowait ticks) since boot, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values), values[3] + values[4]


def static_scaling(env: Env, args: argparse.Namespace) -> None:
    """Closed loop by worker count with the proxy as the bottleneck (static backends)."""
    counts = sorted({1, 2, *args.workers_table})
    static = env.start_static_backends(3)
    gk, hap = start_warm(env, {w: {"name": f"gk-static-w{w}", "workers": w} for w in counts},
                         {t: {"nbthread": t, "name": f"hap-static-t{t}"} for t in counts}, backends=static)
    n, c, m = args.requests, args.clients, args.streams
    print(f"\n== scaling, static backends: h2load -n {n} -c {c} -m {m}; load average {load_average()} ==")
    res: dict[str, dict[str, float]] = {}
    for key, (url, pid) in [*((f"gk{w}", gk[w]) for w in counts), *((f"hap{t}", hap[t]) for t in counts)]:
        t0, i0 = cpu_ticks()
        r = closed_loop(env, url, pid, n, c, m)
        t1, i1 = cpu_ticks()
        r["busy"] = 1 - (i1 - i0) / max(1, t1 - t0)
        res[key] = r
        label = f"gatekeeper --workers {key[2:]}" if key.startswith("gk") else f"haproxy nbthread {key[3:]}"
        print(f"{label:24s} {r['rps']:7.0f} req/s  p50 {r['p50']:6.2f} ms  CPU {r['cpu_ms']:.3f} ms/req  "
              f"machine busy {r['busy']:.0%}  failed {r['failed']:.0f}")
    for w in counts:
        g, h = res[f"gk{w}"], res[f"hap{w}"]
        print(f"workers {w} / nbthread {w}: throughput x{g['rps'] / h['rps']:.2f}, "
              f"CPU per request x{g['cpu_ms'] / max(h['cpu_ms'], 1e-6):.1f}")
    print("throughput by workers: " + ", ".join(f"{w}: x{res[f'gk{w}']['rps'] / res['gk1']['rps']:.2f}"
                                                for w in counts))
    print(f"load average after: {load_average()}")


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
    ap.add_argument("--rounds", type=int, default=1,
                    help="--only-modes: interleaved rounds of every comparison; ratios are medians over rounds")
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
            static_scaling(env, args)
            return
        if args.only_modes:
            modes(env, args)
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
            modes(env, args)
    finally:
        env.stop()
        print(f"\n(logs and configs in {work}; p50/p99 from h2load --log-file; "
              "ratios are gatekeeper divided by the reference)")


if __name__ == "__main__":
    main()
