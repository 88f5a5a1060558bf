"""Certificates and kubeconfigs for one sandbox, laid out in ``DIR/certs``.

Identities follow what kubeadm does, so the bootstrap RBAC roles just work:
``system:kube-scheduler`` and ``system:kube-controller-manager`` are users the
apiserver already has bindings for; the admin is in ``system:masters``. KWOK
plays every kubelet at once (node status, leases, pod status), so it is given
``system:masters`` too rather than one node identity per fake node.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

import yaml

from gatekeeper.certs.pki import CLUSTER_CA, FRONT_PROXY_CA, PKI

SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
APISERVER_DNS = (
    "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)

CLIENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "admin": ("sandbox-admin", ("system:masters",)),
    "kube-scheduler": ("system:kube-scheduler", ()),
    "kube-controller-manager": ("system:kube-controller-manager", ()),
    "kwok": ("kwok-controller", ("system:masters",)),
}
"""Client certificate file stem -> (user, groups), all signed by the cluster CA."""

FRONT_PROXY_CLIENT = "front-proxy-client"
"""CN the apiservers accept via ``--requestheader-allowed-names``; signed by the front-proxy CA."""


@dataclass(frozen=True)
class SandboxPKI:
    """Paths of the material ``up`` hands to the processes."""

    dir: Path

    def crt(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    @property
    def ca(self) -> Path:
        return self.crt(CLUSTER_CA)

    @property
    def front_proxy_ca(self) -> Path:
        return self.crt(FRONT_PROXY_CA)

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"


def create(directory: Path) -> SandboxPKI:
    """CAs are kept if present (so handed-out kubeconfigs stay valid); leaves are reissued."""
    pki = PKI(directory)
    pki.init()
    pki.issue_serving(
        "apiserver", dns=APISERVER_DNS, ips=("127.0.0.1", "::1", KUBERNETES_SERVICE_IP), days=365,
    )
    # One serving cert for the scheduler's and controller-manager's secure ports and for KWOK's
    # kubelet endpoint (exec), so /healthz and the apiserver's kubelet dial are verified for real.
    pki.issue_serving("components-serving", dns=("localhost",), ips=("127.0.0.1",))
    for stem, (user, groups) in CLIENTS.items():
        pki.issue_client(stem, user=user, groups=groups)
    pki.issue_client(FRONT_PROXY_CLIENT, user=FRONT_PROXY_CLIENT, ca=FRONT_PROXY_CA)
    return SandboxPKI(Path(directory))


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig(server: str, ca: Path, cert: Path, key: Path, *, name: str = "sandbox") -> dict[str, object]:
    """A self-contained kubeconfig (certificates embedded), so it keeps working if copied elsewhere."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority-data": _b64(ca)}}],
        "users": [{"name": name, "user": {
            "client-certificate-data": _b64(cert), "client-key-data": _b64(key),
        }}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
        "preferences": {},
    }


def write_kubeconfig(path: Path, pki: SandboxPKI, client: str, server: str) -> Path:
    data = kubeconfig(server, pki.ca, pki.crt(client), pki.key(client))
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    path.chmod(0o600)
    return path
