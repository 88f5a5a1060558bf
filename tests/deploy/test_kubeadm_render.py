"""The kubeadm changes of deploy/proxy/kubeadm/, rendered by kubeadm itself (the same k8s.io/kubernetes version as
the sandbox), for topology A (apiserver stays on :6443) and B (apiserver on :6444, the proxy on :6443).

kubeadm writes the kube-apiserver static pod with ``init phase control-plane apiserver --dry-run`` into a
temporary directory (``KUBEADM_INIT_DRYRUN_DIR``); the manifest code is the one ``kubeadm upgrade`` uses. Every
config sets ``certificatesDir`` to a temporary directory too, so kubeadm never writes under /etc/kubernetes; the
tests check that it did not. The rendered apiserver must keep every flag kubeadm sets without our change, have the
port and endpoint reconciler the install pages document, and start against a sandbox's etcd with its certificates.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gatekeeper.certs.pki import PKI
from gatekeeper.sandbox import processes
from gatekeeper.sandbox.build import K8S, KUBEADM, BuildError, installed, kubeadm_binary, module_version
from gatekeeper.sandbox.pki import SERVICE_CIDR, SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import run_down

KUBEADM_DIR = Path(__file__).resolve().parents[2] / "deploy" / "proxy" / "kubeadm"
ADVERTISE = "192.0.2.10"
"""TEST-NET-1: kubeadm refuses a loopback advertise address, and this one is never routed."""
CLUSTERS_OWN = {"name": "audit-log-maxage", "value": "30"}
"""An extraArg the cluster had before: the merge keeps it."""
DOCUMENTED = {"a": {"secure-port": "6443", "client-port": 6443}, "b": {"secure-port": "6444", "client-port": 6443}}
"""What docs/install/topology-{a,b}.md say: the apiserver's port, and the port kubeadm's kubeconfigs call."""


@pytest.fixture(scope="module")
def kubeadm() -> Path:
    try:
        return kubeadm_binary()
    except BuildError as exc:
        pytest.skip(str(exc))


@pytest.fixture(autouse=True)
def _nothing_written_to_etc_kubernetes() -> Iterator[None]:
    existed = Path("/etc/kubernetes").exists()
    yield
    assert existed or not Path("/etc/kubernetes").exists(), "kubeadm wrote under /etc/kubernetes"


def documented_change(topology: str) -> list[dict[str, str]]:
    """The extraArgs of deploy/proxy/kubeadm/topology-<t>.yaml; the file must hold nothing else to merge."""
    doc = yaml.safe_load((KUBEADM_DIR / f"topology-{topology}.yaml").read_text())
    assert doc["apiVersion"] == "kubeadm.k8s.io/v1beta4" and doc["kind"] == "ClusterConfiguration"
    assert set(doc) == {"apiVersion", "kind", "apiServer"} and set(doc["apiServer"]) == {"extraArgs"}
    return list(doc["apiServer"]["extraArgs"])


def kubeadm_config(tmp: Path, *, extra_args: list[dict[str, str]], patches: Path | None = None,
                   etcd: dict[str, Any] | None = None, bind_port: int = 6443, pki: Path | None = None) -> Path:
    """A node's kubeadm config as the install pages build it: the cluster's ClusterConfiguration with the
    topology's extraArgs appended, and this node's InitConfiguration. ``pki`` (default ``tmp/pki``) is the
    certificatesDir: renders to compare share one, since kubeadm's flags name its files."""
    pki = pki or tmp / "pki"
    pki.mkdir(exist_ok=True)
    init: dict[str, Any] = {"apiVersion": "kubeadm.k8s.io/v1beta4", "kind": "InitConfiguration",
                            "localAPIEndpoint": {"advertiseAddress": ADVERTISE, "bindPort": bind_port},
                            "nodeRegistration": {"name": "cp-1"}}
    if patches is not None:
        init["patches"] = {"directory": str(patches)}
    cluster: dict[str, Any] = {
        "apiVersion": "kubeadm.k8s.io/v1beta4", "kind": "ClusterConfiguration",
        "kubernetesVersion": K8S.version(), "certificatesDir": str(pki),
        "networking": {"serviceSubnet": SERVICE_CIDR}, "apiServer": {"extraArgs": extra_args},
    }
    if etcd is not None:
        cluster["etcd"] = etcd
    path = tmp / "kubeadm.yaml"
    path.write_text(yaml.safe_dump_all([init, cluster], sort_keys=False))
    return path


def run_kubeadm(kubeadm: Path, out: Path, *args: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "KUBEADM_INIT_DRYRUN_DIR": str(out)}
    p = subprocess.run([str(kubeadm), *args, "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def render_apiserver(kubeadm: Path, tmp: Path, **config: Any) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    path = kubeadm_config(tmp, **config)
    run_kubeadm(kubeadm, tmp / "out", "init", "phase", "control-plane", "apiserver", "--config", str(path))
    pod: dict[str, Any] = yaml.safe_load((tmp / "out" / "kube-apiserver.yaml").read_text())
    return pod


def flags(pod: dict[str, Any]) -> dict[str, str]:
    (container,) = pod["spec"]["containers"]
    assert container["command"][0] == "kube-apiserver"
    out: dict[str, str] = {}
    for arg in container["command"][1:]:
        name, _, value = arg.removeprefix("--").partition("=")
        assert name not in out, f"--{name} twice"
        out[name] = value
    return out


def probe_port(pod: dict[str, Any]) -> int:
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == "probe-port"
    return int(ports["probe-port"])


def merge_script(cluster: dict[str, Any], topology: str, tmp: Path, *, remove: bool = False) -> dict[str, Any]:
    """What the install pages run: merge-extra-args.py on the cluster's ClusterConfiguration."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    argv = [sys.executable, str(KUBEADM_DIR / "merge-extra-args.py"), *(["--remove"] if remove else []),
            str(tmp / "cluster.yaml"), str(KUBEADM_DIR / f"topology-{topology}.yaml")]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out: dict[str, Any] = yaml.safe_load(p.stdout)
    return out


def topology_render(kubeadm: Path, tmp: Path, topology: str, pki: Path) -> dict[str, Any]:
    """The apiserver as the install page makes it: the cluster's extraArgs (here one of the cluster's own) merged
    with the topology's by the documented script, and for B the documented patch."""
    cluster = merge_script({"apiVersion": "kubeadm.k8s.io/v1beta4", "kind": "ClusterConfiguration",
                            "apiServer": {"extraArgs": [CLUSTERS_OWN]}}, topology, tmp / "merge")
    assert cluster["apiServer"]["extraArgs"][0] == CLUSTERS_OWN
    patches = KUBEADM_DIR / "patches" if topology == "b" else None
    return render_apiserver(kubeadm, tmp, extra_args=cluster["apiServer"]["extraArgs"], patches=patches, pki=pki)


def test_kubeadm_is_built_from_the_sandboxs_kubernetes_module() -> None:
    k8s = module_version((K8S.source_dir() / "go.mod").read_text(), "k8s.io/kubernetes")
    assert KUBEADM.module == K8S.module and KUBEADM.version() == k8s
    assert "k8s.io/kubernetes/cmd/kubeadm" in (KUBEADM.source_dir() / "tools.go").read_text()


@pytest.mark.parametrize("topology", ["a", "b"])
def test_the_rendered_apiserver_keeps_every_kubeadm_flag_and_has_the_documented_port_and_reconciler(
        kubeadm: Path, tmp_path: Path, topology: str) -> None:
    baseline = flags(render_apiserver(kubeadm, tmp_path / "baseline", extra_args=[CLUSTERS_OWN],
                                      pki=tmp_path / "pki"))
    pod = topology_render(kubeadm, tmp_path / topology, topology, tmp_path / "pki")
    ours = flags(pod)
    changed = {a["name"] for a in documented_change(topology)}
    kept = {k: v for k, v in baseline.items() if k not in changed}
    assert {k: ours.get(k) for k in kept} == kept, "a kubeadm flag was dropped or changed"
    assert set(ours) - set(baseline) <= changed
    assert ours["endpoint-reconciler-type"] == "none"
    assert ours["secure-port"] == DOCUMENTED[topology]["secure-port"]
    assert probe_port(pod) == int(ours["secure-port"]), "the probes would check another port than the apiserver's"
    endpoint = pod["metadata"]["annotations"]["kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint"]
    assert endpoint == f"{ADVERTISE}:{DOCUMENTED[topology]['client-port']}"


@pytest.mark.parametrize("topology", ["a", "b"])
def test_the_documented_roll_back_gives_the_cluster_its_own_configuration_back(tmp_path: Path, topology: str) -> None:
    own = {"apiVersion": "kubeadm.k8s.io/v1beta4", "kind": "ClusterConfiguration", "clusterName": "prod",
           "apiServer": {"extraArgs": [CLUSTERS_OWN], "certSANs": ["lb.example.com"]}}
    changed = merge_script(own, topology, tmp_path / "in")
    assert changed["clusterName"] == "prod" and changed["apiServer"]["certSANs"] == ["lb.example.com"]
    assert merge_script(changed, topology, tmp_path / "again") == changed  # running it twice changes nothing
    assert merge_script(changed, topology, tmp_path / "out", remove=True) == own


@pytest.mark.parametrize("topology", ["a", "b"])
def test_kubeadms_component_kubeconfigs_call_the_documented_port(kubeadm: Path, tmp_path: Path,
                                                                  topology: str) -> None:
    """controller-manager.conf and scheduler.conf name the node's own endpoint (localAPIEndpoint): in A the
    apiserver itself (the install page says how to point them at the proxy), in B :6443, which is the proxy."""
    config = kubeadm_config(tmp_path, extra_args=documented_change(topology))
    run_kubeadm(kubeadm, tmp_path / "ca-out", "init", "phase", "certs", "ca", "--config", str(config))
    out = tmp_path / "out"
    out.mkdir()
    for name in ("ca.crt", "ca.key"):  # a dry run writes, and reads, the CA in its own directory
        shutil.copy(tmp_path / "ca-out" / name, out / name)
    for component in ("controller-manager", "scheduler"):
        run_kubeadm(kubeadm, out, "init", "phase", "kubeconfig", component, "--config", str(config))
        kubeconfig = yaml.safe_load((out / f"{component}.conf").read_text())
        (cluster,) = kubeconfig["clusters"]
        assert cluster["cluster"]["server"] == f"https://{ADVERTISE}:{DOCUMENTED[topology]['client-port']}"


def test_a_strategic_merge_patch_of_the_command_is_caught_dropping_kubeadms_flags(kubeadm: Path,
                                                                                   tmp_path: Path) -> None:
    """What the checks above catch: a strategic-merge patch of ``command:`` replaces kubeadm's whole list."""
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "kube-apiserver+strategic.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kube-apiserver", "namespace": "kube-system"},
        "spec": {"containers": [{"name": "kube-apiserver",
                                 "command": ["kube-apiserver", "--secure-port=6444"]}]}}))
    baseline = flags(render_apiserver(kubeadm, tmp_path / "baseline", extra_args=[], pki=tmp_path / "pki"))
    patched = flags(render_apiserver(kubeadm, tmp_path / "patched", extra_args=[], patches=patches,
                                     pki=tmp_path / "pki"))
    assert patched == {"secure-port": "6444"} and len(baseline) == 27


# -- the rendered apiserver, started ----------------------------------------------------------------------------

SAME_NAMES = ("ca", "apiserver", "front-proxy-ca", "front-proxy-client")
"""Sandbox certificates whose file names are kubeadm's already."""


def kubeadm_pki(sandbox: SandboxState, into: Path) -> Path:
    """The sandbox's certificates under kubeadm's file names (plus the kubelet client pair kubeadm expects)."""
    src = SandboxPKI(Path(sandbox.certs_dir))
    into.mkdir(parents=True)
    for stem in SAME_NAMES:
        for suffix in (".crt", ".key"):
            if (src.dir / f"{stem}{suffix}").exists():
                shutil.copy(src.dir / f"{stem}{suffix}", into / f"{stem}{suffix}")
    shutil.copy(src.sa_key, into / "sa.key")
    shutil.copy(src.sa_pub, into / "sa.pub")
    PKI(into).issue_client("apiserver-kubelet-client", user="kube-apiserver-kubelet-client",
                           groups=("kubeadm:cluster-admins",))
    return into


def readyz(url: str, pki: SandboxPKI) -> tuple[bool, str]:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.load_cert_chain(str(pki.crt("admin")), str(pki.key("admin")))
    try:
        with urllib.request.urlopen(f"{url}/readyz", context=ctx, timeout=5) as r:
            return r.status == 200, r.read().decode()[:200]
    except OSError as exc:
        return False, str(exc)


@contextlib.contextmanager
def started(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.mark.sandbox
@pytest.mark.parametrize("topology", ["a", "b"])
def test_the_rendered_apiserver_starts_against_the_sandboxs_etcd_with_its_certificates(
        kubeadm: Path, own_sandbox: Any, tmp_path: Path, topology: str) -> None:
    sandbox: SandboxState = own_sandbox(tmp_path / "sb", "--apiservers", "1", "--timeout", "300")
    try:
        port = processes.free_port()
        extra = documented_change(topology)
        patches = None
        if topology == "b":  # the documented :6444 may be taken on a shared machine: the same change, another port
            extra = [{"name": a["name"], "value": str(port) if a["name"] == "secure-port" else a["value"]}
                     for a in extra]
            patches = tmp_path / "patches"
            patches.mkdir()
            text = (KUBEADM_DIR / "patches" / "kube-apiserver+json.yaml").read_text()
            (patches / "kube-apiserver+json.yaml").write_text(text.replace("value: 6444", f"value: {port}"))
        # Loopback only (kubeadm leaves --bind-address unset: all interfaces).
        extra = [*extra, {"name": "bind-address", "value": "127.0.0.1"}]
        work = tmp_path / "render"
        work.mkdir()
        pod = render_apiserver(kubeadm, work, extra_args=extra, patches=patches, pki=kubeadm_pki(sandbox, work / "pki"),
                               bind_port=port if topology == "a" else processes.free_port(),
                               etcd={"external": {"endpoints": [sandbox.extra["etcd_url"]]}})
        rendered = flags(pod)
        assert rendered["endpoint-reconciler-type"] == "none" and probe_port(pod) == port
        assert rendered["etcd-servers"] == sandbox.extra["etcd_url"]
        argv = [str(installed().kube_apiserver), *pod["spec"]["containers"][0]["command"][1:]]
        url = f"https://127.0.0.1:{port}"
        pki = SandboxPKI(Path(sandbox.certs_dir))
        with started(argv, tmp_path / "kube-apiserver.log") as proc:
            deadline = time.monotonic() + 180
            ok, detail = readyz(url, pki)
            while not ok:
                assert proc.poll() is None, (tmp_path / "kube-apiserver.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"not ready after 180s: {detail}"
                time.sleep(1)
                ok, detail = readyz(url, pki)
            # It serves the sandbox's objects (same etcd) and authenticates the sandbox's admin certificate.
            ctx = ssl.create_default_context(cafile=str(pki.ca))
            ctx.load_cert_chain(str(pki.crt("admin")), str(pki.key("admin")))
            with urllib.request.urlopen(f"{url}/api/v1/namespaces/kube-system", context=ctx, timeout=10) as r:
                assert b'"name":"kube-system"' in r.read()
    finally:
        run_down(tmp_path / "sb")
