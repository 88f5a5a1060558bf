"""Where an in-cluster caller of the sandbox lands: the part a node network and kube-proxy play in a cluster.

A pod's client connects to ``KUBERNETES_SERVICE_HOST`` (the ``kubernetes`` Service's ClusterIP); kube-proxy sends
the connection to one of the addresses in the Service's EndpointSlices. The sandbox has no pods, nodes or
kube-proxy, and binds only loopback, while the API refuses loopback addresses in endpoints: so its proxies
advertise TEST-NET-1 node addresses (``with_proxy.node_address``) and this module maps them back to 127.0.0.1,
keeping the advertised port. Nothing else is translated: an address the sandbox did not hand out (an apiserver's,
or a stale one) resolves to no target, as it would be unreachable from a pod too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gatekeeper.sandbox import kubectl
from gatekeeper.sandbox.state import SandboxState

SELECTOR = "kubernetes.io/service-name=kubernetes"


@dataclass(frozen=True)
class Target:
    """One endpoint of the kubernetes Service and where the sandbox's node network delivers it."""

    address: str
    port: int
    host: str | None
    """127.0.0.1 for a node address the sandbox handed out; None: unreachable."""

    @property
    def url(self) -> str | None:
        return f"https://{self.host}:{self.port}" if self.host else None


def kubernetes_service_targets(state: SandboxState) -> list[Target]:
    """The ready endpoints of the ``default/kubernetes`` EndpointSlices, in order, with their sandbox targets."""
    p = kubectl.run(state.kubeconfig, "get", "endpointslices", "-n", "default", "-l", SELECTOR, "-o", "json",
                    binary=str(state.extra.get("kubectl") or "kubectl"), check=True)
    nodes: dict[str, str] = state.extra.get("node_addresses") or {}
    out = []
    for item in json.loads(p.stdout).get("items") or []:
        ports = [int(x["port"]) for x in item.get("ports") or [] if x.get("name") == "https" and x.get("port")]
        for endpoint in item.get("endpoints") or []:
            if not (endpoint.get("conditions") or {}).get("ready", True):
                continue
            out += [Target(a, port, nodes.get(a)) for a in endpoint.get("addresses") or [] for port in ports]
    return sorted(out, key=lambda t: (t.address, t.port))
