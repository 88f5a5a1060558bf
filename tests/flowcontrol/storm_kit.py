"""LIST-storm tooling against the sandbox apiservers (integration test and loadtest/bench_list_storm.py).

* big Secrets written straight to an apiserver as ``helm.sh/release.v1``
  (the type the sandbox webhook allows up to 1.5 MiB, as helm release
  Secrets really are the big ones),
* storm users: client certificates from the sandbox CA, RBAC to list Secrets,
  and an apiserver-side FlowSchema/PriorityLevel that only *observes* them, so
  ``apiserver_flowcontrol_current_executing_requests{flow_schema="fc-storm-observe"}``
  counts exactly the storm's LISTs running inside each apiserver,
* a private ``gatekeeper proxy`` process in front of the sandbox apiservers,
* samplers for apiserver metrics and apiserver RSS (/proc).

Everything binds and connects to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from gatekeeper.base.config import _key_of
from gatekeeper.certs.pki import PKI
from gatekeeper.sandbox.pki import FRONT_PROXY_CLIENT, SandboxPKI, kubeconfig
from gatekeeper.sandbox.processes import free_port
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import admin_client, kubectl_binary, metric_sum

STORM_GROUP = "gatekeeper:storm"
OBSERVE = "fc-storm-observe"
REPO = Path(__file__).resolve().parents[2]
SEEDS = REPO / "deploy" / "examples" / "flowcontrol-seeds.yaml"


def kubectl(
    state: SandboxState,
    *args: str,
    kubeconfig_path: str | None = None,
    input: str | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [kubectl_binary(state), "--kubeconfig", kubeconfig_path or state.kubeconfig, *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def big_namespace(state: SandboxState, prefix: str, count: int, size: int) -> Iterator[str]:
    """A fresh namespace of ``count`` Secrets of ``size`` bytes, with the storm RBAC and observer FlowSchema
    applied; both go again afterwards (the namespace without waiting for its Secrets to be deleted)."""
    ns = f"{prefix}-{os.urandom(3).hex()}"
    asyncio.run(create_secrets(state, ns, count, size))
    applied = kubectl(state, "apply", "-f", "-", input=storm_rbac_and_observer())
    if applied.returncode != 0:
        raise RuntimeError(f"storm RBAC: {applied.stderr.strip()}")
    try:
        yield ns
    finally:
        kubectl(state, "delete", "namespace", ns, "--wait=false")
        kubectl(state, "delete", "-f", "-", "--ignore-not-found", input=storm_rbac_and_observer())


async def create_secrets(state: SandboxState, namespace: str, count: int, size: int, concurrency: int = 6) -> list[str]:
    """``count`` Secrets of ``size`` random bytes in ``namespace`` (created if missing); returns names."""
    async with admin_client(state) as c:
        r = await c.post(
            "/api/v1/namespaces",
            json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        )
        if r.status_code not in (201, 409):
            raise RuntimeError(f"create namespace {namespace}: {r.status_code} {r.text[:300]}")
        names = [f"blob-{i:04d}" for i in range(count)]
        sem = asyncio.Semaphore(concurrency)

        async def one(name: str) -> None:
            body = {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "helm.sh/release.v1",
                "metadata": {"name": name},
                "data": {"release": base64.b64encode(os.urandom(size)).decode()},
            }
            async with sem:
                resp = await c.post(f"/api/v1/namespaces/{namespace}/secrets", json=body)
            if resp.status_code not in (201, 409):
                raise RuntimeError(f"create secret {name}: {resp.status_code} {resp.text[:300]}")

        await asyncio.gather(*(one(n) for n in names))
        return names


def storm_rbac_and_observer() -> str:
    """RBAC for the storm group, plus apiserver-side APF objects that only observe (lots of seats)."""
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "fc-storm"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["secrets", "configmaps", "pods"],
                    "verbs": ["get", "list", "watch", "create", "delete"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "fc-storm"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "fc-storm"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": STORM_GROUP}],
        },
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "PriorityLevelConfiguration",
            "metadata": {"name": OBSERVE},
            "spec": {
                "type": "Limited",
                "limited": {
                    "nominalConcurrencyShares": 100,
                    "limitResponse": {
                        "type": "Queue",
                        "queuing": {"queues": 64, "handSize": 6, "queueLengthLimit": 100},
                    },
                },
            },
        },
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "FlowSchema",
            "metadata": {"name": OBSERVE},
            "spec": {
                "matchingPrecedence": 100,
                "priorityLevelConfiguration": {"name": OBSERVE},
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [
                    {
                        "subjects": [{"kind": "Group", "group": {"name": STORM_GROUP}}],
                        "resourceRules": [
                            {
                                "verbs": ["list"],
                                "apiGroups": [""],
                                "resources": ["secrets"],
                                "clusterScope": True,
                                "namespaces": ["*"],
                            }
                        ],
                    }
                ],
            },
        },
    ]
    return yaml.safe_dump_all(docs)


def storm_kubeconfig(state: SandboxState, directory: Path, user: str, server: str) -> Path:
    """A kubeconfig for ``user`` (group gatekeeper:storm) at ``server``."""
    pki = PKI(state.certs_dir)
    issued = pki.issue_client(f"fc-{user}", user=user, groups=[STORM_GROUP])
    path = directory / f"{user}.kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig(server, SandboxPKI(Path(state.certs_dir)).ca, issued.cert, issued.key)))
    path.chmod(0o600)
    return path


def _keys(cls: Any, **values: Any) -> dict[str, Any]:
    """Config keys for a settings dataclass by Python field name (robust to key spelling changes)."""
    by_name = {f.name: _key_of(f) for f in dataclasses.fields(cls)}
    return {by_name[k]: v for k, v in values.items()}


@dataclasses.dataclass
class ProxyProcess:
    """A private ``gatekeeper proxy`` in front of the sandbox apiservers."""

    proc: subprocess.Popen[bytes]
    url: str
    metrics_url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.metrics_url}/metrics", timeout=10) as r:
            return r.read().decode()


@contextlib.contextmanager
def run_proxy(
    state: SandboxState, directory: Path, flow_control: dict[str, Any] | None, *, workers: int | None = None,
    extra: dict[str, Any] | None = None,
) -> Iterator[ProxyProcess]:
    """``extra``: more top-level proxy config sections (e.g. ``{"protocol": {"goawayChance": 0.01}}``)."""
    from gatekeeper.proxy.settings import ListenerSettings, UpstreamSettings

    certs = SandboxPKI(Path(state.certs_dir))
    serving = PKI(state.certs_dir).issue_serving("fc-proxy-serving", dns=["localhost"], ips=["127.0.0.1"])
    port, mport = free_port(), free_port()
    proxy: dict[str, Any] = {
        "listener": _keys(
            ListenerSettings,
            address="127.0.0.1",
            port=port,
            cert_file=str(serving.cert),
            key_file=str(serving.key),
            client_ca_file=str(certs.ca),
            metrics_address="127.0.0.1",
            metrics_port=mport,
        ),
        "backends": [{"url": u, "name": f"apiserver-{i}"} for i, u in enumerate(state.apiserver_urls, 1)],
        "upstream": _keys(
            UpstreamSettings,
            ca_file=str(certs.ca),
            client_cert_file=str(certs.crt(FRONT_PROXY_CLIENT)),
            client_key_file=str(certs.key(FRONT_PROXY_CLIENT)),
        ),
        "flowControl": flow_control if flow_control is not None else {"enabled": False},
        **(extra or {}),
    }
    if workers is not None:
        proxy["workers"] = workers
    directory.mkdir(parents=True, exist_ok=True)
    cfg = directory / "proxy.yaml"
    cfg.write_text(yaml.safe_dump({"proxy": proxy}, sort_keys=False))
    log = directory / "proxy.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gatekeeper", "proxy", "--config", str(cfg)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    pp = ProxyProcess(proc, f"https://127.0.0.1:{port}", f"http://127.0.0.1:{mport}", log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gatekeeper proxy exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{pp.metrics_url}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"gatekeeper proxy not ready after 60s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield pp
    finally:
        pp.stop()


async def apiserver_metrics(state: SandboxState) -> list[str]:
    async def one(url: str) -> str:
        async with admin_client(state, url, timeout=20) as c:
            return (await c.get("/metrics")).text

    return list(await asyncio.gather(*(one(u) for u in state.apiserver_urls)))


APF_DUMP = "/debug/api_priority_and_fairness/dump_priority_levels"


def apf_executing(dump: str, level: str) -> int | None:
    """ExecutingRequests of ``level`` in an apiserver's ``dump_priority_levels`` table (None: not there)."""
    lines = dump.splitlines()
    if not lines:
        return None
    header = [h.strip() for h in lines[0].split(",")]
    if "ExecutingRequests" not in header:
        return None
    column = header.index("ExecutingRequests")
    for line in lines[1:]:
        cells = [c.strip() for c in line.split(",")]
        if cells and cells[0] == level and len(cells) > column:
            return int(cells[column])
    return None


class ApiserverSampler:
    """Samples, per apiserver, the storm's executing LISTs (apiserver APF gauge) and RSS, until stopped."""

    def __init__(self, state: SandboxState, interval: float = 0.25) -> None:
        self.state = state
        self.interval = interval
        self.max_executing_per_backend: list[float] = [0.0] * len(state.apiserver_urls)
        self.totals: list[int] = []
        """The storm's executing LISTs summed over the apiservers, per sample."""
        self.peak_rss_total = 0
        self.peak_heap_total = 0.0
        """Peak of the sum over apiservers of go_memstats_heap_alloc_bytes (live + not yet swept)."""
        self.samples = 0
        self._stop = asyncio.Event()
        self.pids = [p.pid for p in state.processes if p.name.startswith("kube-apiserver")]

    def rss_total(self) -> int:
        total = 0
        for pid in self.pids:
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total

    async def run(self, with_metrics: bool = True, with_heap: bool = True) -> None:
        clients = [admin_client(self.state, u, timeout=20) for u in self.state.apiserver_urls]
        try:
            while not self._stop.is_set():
                self.peak_rss_total = max(self.peak_rss_total, self.rss_total())
                if with_metrics:
                    # The executing LISTs from every apiserver at once, from APF's own few-hundred-byte table:
                    # /metrics is megabytes under a storm, its gauges read moments apart on each apiserver, so a
                    # LIST that ended on one while its successor started on another was counted twice.
                    dumps = await asyncio.gather(*(c.get(APF_DUMP) for c in clients), return_exceptions=True)
                    now = [apf_executing(d.text, OBSERVE) if not isinstance(d, BaseException) else None
                           for d in dumps]
                    if all(v is not None for v in now):
                        for i, v in enumerate(now):
                            self.max_executing_per_backend[i] = max(self.max_executing_per_backend[i], float(v or 0))
                        self.totals.append(sum(v or 0 for v in now))
                        self.samples += 1
                if with_metrics and with_heap:
                    texts = await asyncio.gather(*(c.get("/metrics") for c in clients), return_exceptions=True)
                    heap = sum(metric_sum(t.text, "go_memstats_heap_alloc_bytes") for t in texts
                               if not isinstance(t, BaseException))
                    self.peak_heap_total = max(self.peak_heap_total, heap)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval)
        finally:
            for c in clients:
                await c.aclose()

    def stop(self) -> None:
        self._stop.set()

    @property
    def max_executing_total(self) -> float:
        """The most of the storm's LISTs the apiservers ran at once in one sample (0 before any)."""
        return float(max(self.totals, default=0))

    def within_budget(self, budget: int) -> bool:
        """The apiservers never ran more than ``budget`` of the storm's LISTs, as far as sampling can tell.

        The three tables are read concurrently, not at one instant, and a LIST stays executing in its apiserver
        for a moment after the proxy has its last byte and gave its seat to the next one: a handover on two
        apiservers can be read as budget + 1. So one such sample in ten is allowed, never more than budget + 1
        (the proxy's own count, exact, is asserted separately)."""
        over = [t for t in self.totals if t > budget]
        return bool(self.totals) and all(t <= budget + 1 for t in over) and len(over) <= max(1, len(self.totals) // 10)


def tree_rss(pid: int) -> int:
    """RSS of ``pid`` and its children (a proxy's supervisor and its workers)."""
    total = 0
    pids = [pid]
    with contextlib.suppress(OSError):
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def tenant_ctx(state: SandboxState, user: str) -> ssl.SSLContext:
    """An HTTP/1.1 client context with a tenant's certificate (group ``STORM_GROUP``; never system:masters)."""
    issued = PKI(state.certs_dir).issue_client(f"fc-{user}", user=user, groups=[STORM_GROUP])
    ctx = ssl.create_default_context(cafile=str(SandboxPKI(Path(state.certs_dir)).ca))
    ctx.load_cert_chain(str(issued.cert), str(issued.key))
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


async def slow_reader(port: int, ctx: ssl.SSLContext, path: str, rate: float, seconds: float) -> tuple[int, bool]:
    """GET ``path`` over HTTP/1.1 and take the answer at ``rate`` bytes/s through small socket and stream
    buffers, for up to ``seconds``: a tenant reading a LIST a trickle at a time. Returns (bytes received,
    whether the server closed the connection)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, ssl=ctx, server_hostname="localhost", limit=16384)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\r\n".encode())
    got, closed = 0, False
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            chunk = await reader.read(4096)
            if not chunk:
                closed = True
                break
            got += len(chunk)
            await asyncio.sleep(len(chunk) / rate)
    except (ConnectionError, OSError):
        closed = True
    finally:
        writer.close()
    return got, closed


async def kubectl_list(
    state: SandboxState, kubeconfig_path: Path, namespace: str, chunk: int = 100, limit_s: float = 300
) -> tuple[int, set[str], float, str]:
    """``kubectl get secrets -o name`` as a subprocess; returns (exit code, names, seconds, stderr)."""
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        kubectl_binary(state),
        "--kubeconfig",
        str(kubeconfig_path),
        "get",
        "secrets",
        "-n",
        namespace,
        "-o",
        "name",
        f"--chunk-size={chunk}",
        "--request-timeout=0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), limit_s)
    names = {line.split("/", 1)[-1] for line in out.decode().split() if line}
    return proc.returncode or 0, names, time.monotonic() - t0, err.decode()


def parse_json(text: str) -> Any:
    return json.loads(text)
