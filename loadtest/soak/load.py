"""The soak's steady load through the proxy, as issue 46 measured it, plus token churn.

* Small requests at ``rps``, round robin over a LIST of 50 ConfigMaps of 1 KiB, a GET by name and ``/version``,
  over ``connections`` HTTP/2 connections that are all renewed every round (a minute): h2load (Debian's
  ``nghttp2-client``), or, where it is missing (CI), an asyncio client of our own at a lower rate.
* Each round uses a newly issued ServiceAccount token (``TokenRequest``): the proxy's token memo sees a new key
  every minute, as it does when kubelets rotate projected tokens.
* ``watches`` ``kubectl get -w`` on the ConfigMaps, cut and restarted every ``watch_seconds``.
* One ConfigMap patched every 0.5 s over HTTP/1.1 through the proxy, so the watches carry events.

Every loop stops with :attr:`Load.stop`; each is bounded by the soak's duration.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import ssl
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import kubectl_binary
from loadtest.harness.cluster import admin, ensure_namespace

NAMESPACE = "gk-soak"
ACCOUNT = "soak-client"
CONFIGMAPS = 50
CONFIGMAP_BYTES = 1024
WATCHED = "cm-0"

RBAC = """
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: soak-client, namespace: gk-soak}
rules:
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, patch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: soak-client, namespace: gk-soak}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: soak-client}
subjects:
- {kind: ServiceAccount, name: soak-client, namespace: gk-soak}
"""


def paths() -> list[str]:
    """The small requests, in the order each connection cycles through them."""
    return [f"/api/v1/namespaces/{NAMESPACE}/configmaps", f"/api/v1/namespaces/{NAMESPACE}/configmaps/cm-7",
            "/version"]


def prepare(state: SandboxState) -> None:
    """The namespace, its ConfigMaps and the client's ServiceAccount with just what the load needs."""
    with admin(state) as c:
        ensure_namespace(c, NAMESPACE)
        for i in range(CONFIGMAPS):
            body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"cm-{i}"},
                    "data": {"payload": "x" * CONFIGMAP_BYTES}}
            r = c.post(f"/api/v1/namespaces/{NAMESPACE}/configmaps", json=body)
            if r.status_code not in (201, 409):
                raise RuntimeError(f"configmap cm-{i}: {r.status_code} {r.text[:200]}")
        r = c.post(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts",
                   json={"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": ACCOUNT}})
        if r.status_code not in (201, 409):
            raise RuntimeError(f"serviceaccount: {r.status_code} {r.text[:200]}")
    proc = subprocess.run([kubectl_binary(state), "--kubeconfig", state.kubeconfig, "apply", "-f", "-"],
                          input=RBAC, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"soak RBAC: {proc.stderr.strip()}")


def new_token(state: SandboxState, seconds: int = 3600) -> str:
    """A fresh token for the client's ServiceAccount (a new credential each time)."""
    with admin(state) as c:
        r = c.post(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{ACCOUNT}/token",
                   json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                         "spec": {"expirationSeconds": seconds}})
    if r.status_code != 201:
        raise RuntimeError(f"token request: {r.status_code} {r.text[:200]}")
    return str(r.json()["status"]["token"])


@dataclass
class Tally:
    """What the load did; a request that got no answer or a non-2xx answer is ``failed``."""

    requests: int = 0
    failed: int = 0
    rounds: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    watches_started: int = 0
    watches_ended_early: int = 0
    patches: int = 0
    patches_failed: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def note(self, error: str) -> None:
        with self.lock:
            if len(self.errors) < 20:
                self.errors.append(error)


H2LOAD_REQUESTS = re.compile(r"requests: (\d+) total, \d+ started, \d+ done, (\d+) succeeded, (\d+) failed")
H2LOAD_CODES = re.compile(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx")


def h2load_round(h2load: str, url: str, token: str, ca: Path, rps: float, seconds: float, connections: int,
                 tally: Tally) -> None:
    """One round: ``connections`` new connections for ``seconds`` at ``rps`` in all (h2load has no CA option: the
    TLS handshake is not verified, the token is only ever sent to 127.0.0.1)."""
    del ca
    argv = [h2load, "-D", f"{seconds:g}", "-c", str(connections), "--rps", f"{rps / connections:g}", "-m", "4",
            "-H", f"authorization: Bearer {token}", *(url + p for p in paths())]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 120)
    got = H2LOAD_REQUESTS.search(proc.stdout)
    codes = H2LOAD_CODES.search(proc.stdout)
    with tally.lock:
        tally.rounds += 1
        if got is None:
            tally.failed += 1
            tally.errors.append(f"h2load output not understood: {(proc.stdout + proc.stderr)[-300:]}")
            return
        total, ok, failed = map(int, got.groups())
        tally.requests += total
        tally.failed += total - ok + 0 * failed
        if codes:
            for cls, n in zip(("2xx", "3xx", "4xx", "5xx"), codes.groups(), strict=True):
                tally.statuses[cls] += int(n)


async def _python_round(url: str, token: str, ca: Path, rps: float, seconds: float, connections: int,
                        tally: Tally) -> None:
    ctx = ssl.create_default_context(cafile=str(ca))
    headers = {"authorization": f"Bearer {token}"}
    clients = [httpx.AsyncClient(http2=True, verify=ctx, base_url=url, headers=headers, timeout=30,
                                 limits=httpx.Limits(max_connections=1)) for _ in range(connections)]
    order = paths()
    inflight: set[asyncio.Task[None]] = set()
    local: Counter[str] = Counter()

    async def one(i: int) -> None:
        try:
            r = await clients[i % connections].get(order[i % len(order)])
            local[f"{r.status_code // 100}xx"] += 1
        except httpx.HTTPError as exc:
            local["error"] += 1
            tally.note(f"{type(exc).__name__}: {exc}"[:200])

    start = time.monotonic()
    count = int(rps * seconds)
    try:
        for i in range(count):
            delay = start + i / rps - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(inflight) >= 256:  # the driver, not the proxy, is behind: count it, do not queue more
                local["skipped"] += 1
                continue
            task = asyncio.create_task(one(i))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        if inflight:
            await asyncio.wait(inflight, timeout=60)
    finally:
        for c in clients:
            await c.aclose()
    with tally.lock:
        tally.rounds += 1
        tally.requests += sum(v for k, v in local.items() if k != "skipped")
        tally.failed += sum(v for k, v in local.items() if k not in ("2xx", "skipped"))
        tally.statuses.update(local)


def python_round(url: str, token: str, ca: Path, rps: float, seconds: float, connections: int, tally: Tally) -> None:
    asyncio.run(_python_round(url, token, ca, rps, seconds, connections, tally))


def token_kubeconfig(path: Path, url: str, ca: Path, token: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "soak",
        "clusters": [{"name": "proxy", "cluster": {"server": url, "certificate-authority": str(ca)}}],
        "users": [{"name": ACCOUNT, "user": {"token": token}}],
        "contexts": [{"name": "soak", "context": {"cluster": "proxy", "user": ACCOUNT, "namespace": NAMESPACE}}]}))
    return path


@dataclass
class Load:
    """The soak's load against ``url`` (the proxy), until :attr:`stop` is set."""

    state: SandboxState
    url: str
    ca: Path
    work: Path
    rps: float
    connections: int = 8
    round_seconds: float = 60.0
    watches: int = 5
    watch_seconds: float = 20.0
    patch_interval: float = 0.5
    driver: str = "auto"
    """``h2load``, ``python``, or ``auto`` (h2load when installed)."""
    stop: threading.Event = field(default_factory=threading.Event)
    tally: Tally = field(default_factory=Tally)
    token: str = ""
    threads: list[threading.Thread] = field(default_factory=list)

    def driver_name(self) -> str:
        if self.driver == "auto":
            return "h2load" if shutil.which("h2load") else "python"
        return self.driver

    def start(self) -> None:
        self.token = new_token(self.state)
        for loop in (self._requests, self._watches, self._patches):
            t = threading.Thread(target=self._guard, args=(loop,), daemon=True, name=loop.__name__)
            t.start()
            self.threads.append(t)

    def close(self, timeout: float = 180) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _guard(self, loop: object) -> None:
        try:
            loop()  # type: ignore[operator]
        except Exception as exc:  # a loop that dies is a failed soak, said in the report
            self.tally.note(f"{getattr(loop, '__name__', loop)} stopped: {type(exc).__name__}: {exc}")
            with self.tally.lock:
                self.tally.failed += 1

    def _requests(self) -> None:
        h2load = shutil.which("h2load") if self.driver_name() == "h2load" else None
        while not self.stop.is_set():
            self.token = new_token(self.state)  # token churn: a new credential every round
            if h2load:
                h2load_round(h2load, self.url, self.token, self.ca, self.rps, self.round_seconds, self.connections,
                             self.tally)
            else:
                python_round(self.url, self.token, self.ca, self.rps, self.round_seconds, self.connections,
                             self.tally)

    def _watches(self) -> None:
        kubectl = kubectl_binary(self.state)
        while not self.stop.is_set():
            config = token_kubeconfig(self.work / "watch.kubeconfig", self.url, self.ca, self.token)
            procs = [subprocess.Popen([kubectl, "--kubeconfig", str(config), "get", "configmaps", "-w",
                                       "--request-timeout=0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                     for _ in range(self.watches)]
            with self.tally.lock:
                self.tally.watches_started += len(procs)
            self.stop.wait(self.watch_seconds)
            for p in procs:
                if p.poll() is not None:
                    with self.tally.lock:
                        self.tally.watches_ended_early += 1
                    self.tally.note(f"watch ended early ({p.returncode}): "
                                    f"{(p.stderr.read() if p.stderr else b'').decode()[-200:]}")
                p.kill()
                p.wait()
                if p.stderr:
                    p.stderr.close()

    def _patches(self) -> None:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        n = 0
        with httpx.Client(base_url=self.url, verify=ctx, timeout=30) as client:
            while not self.stop.wait(self.patch_interval):
                n += 1
                try:
                    r = client.patch(f"/api/v1/namespaces/{NAMESPACE}/configmaps/{WATCHED}",
                                     content=json.dumps({"data": {"n": str(n)}}),
                                     headers={"authorization": f"Bearer {self.token}",
                                              "content-type": "application/merge-patch+json"})
                    ok = r.status_code == 200
                except httpx.HTTPError as exc:
                    ok = False
                    self.tally.note(f"patch: {type(exc).__name__}: {exc}"[:200])
                with self.tally.lock:
                    self.tally.patches += 1
                    self.tally.patches_failed += 0 if ok else 1
