"""TypedDicts for the few Kubernetes object shapes gatekeeper reads or writes.

Only the fields we touch are declared (``total=False``): these document shape
for readers and mypy, they do not validate. Admission input is untrusted, so the
policies still check types at runtime where a wrong type would crash them.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class ObjectMeta(TypedDict, total=False):
    name: str
    generateName: str
    namespace: str
    labels: dict[str, str]
    annotations: dict[str, str]
    deletionTimestamp: str
    resourceVersion: str


class TypeMeta(TypedDict, total=False):
    apiVersion: str
    kind: str


class KubeObject(TypeMeta, total=False):
    metadata: ObjectMeta


class Secret(KubeObject, total=False):
    type: str
    data: dict[str, str]
    """base64-encoded values."""
    stringData: dict[str, str]
    """write-only plain values; the apiserver merges them into data (stringData wins)."""


class ConfigMap(KubeObject, total=False):
    data: dict[str, str]
    binaryData: dict[str, str]
    """base64-encoded values."""


class ResourceClaimRef(TypedDict):
    """Container ``resources.claims[]`` entry."""

    name: str
    request: NotRequired[str]


class ResourceRequirements(TypedDict, total=False):
    limits: dict[str, Any]
    requests: dict[str, Any]
    claims: list[ResourceClaimRef]


class Container(TypedDict, total=False):
    name: str
    image: str
    resources: ResourceRequirements
    restartPolicy: str
    """``Always`` on an init container makes it a sidecar."""


class PodResourceClaim(TypedDict, total=False):
    """Pod ``spec.resourceClaims[]`` entry."""

    name: str
    resourceClaimName: str
    resourceClaimTemplateName: str


class PodSpec(TypedDict, total=False):
    containers: list[Container]
    initContainers: list[Container]
    resourceClaims: list[PodResourceClaim]


class Pod(KubeObject, total=False):
    spec: PodSpec


class DeviceSelector(TypedDict, total=False):
    cel: dict[str, str]
    """``{"expression": "..."}``: a CEL expression over the device's attributes and capacity."""


class ExactDeviceRequest(TypedDict, total=False):
    deviceClassName: str
    allocationMode: str
    """``ExactCount`` (with ``count``) or ``All``."""
    count: int
    selectors: list[DeviceSelector]


class DeviceRequest(TypedDict, total=False):
    name: str
    exactly: ExactDeviceRequest


class DeviceConstraint(TypedDict, total=False):
    requests: list[str]
    matchAttribute: str


class OpaqueDeviceConfiguration(TypedDict):
    driver: str
    parameters: dict[str, Any]


class DeviceClaimConfiguration(TypedDict, total=False):
    requests: list[str]
    opaque: OpaqueDeviceConfiguration


class DeviceClaim(TypedDict, total=False):
    requests: list[DeviceRequest]
    constraints: list[DeviceConstraint]
    config: list[DeviceClaimConfiguration]


class ResourceClaimSpec(TypedDict, total=False):
    devices: DeviceClaim


class ResourceClaimTemplateSpec(TypedDict, total=False):
    metadata: ObjectMeta
    spec: ResourceClaimSpec


class ResourceClaimTemplate(TypedDict, total=False):
    """``resource.k8s.io/v1`` ResourceClaimTemplate."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: ResourceClaimTemplateSpec


class TokenReviewSpec(TypedDict, total=False):
    token: str
    audiences: list[str]


class TokenReviewUser(TypedDict, total=False):
    username: str
    uid: str
    groups: list[str]
    extra: dict[str, list[str]]


class TokenReviewStatus(TypedDict, total=False):
    authenticated: bool
    user: TokenReviewUser
    audiences: list[str]
    error: str


class TokenReview(TypeMeta, total=False):
    """``authentication.k8s.io/v1`` TokenReview: the proxy sends the spec and reads the status."""

    spec: TokenReviewSpec
    status: TokenReviewStatus


class LeaseSpec(TypedDict, total=False):
    holderIdentity: str
    leaseDurationSeconds: int
    renewTime: str
    """MicroTime: RFC 3339 with microseconds."""
    acquireTime: str
    leaseTransitions: int


class Lease(KubeObject, total=False):
    """``coordination.k8s.io/v1`` Lease, as the proxies of a fleet renew and list them."""

    spec: LeaseSpec


class EndpointPort(TypedDict):
    name: str
    port: int
    protocol: str


class EndpointAddress(TypedDict):
    ip: str


class EndpointSubset(TypedDict):
    addresses: list[EndpointAddress]
    ports: list[EndpointPort]


class Endpoints(KubeObject, total=False):
    """``v1`` Endpoints (deprecated since 1.33, still read by old clients), as the fleet writes ``kubernetes``."""

    subsets: list[EndpointSubset]


class EndpointConditions(TypedDict, total=False):
    ready: bool


class Endpoint(TypedDict, total=False):
    addresses: list[str]
    conditions: EndpointConditions


class EndpointSlice(KubeObject, total=False):
    """``discovery.k8s.io/v1`` EndpointSlice: one address family and one set of ports per slice."""

    addressType: str
    endpoints: list[Endpoint]
    ports: list[EndpointPort]
