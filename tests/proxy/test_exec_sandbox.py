"""``kubectl exec`` through the proxy to real apiservers: the HTTP/1.1 upgrade splice end to end.

KWOK's server plays the kubelet the apiservers dial for exec (the sandbox's
nodes advertise it at 127.0.0.1, and a ``ClusterExec`` opts the sandbox's
exec namespace in), running the exec'd argv as a local process. So an exec
here crosses every real hop: kubectl -> proxy (101 Switching Protocols,
then raw bytes both ways) -> kube-apiserver -> KWOK. The direct exec comes
first so a broken sandbox is told apart from a broken proxy.

Known KWOK limits, not the proxy's: a command's non-zero exit status arrives
as an internal error (kubectl exits 1, not the status), and stdin EOF does
not reach the local process, so the stdin test uses ``head -n1``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess

pytestmark = pytest.mark.sandbox

REQUESTS = "gatekeeper_proxy_requests_total"
SYSTEM_KUBECTL = "/usr/bin/kubectl"
"""The machine's kubectl (v1.32): WebSocket exec by default, SPDY when told to."""


def built_kubectl(state: SandboxState) -> str:
    return str(state.extra.get("kubectl") or "kubectl")


def system_kubectl() -> str:
    found = SYSTEM_KUBECTL if os.access(SYSTEM_KUBECTL, os.X_OK) else shutil.which("kubectl")
    if not found:
        pytest.skip("no kubectl on PATH to test the second client version with")
    return found


def kubectl(binary: str, kubeconfig: Path | str, *args: str, stdin: str | None = None,
            env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary, "--kubeconfig", str(kubeconfig), *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def exec_pod(sandbox: SandboxState) -> Iterator[tuple[str, str]]:
    """(namespace, name) of a Running KWOK pod whose exec runs locally; deleted afterwards."""
    namespace = sandbox.extra.get("exec_namespace")
    assert namespace, "sandbox.json has no exec_namespace: this sandbox's KWOK does not serve exec"
    nodes = sandbox.extra.get("gpu_nodes") or []
    assert nodes, "the sandbox has no KWOK nodes to run the exec pod on"
    admin, kb = Path(sandbox.dir) / "kubeconfig", built_kubectl(sandbox)
    made = kubectl(kb, admin, "create", "namespace", str(namespace))
    assert made.returncode == 0 or "AlreadyExists" in made.stderr, made.stderr
    name = f"exec-{uuid.uuid4().hex[:8]}"
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
        # Bound to a node directly: the test is about exec, not scheduling.
        "spec": {"nodeName": nodes[0], "containers": [{"name": "main", "image": "busybox"}]},
    }
    created = kubectl(kb, admin, "create", "-f", "-", stdin=json.dumps(pod))
    assert created.returncode == 0, created.stderr
    try:
        ready = kubectl(kb, admin, "wait", "-n", str(namespace), f"pod/{name}", "--for=condition=Ready",
                        "--timeout=60s", timeout=90)
        assert ready.returncode == 0, f"KWOK did not make the pod Ready: {ready.stderr}"
        yield str(namespace), name
    finally:
        kubectl(kb, admin, "delete", "-n", str(namespace), f"pod/{name}", "--wait=false")


@pytest.fixture(scope="module")
def proxy(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    """A private proxy, so the request counts asserted below are this module's alone."""
    p = ProxyProcess(sandbox, tmp_path_factory.mktemp("proxy-exec"))
    p.start()
    yield p
    rc = p.stop()
    assert rc == 0, f"proxy exit code {rc} after SIGTERM: {processes.tail(p.log)}"


def test_exec_runs_against_the_apiserver_directly(sandbox: SandboxState, exec_pod: tuple[str, str]) -> None:
    namespace, name = exec_pod
    word = f"hello-direct-{uuid.uuid4().hex[:6]}"
    out = kubectl(built_kubectl(sandbox), Path(sandbox.dir) / "kubeconfig", "exec", "-n", namespace, name,
                  "--", "echo", word)
    assert (out.returncode, out.stdout) == (0, f"{word}\n"), out.stderr


@pytest.mark.parametrize(("client", "websocket"), [("built", True), ("system", True), ("system", False)],
                         ids=["v1.37-websocket", "system-websocket", "system-spdy"])
def test_exec_output_comes_back_through_the_proxy_upgrade(
    sandbox: SandboxState, exec_pod: tuple[str, str], proxy: ProxyProcess, client: str, websocket: bool,
) -> None:
    namespace, name = exec_pod
    binary = built_kubectl(sandbox) if client == "built" else system_kubectl()
    # WebSocket exec is a GET (RBAC verb get), SPDY a POST (verb create): the count tells them apart.
    verb = "get" if websocket else "create"
    before = proxy.metric(REQUESTS, resource="pods/exec", code="101", verb=verb)
    word = f"hello-through-proxy-{uuid.uuid4().hex[:6]}"
    env = {} if websocket else {"KUBECTL_REMOTE_COMMAND_WEBSOCKETS": "false"}
    out = kubectl(binary, proxy.kubeconfig, "exec", "-n", namespace, name, "--", "echo", word, env=env)
    assert (out.returncode, out.stdout) == (0, f"{word}\n"), f"{out.stderr}\n{processes.tail(proxy.log)}"
    after = proxy.metric(REQUESTS, resource="pods/exec", code="101", verb=verb)
    assert after - before == 1, f"pods/exec 101 ({verb}) count went {before} -> {after}"


def test_exec_stdin_reaches_the_command_through_the_proxy(
    sandbox: SandboxState, exec_pod: tuple[str, str], proxy: ProxyProcess,
) -> None:
    namespace, name = exec_pod
    line = f"typed-{uuid.uuid4().hex[:6]}"
    out = kubectl(built_kubectl(sandbox), proxy.kubeconfig, "exec", "-i", "-n", namespace, name, "--",
                  "head", "-n1", stdin=f"{line}\nnot this one\n", timeout=30)
    assert (out.returncode, out.stdout) == (0, f"{line}\n"), out.stderr


def test_exec_stderr_is_a_separate_stream_through_the_proxy(
    sandbox: SandboxState, exec_pod: tuple[str, str], proxy: ProxyProcess,
) -> None:
    namespace, name = exec_pod
    out = kubectl(built_kubectl(sandbox), proxy.kubeconfig, "exec", "-n", namespace, name, "--",
                  "sh", "-c", "echo to-out; echo to-err >&2")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "to-out\n"
    assert out.stderr == "to-err\n"


def test_idle_exec_session_is_closed_at_the_upgrade_idle_timeout(
    sandbox: SandboxState, exec_pod: tuple[str, str], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``protocol.h1UpgradeIdleTimeoutSeconds`` from the YAML config: a silent exec is cut, counted upgrade_idle."""
    namespace, name = exec_pod
    p = ProxyProcess(sandbox, tmp_path_factory.mktemp("proxy-exec-idle"),
                     user_config={"protocol": {"h1UpgradeIdleTimeoutSeconds": 1.0}})
    p.start()
    try:
        out = kubectl(built_kubectl(sandbox), p.kubeconfig, "exec", "-n", namespace, name, "--",
                      "sh", "-c", "echo started; sleep 8; echo finished", timeout=60)
        assert out.returncode != 0 and "started" in out.stdout and "finished" not in out.stdout, out
        assert p.metric("gatekeeper_proxy_rejected_total", reason="upgrade_idle") == 1
        # Traffic keeps a session alive past the timeout: a line every 0.3 s for about 2 s.
        out = kubectl(built_kubectl(sandbox), p.kubeconfig, "exec", "-n", namespace, name, "--",
                      "sh", "-c", "for i in 1 2 3 4 5 6; do echo $i; sleep 0.3; done", timeout=60)
        assert (out.returncode, out.stdout.split()) == (0, ["1", "2", "3", "4", "5", "6"]), out.stderr
    finally:
        rc = p.stop()
    assert rc == 0, f"proxy exit code {rc} after SIGTERM: {processes.tail(p.log)}"
