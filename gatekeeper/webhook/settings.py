"""Typed ``webhook:`` section of the gatekeeper config file.

Defaults and why (docs/webhook/ repeats this):

* ``secrets.hardLimit: 128Ki`` -- the seeds' incident was 5,000 Secrets of
  ~0.2 MB (~195 KiB) each; a LIST of them pulled ~1 GB into the apiserver.
  128 KiB denies those outright (they are ~1.5x the limit before counting the
  ``last-applied-configuration`` copy, ~3x with it) while leaving a wide
  margin over what Secrets are for: TLS pairs (2-8 KiB), dockerconfigjson and
  tokens (<4 KiB), even a cert chain plus a private CA bundle (~20-50 KiB).
  Helm release Secrets (up to ~1 MiB) get an explicit per-type override.
* ``secrets.softLimit: 32Ki`` -- warn early (still 4x the usual TLS Secret)
  so teams move payloads out before they hit the wall.
* ``secrets.countAnnotations: true`` -- ``kubectl apply`` stores the whole
  object again in ``kubectl.kubernetes.io/last-applied-configuration``, so a
  Secret's stored (and LISTed) size is roughly twice its data.
* ``secrets.oversizedManagedFields: 4Ki`` -- an object already over the hard
  limit stays editable while it does not grow; the apiserver adds a
  managedFields entry (~150-300 bytes) per new field manager, so 4 KiB lets
  about a dozen controllers touch it, and bounds what clients can add there.
* ``gpu.defaultMode: off`` -- installing the webhook changes no pod until an
  operator picks a mode globally, per namespace, or per pod (annotation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

from gatekeeper.base.config import dataclass_section, parse_size, register_section
from gatekeeper.serving.listener import TLSListenerSettings
from gatekeeper.webhook.gpu.models import DEFAULT_MODELS, GpuModel, ModelError, parse_choice
from gatekeeper.webhook.gpu.sizing import MIG_CATALOG, layout_profiles, parse_quantity_bytes

Mode = Literal["dra", "shared", "shares", "first-available", "time-slicing", "mps", "mps-dra", "mig", "mig-dra",
               "off"]
MODES: tuple[str, ...] = get_args(Mode)
FALLBACK_WAYS: tuple[str, ...] = ("mig-dra", "shared", "shares", "mps-dra", "dra")
"""Modes a ``first-available`` claim may list: those that are a DRA device request (the device plugin's are not)."""
Kep5004 = Literal["rewrite", "step-aside"]
"""What ``dra`` mode does with a pod a KEP-5004 DeviceClass mapping could serve (see ``GpuSettings.kep5004``)."""
KEP5004_CHOICES: tuple[str, ...] = get_args(Kep5004)

ANNOTATION_PREFIX = "gatekeeper.dev/"
"""Project-owned annotation prefix on pods (and the webhook names' suffix)."""
MODE_ANNOTATION = ANNOTATION_PREFIX + "gpu-mode"
"""Pod annotation selecting the GPU mode; ``off`` leaves the pod alone."""
MEMORY_ANNOTATION = ANNOTATION_PREFIX + "gpu-memory"
"""Pod annotation with the GPU memory each GPU container needs (shared and mig modes), e.g. ``20Gi``."""
DECISION_ANNOTATION = ANNOTATION_PREFIX + "gpu-decision"
"""Set on rewritten pods: the mode and what chose it (annotation, namespace, default, enforced)."""
REWRITTEN_ANNOTATION = ANNOTATION_PREFIX + "gpu-rewritten"
"""Set on pods the webhook rewrote: what changed, for humans and for reinvocation."""
MODELS_ANNOTATION = ANNOTATION_PREFIX + "gpu-models"
"""Pod annotation naming the GPU models a pod may run on (``H100-80GB,A100-80GB``) or a minimum (``>=40Gi``)."""
FALLBACKS_ANNOTATION = ANNOTATION_PREFIX + "gpu-fallbacks"
"""Pod annotation: the ordered ways to serve the pod (``mig-dra,shared,dra``); implies gpu-mode first-available."""

def _size_of(key: str, value: int | str) -> int:
    """parse_size with the YAML key in the message (the loader reports the enclosing section)."""
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


@dataclass(frozen=True)
class ServerSettings(TLSListenerSettings):
    """The HTTPS listener the apiserver calls (/validate, /mutate, /healthz, /readyz, /metrics)."""

    tls_required_because: ClassVar[str] = "the apiserver only calls webhooks over TLS"

    port: int = 8443
    """TLS port for /validate, /mutate, /healthz, /readyz and /metrics (0 = pick a free port)."""
    workers: int = 1
    """Processes sharing the port with SO_REUSEPORT (``--workers`` overrides)."""
    port_file: str = ""
    """If set, the bound port is written here once listening (for port 0 and scripts)."""
    max_body_bytes: int = 6 * 1024 * 1024 + 64 * 1024
    """Largest review accepted (413 above): an UPDATE carries object and oldObject, each at most the
    apiserver's 3 MiB request limit (etcd's own default is 1.5 MiB), plus the review envelope."""
    max_buffered_body_bytes: int = 64 * 1024 * 1024
    """Review bodies this worker reads and parses at once (declared Content-Length, else maxBodyBytes each);
    a review that would pass it gets 503 before its body is read. Ten of the largest reviews, thousands of
    usual ones; without it, maxConnections slow senders could hold maxConnections x maxBodyBytes."""
    max_buffered_body_caller_share: float = 0.25
    """Fraction of maxBufferedBodyBytes one unverified caller (one peer IP) may hold at once (never less than
    maxBodyBytes); over it that caller gets 503, so one pod's slow bodies cannot take the budget the
    apiserver's reviews need. Verified apiservers (clientCaFile) are not limited by it; 1 turns it off."""
    client_ca_file: str = ""
    """CA (PEM) of the apiserver's webhook client certificate. Set: callers without a certificate
    from it, or with a name not in ``allowedClientNames``, get 403 on /validate and /mutate."""
    allowed_client_names: list[str] = field(default_factory=list)
    """Client certificate CN or DNS SANs accepted as the apiserver (required with clientCaFile)."""
    max_header_fields: int = 32
    """Header fields in one request head; more get 400 (aiohttp's own limit was 128). The apiserver sends about
    ten. A head that never ends is held until ``idleTimeoutSeconds``, at about 2.5x its bytes: measured, 200
    connections of 127 fields of 8 KB took a worker from 53 to 559 MiB, so one pod could OOM the (then) 512 MiB pod."""
    max_header_field_bytes: int = 8190
    """Bytes of one header field (name and value) and of the request line; more get 400. aiohttp's default, room
    for a bearer token or a mesh's client-certificate header. A connection's unfinished head holds at most about
    3 x maxHeaderFields x maxHeaderFieldBytes (~750 KiB at the defaults); all of them together are held to
    ``maxBufferedRequestBytes``."""
    max_buffered_request_bytes: int = 8 * 1024 * 1024
    """Request bytes this worker's HTTP layer holds before any review reads them, all connections together:
    unfinished heads, the heads of requests not answered yet (queued behind a pipelined request or being answered)
    and the bodies of queued requests. Over it the connection holding the most is closed (counted as
    ``request-budget``). The parsed heads take about 3x their bytes of memory; without it, ``maxConnections``
    unfinished heads took a worker to 794 MiB (measured), 25 clients pipelining fat heads to 412 MiB. 8 MiB is
    8 KiB per connection at ``maxConnections`` 1000: an apiserver's head (~1 KiB) is never the largest holder."""
    socket_receive_buffer_bytes: int = 16 * 1024
    """SO_RCVBUF of the webhook's connections (the kernel doubles it; 0 = its autotuning, up to net.ipv4.tcp_rmem's
    6 MiB). One read hands the TLS layer all the kernel queued, and its buffers (uvloop's read buffer, OpenSSL's
    incoming BIO) keep the largest size they reached for the connection's life, out of any budget: measured
    (bench_webhook_worstcase.py fast-sender), 1000 connections writing a body faster than it was read held 650 KiB
    each, a worker at 680-720 MiB; 110-130 KiB (160-185 MiB) at 16 KiB, 210 KiB at 32 KiB, 425 KiB at 64 KiB. The cost
    is a window of ~16-24 KiB: about 20 MB/s per connection at 1 ms round trip, so the largest review (6 MiB) takes
    ~0.3 s more to arrive over such a link; the usual review (a few KiB) nothing. Large reviews cost more CPU in
    smaller reads: 200 KiB Secret reviews per server CPU-second, 3 interleaved rounds, 686 at 16 KiB, 815 at 32 KiB,
    939 at 64 KiB, 1098 with autotuning. The default buys the memory bound with that CPU (docs/webhook/hardening.md)."""
    max_connections: int = 1000
    """Open connections per worker process; a new one over it is closed after its TLS handshake, before any
    request is read (any pod can connect, and each open connection can hold up to ``maxBodyBytes``)."""
    tls_handshake_timeout_seconds: float = 10.0
    """A connection that has not finished its TLS handshake this long after accept is dropped."""
    idle_timeout_seconds: float = 120.0
    """A connection without a complete request head this long is closed: idle keep-alive connections and
    slowloris heads alike. Above the 90 s after which the apiserver's Go client closes its idle connections
    itself, so the apiserver, not the webhook, ends an idle connection and no request races the close."""
    body_timeout_seconds: float = 30.0
    """Time to receive a review's body once its head arrived (408 and close above). The apiserver waits at
    most 30 s for a webhook (``timeoutSeconds``); a body slower than that has no one waiting for it."""
    write_timeout_seconds: float = 30.0
    """Time a response may take to be written (the client reading it); past it the connection is aborted. The
    apiserver reads at once; a client that never reads would otherwise hold the connection forever."""
    shutdown_delay_seconds: float = 0.0
    """After SIGTERM, keep answering with /readyz false this long before closing the listener (outside
    Kubernetes; in a pod the preStop sleep plays this part)."""

    @property
    def max_buffered_body_bytes_per_caller(self) -> int:
        """maxBufferedBodyCallerShare in bytes; at least maxBodyBytes, so any caller can send the largest review."""
        return max(self.max_body_bytes, int(self.max_buffered_body_bytes * self.max_buffered_body_caller_share))

    def validate(self) -> None:
        super().validate()
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.shutdown_delay_seconds < 0:
            raise ValueError(f"shutdownDelaySeconds must be >= 0, got {self.shutdown_delay_seconds}")
        if self.max_connections < 1:
            raise ValueError(f"maxConnections must be >= 1, got {self.max_connections}")
        if self.socket_receive_buffer_bytes and not 4096 <= self.socket_receive_buffer_bytes <= 16 * 1024 * 1024:
            raise ValueError(f"socketReceiveBufferBytes must be 0 (the kernel's autotuning) or between 4096 and "
                             f"16777216, got {self.socket_receive_buffer_bytes}")
        if self.max_header_fields < 8:
            raise ValueError(f"maxHeaderFields must be >= 8 (the apiserver sends about ten), "
                             f"got {self.max_header_fields}")
        if self.max_header_field_bytes < 1024:
            raise ValueError(f"maxHeaderFieldBytes must be >= 1024, got {self.max_header_field_bytes}")
        largest_head = (self.max_header_fields + 1) * self.max_header_field_bytes  # request line and fields
        if self.max_buffered_request_bytes < largest_head:
            raise ValueError(f"maxBufferedRequestBytes ({self.max_buffered_request_bytes}) must be >= "
                             f"(maxHeaderFields + 1) x maxHeaderFieldBytes ({largest_head}), or the largest request "
                             "head the webhook accepts could never be received")
        for key, value in (("tlsHandshakeTimeoutSeconds", self.tls_handshake_timeout_seconds),
                           ("idleTimeoutSeconds", self.idle_timeout_seconds),
                           ("bodyTimeoutSeconds", self.body_timeout_seconds),
                           ("writeTimeoutSeconds", self.write_timeout_seconds)):
            if not value > 0:
                raise ValueError(f"{key} must be > 0 (seconds), got {value}")
        if self.max_body_bytes < 64 * 1024:
            raise ValueError(f"maxBodyBytes must be >= 65536 (a review envelope), got {self.max_body_bytes}")
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ValueError(f"maxBufferedBodyBytes ({self.max_buffered_body_bytes}) must be >= maxBodyBytes "
                             f"({self.max_body_bytes}), or the largest review could never be read")
        if not 0 < self.max_buffered_body_caller_share <= 1:
            raise ValueError(f"maxBufferedBodyCallerShare must be > 0 and <= 1 (a fraction of maxBufferedBodyBytes), "
                             f"got {self.max_buffered_body_caller_share}")
        if self.client_ca_file and not self.allowed_client_names:
            raise ValueError("clientCaFile is set but allowedClientNames is empty: name the apiserver's client "
                             "certificate (CN or DNS SAN), or any pod holding a certificate from that CA could "
                             "call the webhook")


@dataclass(frozen=True)
class SizeOverride:
    """Different limits for some namespaces and/or Secret types (first match wins)."""

    namespaces: list[str] = field(default_factory=list)
    """Namespaces this override applies to (empty = any)."""
    types: list[str] = field(default_factory=list)
    """Secret ``type`` values this override applies to, e.g. ``helm.sh/release.v1`` (empty = any). The creator
    writes the type, so anyone who may create Secrets where the override applies gets its limits."""
    hard_limit: int | str | None = None
    """Deny above this size (null = keep the global hard limit)."""
    soft_limit: int | str | None = None
    """Warn above this size (null = keep the global soft limit)."""

    def validate(self) -> None:
        if not self.namespaces and not self.types:
            raise ValueError("an override needs namespaces: and/or types: "
                             "(to change every object, change the global limits)")
        for key, v in (("hardLimit", self.hard_limit), ("softLimit", self.soft_limit)):
            if v is not None:
                _size_of(key, v)


@dataclass(frozen=True)
class SecretSettings:
    """Oversized Secret (and ConfigMap) policy, served on /validate."""

    enabled: bool = True
    """Apply the policy to Secrets."""
    hard_limit: int | str = "128Ki"
    """Deny CREATE/UPDATE above this many bytes (data/stringData keys, decoded data + stringData values, labels,
    finalizers and ownerReferences [+ annotations])."""
    soft_limit: int | str = "32Ki"
    """Allow with a warning above this many bytes."""
    count_annotations: bool = True
    """Count annotation keys and values (last-applied-configuration doubles the stored size)."""
    config_maps: bool = False
    """Apply the same limits to ConfigMaps (data + binaryData)."""
    overrides: list[SizeOverride] = field(default_factory=list)
    """Per-namespace / per-type limits; the first matching entry wins."""
    oversized_managed_fields: int | str = "4Ki"
    """On an UPDATE of an object already over its hard limit (allowed while it does not grow), how large its
    managedFields may become: the apiserver itself adds an entry (~150-300 bytes) for each new field manager, so a
    controller relabelling such an object was refused as growth. Everything else must still not grow, and
    managedFields already past this may not grow at all (an absolute bound, so repeated updates cannot ratchet)."""

    def validate(self) -> None:
        _size_of("oversizedManagedFields", self.oversized_managed_fields)
        hard, soft = _size_of("hardLimit", self.hard_limit), _size_of("softLimit", self.soft_limit)
        if soft > hard:
            raise ValueError(f"softLimit ({self.soft_limit}) must not exceed hardLimit ({self.hard_limit})")


@dataclass(frozen=True)
class MigPool:
    """A node pool running one GPU model in one MIG layout (device plugin, mixed strategy)."""

    name: str = ""
    """Shown in decisions and denials."""
    label_value: str = ""
    """Value of ``migPoolLabel`` on the pool's nodes, e.g. ``NVIDIA-A100-SXM4-40GB`` (GPU feature discovery)."""
    gpu_model: str = ""
    """Catalog model (see gpu.sizing.MIG_CATALOG), e.g. ``A100-40GB``."""
    layout: str = ""
    """MIG config the pool's nodes run (``all-balanced`` or ``all-<profile>``, NVIDIA mig-parted's names)."""
    profiles: list[str] = field(default_factory=list)
    """Profiles the pool's layout creates, when ``layout`` is not one of the known names."""

    def allowed(self) -> tuple[str, ...]:

        return tuple(self.profiles) if self.profiles else layout_profiles(self.gpu_model, self.layout)

    def validate(self) -> None:

        where = f"migPools[{self.name or '?'}]"
        if not self.name or not self.label_value:
            raise ValueError(f"{where}: name and labelValue are required (labelValue: the pool's node label value)")
        if self.gpu_model not in MIG_CATALOG:
            raise ValueError(f"{where}: gpuModel {self.gpu_model!r} is unknown; expected one of "
                             + ", ".join(MIG_CATALOG))
        if bool(self.layout) == bool(self.profiles):
            raise ValueError(f"{where}: set exactly one of layout (e.g. all-balanced) and profiles")
        try:
            allowed = self.allowed()
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        names = {p.name for p in MIG_CATALOG[self.gpu_model]}
        bad = [p for p in allowed if p not in names]
        if bad:
            raise ValueError(f"{where}: {', '.join(bad)} is not a {self.gpu_model} profile; expected some of "
                             + ", ".join(sorted(names)))


@dataclass(frozen=True)
class GpuSettings:
    """GPU pod rewrite policy, served on /mutate."""

    enabled: bool = True
    """Apply the policy to Pods."""
    default_mode: Mode = "off"
    """Mode when neither the pod annotation nor namespaceModes decides."""
    namespace_modes: dict[str, Mode] = field(default_factory=dict)
    """Per-namespace default mode."""
    enforced_namespaces: list[str] = field(default_factory=list)
    """Namespaces whose mode (namespaceModes, else defaultMode) a pod annotation cannot change: a
    conflicting ``gatekeeper.dev/gpu-mode`` annotation is denied, so the policy is not advisory."""
    opt_out_groups: list[str] = field(default_factory=list)
    """Groups whose members may still set a different mode by annotation in enforced namespaces."""
    device_class: str = "gpu.nvidia.com"
    """DeviceClass the DRA claims request."""
    match_attribute: str = "resource.kubernetes.io/pcieRoot"
    """Attribute all devices of a multi-GPU claim must share (topology alignment)."""
    align_up_to: int = 4
    """Largest claim that gets ``matchAttribute``: the GPUs under one root of the nodes (4 of 8 on
    the sandbox's and on common 8-GPU servers). Larger claims get no constraint, since none could hold."""
    shared_default_memory: str = ""
    """GPU memory a ``shared`` pod gets without a gpu-memory annotation (empty: such pods are denied)."""
    namespace_gpu_memory: dict[str, str] = field(default_factory=dict)
    """Per-namespace default GPU memory for ``shared`` pods, e.g. ``{inference: 16Gi}``."""
    time_slicing_resource: str = "nvidia.com/gpu.shared"
    """Extended resource the device plugin advertises for time-sliced GPUs (its ``renameByDefault`` name)."""
    mps_resource: str = "nvidia.com/gpu.mps"
    """Extended resource for MPS-shared GPUs: a different name from time-slicing (the device plugin's
    ``sharing.mps.resources[].rename``), or the scheduler could put a pod that expects MPS's memory
    limits onto a time-sliced GPU that has none."""
    mps_driver: str = "gpu.nvidia.com"
    """DRA driver that receives the opaque GpuConfig (mps-dra)."""
    mig_gpu_model: str = "A100-40GB"
    """GPU model whose MIG profiles the mig mode chooses from when no ``migPools`` are set, and the mig-dra
    mode always (dynamic MIG creates any of them; see gpu.sizing.MIG_CATALOG)."""
    mig_default_profile: str = ""
    """Profile used when a mig pod has no gpu-memory annotation (empty = deny such pods)."""
    mig_device_class: str = "mig.nvidia.com"
    """DeviceClass of MIG partitions (mig-dra): the NVIDIA DRA driver's, for dynamic MIG."""
    mig_profile_attribute: str = "gpu.nvidia.com/profile"
    """Device attribute (domain/name) holding a partition's MIG profile; mig-dra selects on it with CEL."""
    mig_pool_label: str = "nvidia.com/gpu.product"
    """Node label that tells the MIG pools apart (GPU feature discovery sets the product name)."""
    mig_pools: list[MigPool] = field(default_factory=list)
    """Node pools with their model and MIG layout; set, mig sizing picks only from their profiles and
    pins the pod to the pools that offer the chosen one. Empty: ``migGpuModel`` for every node, no pinning."""
    template_prefix: str = "gatekeeper-gpu"
    """Name prefix of the ResourceClaimTemplates the webhook keeps present."""
    template_cache_seconds: float = 300.0
    """How long a template known to exist is not re-checked."""
    template_reconcile_seconds: float = 30.0
    """How often the lifecycle loop re-creates deleted templates pods still use and collects unused
    ones (0 = off). Also bounds how long the admission cache can believe in a deleted template."""
    template_gc_grace_seconds: float = 600.0
    """How long a template of ours must go unreferenced by any pod (and unused by admission) before it
    is deleted: long enough that a Job's next pod or a rollout's next ReplicaSet finds it still there."""
    device_class_check_seconds: float = 10.0
    """How often the DeviceClasses are listed to see whether one maps ``nvidia.com/gpu`` (KEP-5004):
    a mapping added or removed changes what ``dra`` mode does within this time."""
    gpu_models: list[GpuModel] = field(default_factory=lambda: list(DEFAULT_MODELS))
    """GPU models pods may name (``gatekeeper.dev/gpu-models``): name, the product names the driver publishes
    (``productName``) and the memory of one GPU. Also the list a denial of an unknown model names, the largest
    GPU a memory ask is checked against, and what a HAMi ``gpumem-percentage`` is a percentage of."""
    product_attribute: str = "gpu.nvidia.com/productName"
    """Device attribute (domain/name) with the GPU's product name; model choice selects on it with CEL."""
    namespace_gpu_models: dict[str, str] = field(default_factory=dict)
    """Per-namespace default model choice, same form as the annotation, e.g. ``{training: '>=80Gi'}``."""
    shares_capacity: str = "gpu.nvidia.com/shares"
    """Device capacity (domain/name) a share count publishes (the NVIDIA driver's ``--consumable-shares=N``)."""
    shares_per_pod: int = 1
    """Shares of that capacity a ``shares`` pod's claim asks per GPU: with ``--consumable-shares=N``, N / this
    pods per GPU (the device plugin's time-slicing ``replicas``)."""
    fallbacks: list[str] = field(default_factory=lambda: ["mig-dra", "shared", "dra"])
    """``first-available`` ways, in order, for pods without a ``gatekeeper.dev/gpu-fallbacks`` annotation."""
    consumable_capacity: bool = True
    """The cluster runs DRAConsumableCapacity (beta, on in v1.37): claims select devices by
    ``device.allowMultipleAllocations``. False (the gate off: that CEL field does not exist there): no such
    selectors, and shared pods may again take exclusive GPUs whole."""
    hami_aliases: bool = True
    """Read HAMi's ``nvidia.com/gpumem``, ``gpumem-percentage`` and ``gpucores`` as a shared ask; where
    the mode would be the default ``off``, such pods get ``shared`` (without it nothing could schedule them once
    HAMi is gone). False: they are left as they are."""
    kep5004: Kep5004 = "rewrite"
    """``dra`` pods a KEP-5004 DeviceClass mapping could serve: ``rewrite`` them to our claim template anyway
    (default), or ``step-aside`` and leave them to the scheduler's own claim. Rewrite by default: in
    loadtest/reports/dra-scale (3 interleaved runs per path) both cost the scheduler the same memory and
    the KEP-5004 path bound pods x1.2 slower, so nothing argues for stepping aside, and one behaviour holds
    whether or not a cluster has the mapping. Only ``step-aside`` lists
    DeviceClasses (``deviceClassCheckSeconds``)."""

    def validate(self) -> None:

        if self.time_slicing_resource == self.mps_resource:
            raise ValueError(f"timeSlicingResource and mpsResource are both {self.mps_resource!r}: give them "
                             "different names (the device plugin's rename), so the scheduler can tell them apart")
        if self.kep5004 not in KEP5004_CHOICES:  # the YAML loader checks too; this covers settings built in code
            raise ValueError(f"kep5004 must be one of {', '.join(KEP5004_CHOICES)} (rewrite: dra pods get our "
                             f"claim template even where a DeviceClass maps nvidia.com/gpu), got {self.kep5004!r}")
        if self.align_up_to < 1:
            raise ValueError(f"alignUpTo must be >= 1 (1 = never align), got {self.align_up_to}")
        for key, value in [("sharedDefaultMemory", self.shared_default_memory),
                           *((f"namespaceGpuMemory.{ns}", v) for ns, v in self.namespace_gpu_memory.items())]:
            if value:
                try:
                    parse_quantity_bytes(value)
                except ValueError as exc:
                    raise ValueError(f"{key}: {exc}") from None

        self._validate_choices()
        if self.mig_gpu_model not in MIG_CATALOG:
            raise ValueError(f"migGpuModel {self.mig_gpu_model!r} is unknown; expected one of "
                             + ", ".join(MIG_CATALOG))
        if "/" not in self.mig_profile_attribute:
            raise ValueError(f"migProfileAttribute must be qualified (domain/name, e.g. gpu.nvidia.com/profile), "
                             f"got {self.mig_profile_attribute!r}")
        for pool in self.mig_pools:
            pool.validate()
        values = [p.label_value for p in self.mig_pools]
        if len(set(values)) != len(values) or len({p.name for p in self.mig_pools}) != len(values):
            raise ValueError("migPools: every pool needs its own name and labelValue")
        names = ({n for p in self.mig_pools for n in p.allowed()} if self.mig_pools
                 else {p.name for p in MIG_CATALOG[self.mig_gpu_model]})
        if self.mig_default_profile and self.mig_default_profile not in names:
            where = "any migPools layout" if self.mig_pools else f"a {self.mig_gpu_model} profile"
            raise ValueError(f"migDefaultProfile {self.mig_default_profile!r} is not {where}; "
                             f"expected one of {', '.join(sorted(names))}")


    def _validate_choices(self) -> None:
        """Models, namespace model defaults, shares and fallbacks: wrong ones fail at startup, not per pod."""
        if not self.gpu_models:
            raise ValueError("gpuModels must list at least one model (the default catalog is used when unset)")
        for m in self.gpu_models:
            m.validate()
        if len({m.name for m in self.gpu_models}) != len(self.gpu_models):
            raise ValueError("gpuModels: every model needs its own name")
        for key, attr in (("productAttribute", self.product_attribute), ("sharesCapacity", self.shares_capacity)):
            if "/" not in attr:
                raise ValueError(f"{key} must be qualified (domain/name, e.g. gpu.nvidia.com/productName), "
                                 f"got {attr!r}")
        for ns, text in self.namespace_gpu_models.items():
            try:
                parse_choice(text, self.gpu_models, f"namespaceGpuModels.{ns}")
            except ModelError as exc:
                raise ValueError(str(exc)) from None
        if not 1 <= self.shares_per_pod <= 1024:
            raise ValueError(f"sharesPerPod must be 1..1024, got {self.shares_per_pod}")
        bad = [w for w in self.fallbacks if w not in FALLBACK_WAYS]
        if bad or not self.fallbacks or len(set(self.fallbacks)) != len(self.fallbacks):
            raise ValueError(f"fallbacks must list distinct ways among {', '.join(FALLBACK_WAYS)}, got "
                             f"{', '.join(self.fallbacks) or 'none'}")


@dataclass(frozen=True)
class InventorySettings:
    """Per-GPU committed capacity exported on /metrics by one leader (webhook/inventory/)."""

    enabled: bool = True
    """Run the GPU inventory (needs list/watch of resourceslices and resourceclaims, and a Lease)."""
    lease_name: str = "gatekeeper-gpu-inventory"
    """Lease all webhook processes compete for; its holder alone watches and exports."""
    lease_namespace: str = ""
    """Namespace of the Lease ('' = the webhook's own, from its ServiceAccount; 'default' outside a cluster)."""
    lease_seconds: float = 15.0
    """How long a silent leader keeps the Lease before another process takes over (and a snapshot stays shown)."""
    renew_seconds: float = 5.0
    """How often the leader renews (and followers try)."""
    publish_seconds: float = 1.0
    """Least time between two recomputations of the per-GPU figures while claims change."""

    def validate(self) -> None:
        if not 0 < self.renew_seconds * 2 <= self.lease_seconds:
            raise ValueError(f"inventory: renewSeconds ({self.renew_seconds}) must be > 0 and at most half of "
                             f"leaseSeconds ({self.lease_seconds}), so a leader renews before it could be replaced")
        if not 0 < self.publish_seconds <= 60:
            raise ValueError(f"inventory: publishSeconds must be > 0 and <= 60, got {self.publish_seconds}")


@dataclass(frozen=True)
class WebhookSettings:
    """Root of the ``webhook:`` section."""

    server: ServerSettings = field(default_factory=ServerSettings)
    """HTTPS listener (certFile/keyFile are checked when the server starts)."""
    secrets: SecretSettings = field(default_factory=SecretSettings)
    """Oversized Secret policy."""
    gpu: GpuSettings = field(default_factory=GpuSettings)
    """GPU pod policy."""
    inventory: InventorySettings = field(default_factory=InventorySettings)
    """What is committed on each GPU, exported by one leader."""
    kubeconfig: str = ""
    """Kubeconfig for template reconciliation (empty = in-cluster service account)."""


register_section("webhook", dataclass_section(WebhookSettings))
