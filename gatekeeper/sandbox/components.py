"""Command lines of the control-plane processes (pure: paths and ports in, argv out).

Kept free of I/O so the flags that make several apiservers coexist, and the
front-proxy trust settings the proxy relies on, are unit-tested without
starting anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gatekeeper.sandbox.pki import FRONT_PROXY_CLIENT, SERVICE_CIDR, SandboxPKI

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMISSION_PLUGINS = ("NodeRestriction", "MutatingAdmissionWebhook", "ValidatingAdmissionWebhook")
"""Added to kube-apiserver's default-on set (which already holds the two webhook plugins; they are named
so the dependency is visible). The default set is not spelled out: it changes between releases."""
KWOK_NODE_SELECTOR = "kwok.x-k8s.io/node=fake"
NODE_LEASE_SECONDS = 40
EXEC_NAMESPACE = "sandbox-exec"
"""Pods in this namespace accept ``kubectl exec``; KWOK runs the command on the host (see ``kwok_exec_config``)."""


@dataclass(frozen=True)
class Layout:
    """Where one sandbox keeps its files."""

    dir: Path

    @property
    def pki(self) -> SandboxPKI:
        return SandboxPKI(self.dir / "certs")

    @property
    def etcd_data(self) -> Path:
        return self.dir / "etcd-data"

    def log(self, name: str) -> Path:
        return self.dir / "logs" / f"{name}.log"

    def workdir(self, name: str) -> Path:
        return self.dir / "run" / name

    @property
    def kwok_exec_config(self) -> Path:
        return self.dir / "kwok-exec.yaml"

    def kubeconfig(self, client: str) -> Path:
        """``kubeconfig`` for the admin on apiserver 1, ``<client>.kubeconfig`` otherwise."""
        return self.dir / ("kubeconfig" if client == "admin" else f"{client}.kubeconfig")


def etcd_argv(binary: Path, layout: Layout, client_port: int, peer_port: int,
              extra: tuple[str, ...] = ()) -> list[str]:
    """Single-member etcd on loopback, plain HTTP: nothing but local processes can reach it."""
    peer = f"http://127.0.0.1:{peer_port}"
    client = f"http://127.0.0.1:{client_port}"
    return [
        str(binary),
        "--name=sandbox",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=sandbox={peer}",
        "--initial-cluster-state=new",
        "--log-level=warn",
        *extra,
    ]


def apiserver_argv(
    binary: Path, layout: Layout, *, index: int, port: int, etcd_url: str, node_lifecycle: bool,
    admission_config: Path | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """One of N kube-apiservers sharing etcd, the client CA and the service-account keys.

    ``--endpoint-reconciler-type=none``: the default lease reconciler would have the
    instances fight over the ``kubernetes`` Endpoints with loopback addresses.
    ``TaintNodesByCondition`` taints new nodes not-ready until node-lifecycle clears
    it, so it is disabled when no controller manager runs (``node_lifecycle=False``).
    """
    pki = layout.pki
    argv = [
        str(binary),
        f"--etcd-servers={etcd_url}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={layout.workdir(f'kube-apiserver-{index}')}",
        f"--tls-cert-file={pki.crt('apiserver')}",
        f"--tls-private-key-file={pki.key('apiserver')}",
        f"--client-ca-file={pki.ca}",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        f"--requestheader-client-ca-file={pki.front_proxy_ca}",
        f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pki.crt(FRONT_PROXY_CLIENT)}",
        f"--proxy-client-key-file={pki.key(FRONT_PROXY_CLIENT)}",
        "--endpoint-reconciler-type=none",
        "--authorization-mode=Node,RBAC",
        f"--enable-admission-plugins={','.join(ADMISSION_PLUGINS)}",
        "--runtime-config=resource.k8s.io/v1=true",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--allow-privileged=true",
        "--profiling=false",
        # KWOK's server plays the kubelets (exec/logs): dialled at the node's InternalIP, its
        # certificate verified against the sandbox CA.
        "--kubelet-preferred-address-types=InternalIP",
        f"--kubelet-certificate-authority={pki.ca}",
    ]
    if not node_lifecycle:
        argv.append("--disable-admission-plugins=TaintNodesByCondition")
    if admission_config is not None:  # client certificate towards webhooks (sandbox/webhook_client.py)
        argv.append(f"--admission-control-config-file={admission_config}")
    argv.extend(extra)
    return argv


def _component_common(layout: Layout, client: str, port: int) -> list[str]:
    kc = layout.kubeconfig(client)
    pki = layout.pki
    return [
        f"--kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--tls-cert-file={pki.crt('components-serving')}",
        f"--tls-private-key-file={pki.key('components-serving')}",
        # One instance each: leader election would only add seconds to startup.
        "--leader-elect=false",
    ]


def scheduler_argv(binary: Path, layout: Layout, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [str(binary), *_component_common(layout, "kube-scheduler", port), *extra]


def controller_manager_argv(binary: Path, layout: Layout, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    """All default controllers, incl. resourceclaim-controller, node-lifecycle, GC, SA tokens, namespaces."""
    pki = layout.pki
    return [
        str(binary),
        *_component_common(layout, "kube-controller-manager", port),
        "--controllers=*",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki.sa_key}",
        f"--root-ca-file={pki.ca}",
        f"--cluster-signing-cert-file={pki.ca}",
        f"--cluster-signing-key-file={pki.crt('ca').with_suffix('.key')}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--allocate-node-cidrs=false",
        *extra,
    ]


def kwok_exec_config(namespace: str = EXEC_NAMESPACE) -> dict[str, object]:
    """A KWOK ``ClusterExec``: ``kubectl exec`` into pods of ``namespace`` runs the command locally.

    KWOK pods have no containers, so KWOK's server (playing the kubelet the apiserver
    dials) runs the exec'd argv as a host process of the kwok user. Only one
    namespace is opted in, so an exec elsewhere still fails as it would on a node
    without a runtime, and only tests that mean to run local commands do.
    """
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "ClusterExec",
        "metadata": {"name": "sandbox-local-exec"},
        "spec": {"selector": {"matchNamespaces": [namespace]}, "execs": [{"local": {}}]},
    }


def kwok_argv(binary: Path, layout: Layout, stages: Path, port: int) -> list[str]:
    """KWOK with its default stages, managing only nodes annotated as fake, renewing node leases.

    Its server also plays every node's kubelet for exec/attach/logs/port-forward:
    nodes advertise ``127.0.0.1:<port>`` (``--node-ip``/``--node-port`` feed the
    node stages' ``status.addresses`` and ``daemonEndpoints``), and it serves TLS
    from the sandbox CA there (plain HTTP still answers ``/healthz`` on the same
    port), because the apiserver only speaks HTTPS to kubelets.
    """
    pki = layout.pki
    return [
        str(binary),
        f"--kubeconfig={layout.kubeconfig('kwok')}",
        f"--config={stages},{layout.kwok_exec_config}",
        f"--manage-nodes-with-annotation-selector={KWOK_NODE_SELECTOR}",
        f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
        f"--server-address=127.0.0.1:{port}",
        "--node-ip=127.0.0.1",
        f"--node-port={port}",
        f"--tls-cert-file={pki.crt('components-serving')}",
        f"--tls-private-key-file={pki.key('components-serving')}",
    ]
