"""The ``default/kubernetes`` Service's endpoints as the fleet publishes them: the live proxies' advertised addresses.

Pure: adverts in, objects and writes out. kube-apiserver's lease reconciler writes one Endpoints subset (its
instances' IPs, its own port) and one EndpointSlice named ``kubernetes`` mirrored from it; proxies may differ in
port (a fleet moving from topology A's :8443 to B's :6443 node by node) and an EndpointSlice holds one port set and
one address family, so there is one slice per (family, port): ``kubernetes`` for the first, ``kubernetes-<family>-
<port>`` for the others, and one Endpoints subset per port. Like upstream, an empty set is never written: with no
advert left the last set stays (see docs/install/troubleshooting.md, "No proxy is alive").
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gatekeeper.kube.objects import Endpoints, EndpointSlice

SERVICE = "kubernetes"
NAMESPACE = "default"
PORT_NAME = "https"
"""kube-apiserver's name for the port; kube-proxy matches the Service's port to the endpoints' by it."""
ADDRESS_ANNOTATION = "gatekeeper.dev/advertise-address"
PORT_ANNOTATION = "gatekeeper.dev/advertise-port"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY = "proxy-fleet.gatekeeper.dev"
"""A label value (no slash), after the controllers' own: ``endpointslice-controller.k8s.io``."""
SKIP_MIRROR_LABEL = "endpointslice.kubernetes.io/skip-mirror"
"""On the Endpoints: the mirroring controller leaves it alone (upstream's reconciler sets it too)."""


@dataclass(frozen=True, order=True)
class Advert:
    """Where in-cluster callers reach one proxy."""

    address: str
    port: int

    @property
    def family(self) -> Literal["IPv4", "IPv6"]:
        return "IPv6" if ipaddress.ip_address(self.address).version == 6 else "IPv4"

    def annotations(self) -> dict[str, str]:
        return {ADDRESS_ANNOTATION: self.address, PORT_ANNOTATION: str(self.port)}

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if self.family == "IPv6" else f"{self.address}:{self.port}"


def parse_advert(annotations: Mapping[str, Any] | None) -> Advert | None:
    """A Lease's advert, or None when it has none or a malformed one (another writer's mistake is not ours)."""
    if not isinstance(annotations, Mapping):
        return None
    address, port = annotations.get(ADDRESS_ANNOTATION), annotations.get(PORT_ANNOTATION)
    if not isinstance(address, str) or not isinstance(port, str) or not port.isdigit():
        return None
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast or not 0 < int(port) < 65536:
        return None
    return Advert(str(ip), int(port))


def adverts_of(leases: Iterable[Mapping[str, Any]]) -> dict[str, Advert]:
    """holderIdentity -> advert, from the items of a fleet LeaseList."""
    out: dict[str, Advert] = {}
    for item in leases:
        if not isinstance(item, Mapping):
            continue
        meta, spec = item.get("metadata"), item.get("spec")
        holder = spec.get("holderIdentity") if isinstance(spec, Mapping) else None
        advert = parse_advert(meta.get("annotations") if isinstance(meta, Mapping) else None)
        if isinstance(holder, str) and holder and advert is not None:
            out[holder] = advert
    return out


# -- desired objects ------------------------------------------------------------------------------------------

def groups(adverts: Iterable[Advert]) -> dict[tuple[str, int], tuple[str, ...]]:
    """(family, port) -> sorted addresses, IPv4 first, then by port."""
    out: dict[tuple[str, int], set[str]] = {}
    for a in adverts:
        out.setdefault((a.family, a.port), set()).add(a.address)
    return {key: tuple(sorted(out[key], key=ipaddress.ip_address)) for key in sorted(out)}


def slice_name(index: int, family: str, port: int) -> str:
    return SERVICE if index == 0 else f"{SERVICE}-{family.lower()}-{port}"


def desired_slices(adverts: Iterable[Advert]) -> dict[str, EndpointSlice]:
    """name -> the EndpointSlice the fleet wants (empty for no adverts: nothing is ever erased)."""
    out: dict[str, EndpointSlice] = {}
    for i, ((family, port), addresses) in enumerate(groups(adverts).items()):
        name = slice_name(i, family, port)
        out[name] = {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": NAMESPACE,
                         "labels": {SERVICE_NAME_LABEL: SERVICE, MANAGED_BY_LABEL: MANAGED_BY}},
            "addressType": family,
            "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses],
            "ports": [{"name": PORT_NAME, "port": port, "protocol": "TCP"}],
        }
    return out


def desired_endpoints(adverts: Iterable[Advert]) -> Endpoints:
    subsets: dict[int, set[str]] = {}
    for a in adverts:
        subsets.setdefault(a.port, set()).add(a.address)
    return {
        "apiVersion": "v1", "kind": "Endpoints",
        "metadata": {"name": SERVICE, "namespace": NAMESPACE, "labels": {SKIP_MIRROR_LABEL: "true"}},
        "subsets": [{"addresses": [{"ip": ip} for ip in sorted(subsets[port], key=ipaddress.ip_address)],
                     "ports": [{"name": PORT_NAME, "port": port, "protocol": "TCP"}]} for port in sorted(subsets)],
    }


# -- comparing with what is there ------------------------------------------------------------------------------

def _slice_shape(s: Mapping[str, Any]) -> tuple[Any, ...]:
    labels = (s.get("metadata") or {}).get("labels") or {}
    endpoints = sorted((tuple(e.get("addresses") or ()), bool((e.get("conditions") or {}).get("ready", True)))
                       for e in s.get("endpoints") or ())
    ports = sorted((p.get("name") or "", p.get("port"), p.get("protocol") or "TCP") for p in s.get("ports") or ())
    return (s.get("addressType"), tuple(endpoints), tuple(ports),
            labels.get(SERVICE_NAME_LABEL), labels.get(MANAGED_BY_LABEL))


def _endpoints_shape(e: Mapping[str, Any]) -> tuple[Any, ...]:
    labels = (e.get("metadata") or {}).get("labels") or {}
    subsets = sorted((tuple(sorted(a.get("ip") or "" for a in sub.get("addresses") or ())),
                      tuple(sorted((p.get("name") or "", p.get("port"), p.get("protocol") or "TCP")
                                   for p in sub.get("ports") or ())),
                      bool(sub.get("notReadyAddresses")))
                     for sub in e.get("subsets") or ())
    return tuple(subsets), labels.get(SKIP_MIRROR_LABEL)


@dataclass(frozen=True)
class Write:
    """One call that brings the cluster to the fleet's set."""

    op: Literal["create", "update", "delete"]
    kind: Literal["EndpointSlice", "Endpoints"]
    name: str
    body: Mapping[str, Any] | None = None
    """For update: the object as read (its resourceVersion is the precondition) with the desired content."""


def plan(adverts: Iterable[Advert], slices: Iterable[Mapping[str, Any]],
         endpoints: Mapping[str, Any] | None) -> list[Write]:
    """The writes from the current slices (those labelled for the Service) and Endpoints (None: absent) to the set
    of ``adverts``; none when the set is empty. A slice whose address family changed is deleted and created
    (addressType is immutable); other services' or other managers' slices are never touched."""
    adverts = list(adverts)
    if not adverts:
        return []
    want = desired_slices(adverts)
    have = {str((s.get("metadata") or {}).get("name")): s for s in slices}
    out: list[Write] = []
    for name, body in want.items():
        current = have.get(name)
        if current is None:
            out.append(Write("create", "EndpointSlice", name, body))
        elif current.get("addressType") != body["addressType"]:
            out += [Write("delete", "EndpointSlice", name), Write("create", "EndpointSlice", name, body)]
        elif _slice_shape(current) != _slice_shape(body):
            out.append(Write("update", "EndpointSlice", name, _replace(current, body)))
    for name, current in have.items():
        labels = (current.get("metadata") or {}).get("labels") or {}
        if name not in want and labels.get(MANAGED_BY_LABEL) == MANAGED_BY:
            out.append(Write("delete", "EndpointSlice", name))
    wanted = desired_endpoints(adverts)
    if endpoints is None:
        out.append(Write("create", "Endpoints", SERVICE, wanted))
    elif _endpoints_shape(endpoints) != _endpoints_shape(wanted):
        out.append(Write("update", "Endpoints", SERVICE, _replace(endpoints, wanted)))
    return out


def _replace(current: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """``wanted``'s content with ``current``'s metadata (resourceVersion, uid, other labels and annotations)."""
    meta = dict(current.get("metadata") or {})
    meta["labels"] = {**(meta.get("labels") or {}), **(wanted.get("metadata") or {}).get("labels", {})}
    return {**{k: v for k, v in current.items() if k not in ("endpoints", "ports", "subsets")},
            **{k: v for k, v in wanted.items() if k != "metadata"}, "metadata": meta}


def published(slices: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """The ``address:port`` pairs the Service's slices hold, sorted (what in-cluster callers resolve to)."""
    out = []
    for s in slices:
        ports = [p.get("port") for p in s.get("ports") or () if p.get("name") == PORT_NAME]
        for e in s.get("endpoints") or ():
            if (e.get("conditions") or {}).get("ready", True):
                out += [_shown(a, int(p)) for a in e.get("addresses") or () for p in ports if p]
    return tuple(sorted(out))


def _shown(address: str, port: int) -> str:
    try:
        return str(Advert(address, port))
    except ValueError:  # an FQDN slice someone else wrote
        return f"{address}:{port}"
