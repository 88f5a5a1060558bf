"""The proxies the benchmarks compare, in front of one sandbox, and the h2load and /proc readings they share.

:class:`Env` starts gatekeeper (as ``sandbox up --with-proxy`` deploys it, or with flow control off), HAProxy
(HTTP mode, TLS both sides) and Caddy (:mod:`loadtest.bench.caddy`) in front of the sandbox's apiservers or of
static backends, and stops them all; :func:`h2load` runs one load and reads its per-request log;
:func:`cpu_seconds` and :func:`tree_pids` give a proxy's CPU from /proc.
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, TypeVar

import httpx

from gatekeeper.certs.pki import PKI
from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess, metric_sum
from loadtest.bench.caddy import start_caddy


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

    def start_caddy(self, procs: int = 1, name: str = "caddy", backends: list[str] | None = None) -> tuple[str, int]:
        """Caddy with ``GOMAXPROCS=procs`` (built on first use); returns (URL, pid)."""
        return start_caddy(self.certs, self.work, backends or self.backends, procs, name, self.procs)

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
        out.append(metric_sum(page, "gatekeeper_proxy_requests_total"))
    return out


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

