"""The proxy in front of real kube-apiservers: kubectl, tokens, spoofing, clients, backend failure.

Uses the session ``sandbox`` fixture (tests/conftest.py) when present, else
the sandbox named by ``GATEKEEPER_SANDBOX_DIR``. Each test module runs its own
``gatekeeper proxy`` process against the sandbox's apiservers, so the shared
sandbox is never disturbed; the failure test adds and kills an extra
apiserver of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def sbx(request: pytest.FixtureRequest) -> SandboxState:
    if os.environ.get("GATEKEEPER_SANDBOX_DIR"):  # reuse a sandbox already up (local iteration)
        return SandboxState.load(os.environ["GATEKEEPER_SANDBOX_DIR"])
    try:
        value = request.getfixturevalue("sandbox")
    except pytest.FixtureLookupError:
        value = None
    if value is None:
        pytest.fail("no sandbox: tests/conftest.py provides the `sandbox` fixture; or set GATEKEEPER_SANDBOX_DIR")
    return value if isinstance(value, SandboxState) else SandboxState.load(getattr(value, "dir", value))


def kubectl_bin(state: SandboxState) -> str:
    return str(state.extra.get("kubectl") or "kubectl")


def run_kubectl(state: SandboxState, kubeconfig_path: Path | str, *args: str, stdin: str | None = None,
                check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([kubectl_bin(state), "--kubeconfig", str(kubeconfig_path), *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
    return proc


def backend_counts(metrics_text: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for m in re.finditer(r'^gatekeeper_proxy_requests_total\{([^}]*)\} ([0-9.e+]+)$', metrics_text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        counts[labels["backend"]] = counts.get(labels["backend"], 0) + float(m.group(2))
    return counts


def gauge(metrics_text: str, name: str, backend: str) -> float:
    m = re.search(rf'^{name}\{{backend="{re.escape(backend)}"\}} ([0-9.e+]+)$', metrics_text, re.M)
    return float(m.group(1)) if m else float("nan")


@pytest.fixture(scope="module")
def proxy(sbx: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    p = ProxyProcess(sbx, tmp_path_factory.mktemp("proxy"), health_interval=0.5)
    p.start()
    yield p
    rc = p.stop()
    assert rc == 0, f"proxy exit code {rc} after SIGTERM: {processes.tail(p.log)}"


@pytest.fixture(scope="module")
def namespace(sbx: SandboxState) -> Iterator[str]:
    ns = f"px-{uuid.uuid4().hex[:6]}"
    run_kubectl(sbx, sbx.kubeconfig, "create", "namespace", ns)
    # without kube-controller-manager nobody creates the "default" ServiceAccount pods need
    run_kubectl(sbx, sbx.kubeconfig, "-n", ns, "create", "serviceaccount", "default", check=False)
    yield ns
    run_kubectl(sbx, sbx.kubeconfig, "delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def viewer_token(sbx: SandboxState, namespace: str) -> str:
    """A ServiceAccount token with edit rights in ``namespace`` only (nothing cluster-wide)."""
    run_kubectl(sbx, sbx.kubeconfig, "-n", namespace, "create", "serviceaccount", "px-editor")
    # An explicit Role: the aggregated "edit" ClusterRole is empty without kube-controller-manager.
    run_kubectl(sbx, sbx.kubeconfig, "-n", namespace, "create", "role", "px-editor",
                "--verb=get,list,watch,create,update,patch,delete", "--resource=configmaps")
    run_kubectl(sbx, sbx.kubeconfig, "-n", namespace, "create", "rolebinding", "px-editor",
                "--role=px-editor", f"--serviceaccount={namespace}:px-editor")
    return run_kubectl(sbx, sbx.kubeconfig, "-n", namespace, "create", "token", "px-editor").stdout.strip()


def token_kubeconfig(proxy: ProxyProcess, token: str, path: Path) -> Path:
    data = yaml.safe_load(proxy.kubeconfig.read_text())
    data["users"] = [{"name": "sandbox", "user": {"token": token}}]
    path.write_text(yaml.safe_dump(data))
    return path


# --- kubectl ------------------------------------------------------------------------------------

def test_kubectl_with_client_cert_is_the_stamped_admin(sbx: SandboxState, proxy: ProxyProcess) -> None:
    out = run_kubectl(sbx, proxy.kubeconfig, "auth", "whoami", "-o", "json").stdout
    info = json.loads(out)["status"]["userInfo"]
    assert info["username"] == "sandbox-admin"
    assert "system:masters" in info["groups"]


def test_kubectl_crud_apply_and_server_side_apply_through_proxy(
    sbx: SandboxState, proxy: ProxyProcess, namespace: str,
) -> None:
    kc = proxy.kubeconfig
    run_kubectl(sbx, kc, "-n", namespace, "create", "configmap", "c1", "--from-literal=a=1")
    got = json.loads(run_kubectl(sbx, kc, "-n", namespace, "get", "configmap", "c1", "-o", "json").stdout)
    assert got["data"] == {"a": "1"}
    manifest = yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": "c2", "namespace": namespace}, "data": {"b": "2"}})
    run_kubectl(sbx, kc, "apply", "-f", "-", stdin=manifest)
    ssa = manifest.replace("b: '2'", "b: '3'").replace('b: "2"', 'b: "3"')
    run_kubectl(sbx, kc, "apply", "--server-side", "--force-conflicts", "-f", "-", stdin=ssa)
    listed = json.loads(run_kubectl(sbx, kc, "-n", namespace, "get", "configmaps", "-o", "json").stdout)
    names = {i["metadata"]["name"]: i.get("data") for i in listed["items"]}
    assert names["c1"] == {"a": "1"} and names["c2"] == {"b": "3"}
    run_kubectl(sbx, kc, "-n", namespace, "delete", "configmap", "c1", "c2")
    left = run_kubectl(sbx, kc, "-n", namespace, "get", "configmap", "c1", check=False)
    assert left.returncode != 0 and "NotFound" in left.stderr


def test_kubectl_watch_receives_events_through_proxy(
    sbx: SandboxState, proxy: ProxyProcess, namespace: str,
) -> None:
    watcher = subprocess.Popen(
        [kubectl_bin(sbx), "--kubeconfig", str(proxy.kubeconfig), "-n", namespace, "get", "configmaps", "-w",
         "-o", "name", "--request-timeout=0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        for i in range(3):
            run_kubectl(sbx, proxy.kubeconfig, "-n", namespace, "create", "configmap", f"w{i}")
        deadline = time.monotonic() + 20
        seen: set[str] = set()
        assert watcher.stdout is not None
        os.set_blocking(watcher.stdout.fileno(), False)
        while time.monotonic() < deadline and not {"configmap/w0", "configmap/w1", "configmap/w2"} <= seen:
            line = watcher.stdout.readline()
            if line:
                seen.add(line.strip())
            else:
                time.sleep(0.1)
        assert {"configmap/w0", "configmap/w1", "configmap/w2"} <= seen, seen
    finally:
        watcher.terminate()
        watcher.wait(10)


def test_kubectl_with_token_passes_through(sbx: SandboxState, proxy: ProxyProcess, namespace: str,
                                           viewer_token: str, tmp_path: Path) -> None:
    kc = token_kubeconfig(proxy, viewer_token, tmp_path / "token.kubeconfig")
    who = json.loads(run_kubectl(sbx, kc, "auth", "whoami", "-o", "json").stdout)["status"]["userInfo"]
    assert who["username"] == f"system:serviceaccount:{namespace}:px-editor"
    run_kubectl(sbx, kc, "-n", namespace, "create", "configmap", "tok", "--from-literal=x=y")
    assert "tok" in run_kubectl(sbx, kc, "-n", namespace, "get", "configmaps", "-o", "name").stdout
    manifest = yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": "tok2", "namespace": namespace}})
    run_kubectl(sbx, kc, "apply", "--server-side", "-f", "-", stdin=manifest)
    run_kubectl(sbx, kc, "-n", namespace, "delete", "configmap", "tok", "tok2")
    denied = run_kubectl(sbx, kc, "get", "secrets", "-n", "kube-system", check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()


def test_metrics_on_proxy_show_all_backends_serving(sbx: SandboxState, proxy: ProxyProcess) -> None:
    with httpx.Client(verify=proxy.tls(cert=True), http2=True) as client:
        for _ in range(45):
            assert client.get(f"{proxy.url}/api/v1/namespaces/default").status_code == 200
    text = run_kubectl(sbx, proxy.kubeconfig, "get", "--raw", "/metrics").stdout
    counts = backend_counts(text)
    assert len(sbx.apiserver_urls) >= 3
    assert set(counts) == {f"apiserver-{i}" for i in range(1, len(sbx.apiserver_urls) + 1)}, counts
    assert all(v >= 5 for v in counts.values()), counts
    for name in counts:
        assert gauge(text, "gatekeeper_proxy_backend_up", name) == 1.0
    assert "gatekeeper_proxy_skew_request_rate_ratio" in text
    pattern = r'gatekeeper_proxy_requests_total\{[^}]*code="200"[^}]*resource="namespaces"[^}]*verb="get"'
    assert re.search(pattern, text)


def test_kubectl_exec_upgrade_is_answered_not_hung(sbx: SandboxState, proxy: ProxyProcess, namespace: str) -> None:
    """kubectl exec (WebSocket, falling back to SPDY) goes through the upgrade path to a real apiserver.

    The sandbox has no kubelet to splice a session with, so the pod is kept unscheduled: the apiserver
    refuses the upgrade ("does not have a host assigned"), and that refusal must come back to kubectl
    as a readable error, not a hang (the 101 splice itself is covered in test_upstream.py/test_h1.py).
    """
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "exec-target", "namespace": namespace},
           "spec": {"nodeSelector": {"gatekeeper.test/no-such-node": "x"},
                    "containers": [{"name": "c", "image": "busybox"}]}}
    run_kubectl(sbx, proxy.kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump(pod))
    t0 = time.monotonic()
    proc = run_kubectl(sbx, proxy.kubeconfig, "-n", namespace, "exec", "exec-target", "--", "true",
                       check=False, timeout=60)
    assert proc.returncode != 0
    assert "host" in proc.stderr.lower(), proc.stderr
    assert time.monotonic() - t0 < 30
    assert re.search(r'gatekeeper_proxy_requests_total\{[^}]*code="400"[^}]*resource="pods/exec"', proxy.metrics())


# --- identity -----------------------------------------------------------------------------------

def test_spoofed_remote_user_with_unprivileged_token_does_not_escalate(
    sbx: SandboxState, proxy: ProxyProcess, namespace: str, viewer_token: str,
) -> None:
    spoof = {"Authorization": f"Bearer {viewer_token}", "X-Remote-User": "sandbox-admin",
             "X-Remote-Group": "system:masters", "x-remote-extra-scopes": "all"}
    with httpx.Client(verify=proxy.tls(), http2=True) as client:
        r = client.get(f"{proxy.url}/api/v1/namespaces/kube-system/secrets", headers=spoof)
        assert r.status_code == 403, r.text
        review = client.post(f"{proxy.url}/apis/authentication.k8s.io/v1/selfsubjectreviews", headers=spoof,
                             json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
        assert review.status_code == 201, review.text
        user = review.json()["status"]["userInfo"]
        assert user["username"] == f"system:serviceaccount:{namespace}:px-editor"
        assert "system:masters" not in user.get("groups", [])


def test_impersonation_headers_pass_and_are_authorized_by_the_apiserver(
    sbx: SandboxState, proxy: ProxyProcess, namespace: str, viewer_token: str, tmp_path: Path,
) -> None:
    as_sa = f"--as=system:serviceaccount:{namespace}:px-editor"
    who = json.loads(run_kubectl(sbx, proxy.kubeconfig, as_sa, "auth", "whoami", "-o", "json").stdout)
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:px-editor"
    kc = token_kubeconfig(proxy, viewer_token, tmp_path / "token.kubeconfig")
    # --raw: kubectl's discovery would hide the apiserver's message behind "Forbidden: unknown"
    denied = run_kubectl(sbx, kc, "--as=sandbox-admin", "get", "--raw", "/api/v1/namespaces", check=False)
    assert denied.returncode != 0 and "cannot impersonate" in denied.stderr, denied.stderr


def test_spoofed_remote_user_with_client_cert_is_replaced_by_cert_identity(proxy: ProxyProcess) -> None:
    with httpx.Client(verify=proxy.tls(cert=True), http2=True) as client:
        review = client.post(f"{proxy.url}/apis/authentication.k8s.io/v1/selfsubjectreviews",
                             headers={"X-Remote-User": "someone-else", "X-Remote-Group": "spoofers"},
                             json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    user = review.json()["status"]["userInfo"]
    assert user["username"] == "sandbox-admin" and "spoofers" not in user["groups"]


def test_anonymous_request_is_anonymous(proxy: ProxyProcess) -> None:
    with httpx.Client(verify=proxy.tls(), http2=True) as client:
        assert client.get(f"{proxy.url}/version").status_code == 200
        r = client.get(f"{proxy.url}/api/v1/namespaces")
    assert r.status_code in (401, 403), r.text
    if r.status_code == 403:
        assert "system:anonymous" in r.text


# --- other clients ------------------------------------------------------------------------------

async def test_httpx_http2_client_works(proxy: ProxyProcess, namespace: str) -> None:
    async with httpx.AsyncClient(verify=proxy.tls(cert=True), http2=True) as client:
        results = await asyncio.gather(*(client.get(f"{proxy.url}/api/v1/namespaces/{namespace}/configmaps")
                                         for _ in range(20)))
    assert all(r.status_code == 200 and r.http_version == "HTTP/2" for r in results)
    assert results[0].json()["kind"] == "ConfigMapList"


async def test_kubernetes_asyncio_client_works(proxy: ProxyProcess, namespace: str) -> None:
    from kubernetes_asyncio import client, config

    api_client = await config.new_client_from_config(config_file=str(proxy.kubeconfig))
    try:
        core = client.CoreV1Api(api_client)
        await core.create_namespaced_config_map(namespace, client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name="from-k8s-asyncio"), data={"k": "v"}))
        cms = await core.list_namespaced_config_map(namespace)
        assert "from-k8s-asyncio" in {c.metadata.name for c in cms.items}
        got = await core.read_namespaced_config_map("from-k8s-asyncio", namespace)
        assert got.data == {"k": "v"}
        await core.delete_namespaced_config_map("from-k8s-asyncio", namespace)
    finally:
        await api_client.close()


# --- backend failure ----------------------------------------------------------------------------

def _extra_apiserver_cmd(state: SandboxState, workdir: Path) -> tuple[list[str], int]:
    """argv of a 4th apiserver: apiserver-1's command with its own port and cert dir."""
    template = next(p for p in state.processes if p.name.startswith("kube-apiserver"))
    port = processes.free_port()
    cmd = []
    for arg in template.cmd:
        if arg.startswith("--secure-port="):
            arg = f"--secure-port={port}"
        elif arg.startswith("--cert-dir="):
            arg = f"--cert-dir={workdir / 'extra-apiserver'}"
        cmd.append(arg)
    return cmd, port


def _start_apiserver(cmd: list[str], log: Path, port: int, state: SandboxState) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    tls = processes.TLSFiles(ca=Path(state.certs_dir) / "ca.crt", cert=Path(state.certs_dir) / "admin.crt",
                             key=Path(state.certs_dir) / "admin.key")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, processes.tail(log)
        if processes.probe(f"https://127.0.0.1:{port}/readyz", tls)[0]:
            return proc
        time.sleep(0.5)
    raise AssertionError(f"extra apiserver not ready: {processes.tail(log)}")


async def _watch(client: httpx.AsyncClient, url: str, events: list[str]) -> str:
    """Stream one watch until the server ends it; returns how it ended."""
    try:
        # identity: the apiserver gzips a watch as one gzip member per flush, and httpx decodes only
        # the first member (seen directly against kube-apiserver too); Go's gzip reader reads them all.
        async with client.stream("GET", url, headers={"accept-encoding": "identity"},
                                 timeout=httpx.Timeout(10, read=None)) as r:
            if r.status_code != 200:
                # The victim died before it sent this watch's headers: the proxy answers 502 (a GET
                # that may have reached a backend is never re-sent) and clients re-watch.
                body = json.loads(await r.aread())
                return f"status {r.status_code} {body['kind']}"
            async for line in r.aiter_lines():
                if line:
                    events.append(json.loads(line)["type"])
        return "clean"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return f"error: {type(exc).__name__}: {exc}"


def test_killed_backend_ends_its_watches_cleanly_and_traffic_moves_and_returns(
    sbx: SandboxState, namespace: str, tmp_path: Path,
) -> None:
    cmd, port = _extra_apiserver_cmd(sbx, tmp_path)
    log = tmp_path / "extra-apiserver.log"
    victim = _start_apiserver(cmd, log, port, sbx)
    restarted: subprocess.Popen[bytes] | None = None
    urls = [*sbx.apiserver_urls[:2], f"https://127.0.0.1:{port}"]
    p = ProxyProcess(sbx, tmp_path, backends=urls, health_interval=0.5)
    try:
        p.start()
        asyncio.run(_kill_scenario(p, victim, namespace))
        # back again: restart the killed apiserver with the same command; it must get traffic again
        restarted = _start_apiserver(cmd, log, port, sbx)
        before = backend_counts(p.metrics()).get("apiserver-3", 0)
        time.sleep(1.5)  # a probe round (0.5 s interval) or the ejection timer lets it back in
        with httpx.Client(verify=p.tls(cert=True), http2=True) as client:
            for _ in range(60):
                assert client.get(f"{p.url}/api/v1/namespaces/{namespace}", timeout=10).status_code == 200
        after = backend_counts(p.metrics()).get("apiserver-3", 0)
        assert after - before >= 5, (before, after)
    finally:
        rc = p.stop()
        for proc in (victim, restarted):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert rc == 0


def watch_requests(metrics_text: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(
        r'^gatekeeper_proxy_requests_total\{[^}]*verb="watch"[^}]*\} ([0-9.e+]+)$', metrics_text, re.M))


async def _informer_like(kubeconfig_path: Path, namespace: str, seen: list[str], stop: asyncio.Event) -> None:
    """kubernetes-asyncio's Watch (HTTP/1.1): on a clean end of the stream it re-watches by itself."""
    from kubernetes_asyncio import client, config, watch

    api_client = await config.new_client_from_config(config_file=str(kubeconfig_path))
    api_client.set_default_header("Accept-Encoding", "identity")  # see _watch on gzip members
    try:
        w = watch.Watch()
        async for event in w.stream(client.CoreV1Api(api_client).list_namespaced_config_map, namespace):
            seen.append(f"{event['type']} {event['object'].metadata.name}")
            if stop.is_set():
                w.stop()
    finally:
        await api_client.close()


async def _kill_scenario(p: ProxyProcess, victim: subprocess.Popen[bytes], namespace: str) -> None:
    url = f"{p.url}/api/v1/namespaces/{namespace}/configmaps?watch=1&allowWatchBookmarks=true"
    n_raw, n_informers = 9, 6
    # One HTTP/2 connection per watch: httpcore multiplexing idle streams on one connection can leave
    # a received END_STREAM unread (checked with a raw h2 client: the proxy ends all of them).
    watchers = [httpx.AsyncClient(verify=p.tls(cert=True), http2=True) for _ in range(n_raw)]
    stop = asyncio.Event()
    async with httpx.AsyncClient(verify=p.tls(cert=True), http2=True) as client:
        events: list[list[str]] = [[] for _ in range(n_raw)]
        tasks = [asyncio.create_task(_watch(watchers[i], url, events[i])) for i in range(n_raw)]
        informer_seen: list[list[str]] = [[] for _ in range(n_informers)]
        informers = [asyncio.create_task(_informer_like(p.kubeconfig, namespace, informer_seen[i], stop))
                     for i in range(n_informers)]
        deadline = time.monotonic() + 20
        on_victim = total = 0.0
        while time.monotonic() < deadline:
            await asyncio.sleep(0.3)
            text = p.metrics()
            on_victim = gauge(text, "gatekeeper_proxy_backend_watches", "apiserver-3")
            total = sum(gauge(text, "gatekeeper_proxy_backend_watches", f"apiserver-{i}") for i in (1, 2, 3))
            if total == n_raw + n_informers:
                break
        assert total == n_raw + n_informers and on_victim >= 1, p.metrics()
        watches_before = watch_requests(p.metrics())
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        # the victim's raw watches end, cleanly (END_STREAM), within seconds; the others keep running
        done, pending = await asyncio.wait(tasks, timeout=10)
        assert all(t.result() in ("clean", "status 502 Status") for t in done), [t.result() for t in done]
        assert not any(t.done() for t in informers), [t.exception() for t in informers if t.done()]
        # new requests go to the survivors; none hangs, none fails
        for _ in range(30):
            r = await client.get(f"{p.url}/api/v1/namespaces/{namespace}", timeout=10)
            assert r.status_code == 200, r.text
        # surviving watches still deliver events, and re-watching clients get them on a new watch
        seen_before = [len(ev) for ev in events]
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "after-kill"}}
        created = await client.post(f"{p.url}/api/v1/namespaces/{namespace}/configmaps", json=cm)
        assert created.status_code == 201, created.text
        live = [i for i, t in enumerate(tasks) if t in pending]
        for _ in range(100):
            if all("ADDED" in events[i][seen_before[i]:] for i in live) and all(
                    "ADDED after-kill" in seen for seen in informer_seen):
                break
            await asyncio.sleep(0.1)
        survivors = [events[i][seen_before[i]:] for i in live]
        assert survivors and all("ADDED" in ev for ev in survivors), (events, seen_before, p.metrics())
        assert all("ADDED after-kill" in seen for seen in informer_seen), informer_seen
        # every watch the victim held either ended cleanly (raw) or was re-opened by its client (informers)
        rewatches = watch_requests(p.metrics()) - watches_before
        assert len(done) + rewatches >= on_victim, (len(done), rewatches, on_victim)
        text = p.metrics()
        assert gauge(text, "gatekeeper_proxy_backend_up", "apiserver-3") == 0.0
        stop.set()
        for t in [*pending, *informers]:
            t.cancel()
        await asyncio.gather(*pending, *informers, return_exceptions=True)
        for w in watchers:
            await w.aclose()


def test_proxy_config_rejects_bad_input_clearly(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("proxy:\n  backends: []\n  listener: {certFile: /x, keyFile: /y}\n")
    proc = subprocess.run([sys.executable, "-m", "gatekeeper", "proxy", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "backends" in proc.stderr and "Traceback" not in proc.stderr
