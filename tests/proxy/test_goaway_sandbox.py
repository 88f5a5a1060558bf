"""goawayChance against the real sandbox: real clients keep working while the proxy moves them.

A dedicated ``gatekeeper proxy`` process (goawayChance raised through the
test-only override) fronts the session sandbox's apiservers. kubectl (Go,
HTTP/2) and kubernetes-asyncio (aiohttp, HTTP/1.1) talk through it while it
sends GOAWAYs / ``Connection: close``; the proxy's own metrics show the
GOAWAYs and the extra connections clients opened because of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess, kubectl_binary

pytestmark = pytest.mark.sandbox

GOCLIENT = Path(__file__).parent / "goclient"
CHANCE = 0.3
"""Far above kube-apiserver's 0.02 cap (test override) so a few dozen requests see several GOAWAYs."""
DRAIN = 5.0
"""drainTimeoutSeconds: how long a long-running stream may outlive its connection's GOAWAY."""
GO_RUNS = 4
"""Bound on the Go client runs that wait for a GOAWAY to overtake a stream in flight."""


@pytest.fixture(scope="module")
def goaway_proxy(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    proxy = ProxyProcess(sandbox, tmp_path_factory.mktemp("goaway-proxy"), name="goaway-proxy",
                         goaway_chance=CHANCE, user_config={"protocol": {"drainTimeoutSeconds": DRAIN}})
    try:
        proxy.start()
        yield proxy
    finally:
        rc = proxy.stop(timeout=60)
    assert rc == 0, f"proxy exit code {rc}: {processes.tail(proxy.log)}"


def _pods(namespace: str, names: list[str]) -> str:
    items = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": n, "namespace": namespace},
              "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}} for n in names]
    return yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items})


def test_watch_keeps_receiving_events_across_many_goaways(
    sandbox: SandboxState, goaway_proxy: ProxyProcess, namespace: str, tmp_path: Path,
) -> None:
    kubectl = kubectl_binary(sandbox)
    base = [kubectl, "--kubeconfig", str(goaway_proxy.kubeconfig), "--cache-dir", str(tmp_path / "cache")]
    goaways0 = goaway_proxy.metric("gatekeeper_proxy_goaway_sent_total", reason="chance")
    conns0 = goaway_proxy.metric("gatekeeper_proxy_client_connections_accepted_total", protocol="h2")

    watch = subprocess.Popen(
        [*base, "-n", namespace, "get", "pods", "-w", "-o", "name"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(watch.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    processes_run = 1
    try:
        def seen(name: str) -> bool:
            return any(line.strip() == f"pod/{name}" for line in list(lines))

        def wait_seen(names: list[str], limit: float = 60) -> None:
            deadline = time.monotonic() + limit
            while not all(seen(n) for n in names):
                assert watch.poll() is None, f"kubectl get -w exited: {watch.communicate()[1]}"
                missing = [n for n in names if not seen(n)]
                assert time.monotonic() < deadline, f"watch missed {missing}: {lines}"
                time.sleep(0.1)

        # The watch reports a pod created after it started (the initial list is empty).
        time.sleep(2)
        subprocess.run([*base, "-n", namespace, "create", "-f", "-"], input=_pods(namespace, ["first"]),
                       text=True, check=True, capture_output=True, timeout=60)
        processes_run += 1
        wait_seen(["first"])

        created: list[str] = []
        for batch in range(5):
            names = [f"p{batch}-{i}" for i in range(6)]
            # one kubectl process, many requests: it must ride through GOAWAYs mid-run
            done = subprocess.run([*base, "apply", "-f", "-"], input=_pods(namespace, names), text=True,
                                  capture_output=True, timeout=120)
            processes_run += 1
            assert done.returncode == 0, done.stderr
            created += names
            wait_seen(created)
        assert watch.poll() is None, "kubectl get -w ended"
    finally:
        watch.terminate()
        watch.wait(10)

    goaways = goaway_proxy.metric("gatekeeper_proxy_goaway_sent_total", reason="chance") - goaways0
    conns = goaway_proxy.metric("gatekeeper_proxy_client_connections_accepted_total", protocol="h2") - conns0
    print(f"GOAWAYs sent: {goaways:.0f}, h2 connections opened: {conns:.0f} "
          f"by {processes_run} kubectl processes")
    assert goaways >= 3
    # every kubectl process opens one connection; GOAWAYs made them open more for later requests
    assert conns > processes_run


async def test_http11_client_reconnects_after_connection_close(
    sandbox: SandboxState, goaway_proxy: ProxyProcess, namespace: str,
) -> None:
    from kubernetes_asyncio import client, config

    closes0 = goaway_proxy.metric("gatekeeper_proxy_goaway_sent_total", reason="chance")
    conns0 = goaway_proxy.metric("gatekeeper_proxy_client_connections_accepted_total", protocol="http/1.1")
    cfg = client.Configuration()
    await config.load_kube_config(config_file=str(goaway_proxy.kubeconfig), client_configuration=cfg)
    async with client.ApiClient(cfg) as api:
        core = client.CoreV1Api(api)
        for i in range(30):
            body = client.V1ConfigMap(metadata=client.V1ObjectMeta(name=f"cm-{i}"), data={"i": str(i)})
            await core.create_namespaced_config_map(namespace, body)
            listed = await core.list_namespaced_config_map(namespace)
            assert f"cm-{i}" in {c.metadata.name for c in listed.items}
    closes = goaway_proxy.metric("gatekeeper_proxy_goaway_sent_total", reason="chance") - closes0
    conns = goaway_proxy.metric("gatekeeper_proxy_client_connections_accepted_total",
                                protocol="http/1.1") - conns0
    print(f"Connection: close sent {closes:.0f} times, http/1.1 connections opened: {conns:.0f}")
    assert closes >= 3
    assert conns >= closes  # each close made the client open a fresh connection


def goclient_binary() -> Path:
    """Build tests/proxy/goclient (stdlib only) once per source version into the user cache."""
    digest = hashlib.sha256(b"".join((GOCLIENT / f).read_bytes() for f in ("go.mod", "main.go"))).hexdigest()
    out = Path.home() / ".cache" / "gatekeeper" / "goclient" / f"goclient-{digest[:16]}"
    if not out.exists():
        go = shutil.which("go") or "/usr/local/go/bin/go"
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
        env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"}
        subprocess.run([go, "build", "-o", str(tmp), "."], cwd=GOCLIENT, env=env, check=True, timeout=900,
                       capture_output=True)
        tmp.replace(out)
    return out


def test_go_http2_client_gets_every_answer_across_goaways(
    sandbox: SandboxState, goaway_proxy: ProxyProcess, namespace: str,
) -> None:
    """Go's HTTP/2 client (what client-go uses) with 40 requests in flight on shared connections:
    GOAWAYs land mid-flight, in-flight streams finish, streams above the last id are refused and
    retried on new connections. Not one request may fail."""
    binary = goclient_binary()
    certs = SandboxPKI(Path(sandbox.certs_dir))
    subprocess.run([kubectl_binary(sandbox), "--kubeconfig", str(goaway_proxy.kubeconfig), "-n", namespace,
                    "create", "configmap", "present"], check=True, capture_output=True, timeout=60)
    goaways0 = goaway_proxy.metric("gatekeeper_proxy_goaway_sent_total", reason="chance")
    refused0 = goaway_proxy.metric("gatekeeper_proxy_refused_streams_total")
    conns0 = goaway_proxy.metric("gatekeeper_proxy_client_connections_accepted_total", protocol="h2")
    base = f"{goaway_proxy.url}/api/v1/namespaces/{namespace}/configmaps"
    # Whether a GOAWAY overtakes a stream the client already sent is a race: most runs refuse
    # several, a few refuse none. Runs repeat (bounded) until one was refused; every run must
    # answer every request.
    for run in range(1, GO_RUNS + 1):
        done = subprocess.run(
            [str(binary), "-ca", str(certs.ca), "-cert", str(certs.crt("admin")), "-key", str(certs.key("admin")),
             "-n", "400", "-p", "40", f"{base}/present", f"{base}/absent"],
            capture_output=True, text=True, timeout=300,
        )
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        goaways = goaway_proxy.metric("gatekeeper_proxy_goaway_sent_total", reason="chance") - goaways0
        refused = goaway_proxy.metric("gatekeeper_proxy_refused_streams_total") - refused0
        conns = goaway_proxy.metric("gatekeeper_proxy_client_connections_accepted_total", protocol="h2") - conns0
        print(f"Go client run {run}, 400 requests / 40 in flight: {goaways:.0f} GOAWAYs, {refused:.0f} refused "
              f"streams, {conns:.0f} connections so far; {summary}")
        assert summary["errors"] == {}
        assert summary["codes"] == {"200 HTTP/2.0": 200, "404 HTTP/2.0": 200}
        if refused >= 1:
            break
    assert goaways >= 3 and refused >= 1 and conns > 1


def test_go_watch_on_a_goaway_connection_is_cut_as_probable_eof(
    sandbox: SandboxState, goaway_proxy: ProxyProcess, namespace: str,
) -> None:
    """A watch sharing its HTTP/2 connection with requests outlives that connection's GOAWAY by the
    drain deadline, then ends the way client-go's IsProbableEOF recognises (it re-watches quietly),
    while the requests themselves all succeed."""
    binary = goclient_binary()
    certs = SandboxPKI(Path(sandbox.certs_dir))
    base = f"{goaway_proxy.url}/api/v1/namespaces/{namespace}/configmaps"
    done = subprocess.run(
        [str(binary), "-ca", str(certs.ca), "-cert", str(certs.crt("admin")), "-key", str(certs.key("admin")),
         "-n", "60", "-p", "5", "-watch", f"{base}?watch=true", "-watch-wait", f"{DRAIN * 6:.0f}s",
         f"{base}/absent"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    print(f"Go watch on a GOAWAY'd connection: {summary['watch']}")
    assert summary["errors"] == {} and summary["codes"] == {"404 HTTP/2.0": 60}
    watch = summary["watch"]
    assert "server sent GOAWAY and closed the connection" in watch["error"]
    assert "ErrCode=NO_ERROR" in watch["error"]
    assert watch["seconds"] >= DRAIN
