"""Typed ``proxy.flowControl`` section. ``validate()`` does no I/O (``gatekeeper.proxy.settings.load_section``
reads ``files``), and a bad object stops the proxy at load as ``FILE: proxy.flowControl: FlowSchema/NAME: ...``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gatekeeper.proxy.pipeline.impersonation import ImpersonatorSettings
from gatekeeper.proxy.pipeline.tokens.settings import TokenSettings

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,200}[a-z0-9])?$")


@dataclass(frozen=True)
class FleetSettings:
    """Proxies in front of the same apiservers share every level's seats through Leases (``core/fleet.py``)."""

    enabled: bool = False
    """Off: each proxy holds the whole budget (one proxy, or a budget meant per proxy)."""
    name: str = "gatekeeper"
    """The fleet: Leases labelled ``gatekeeper.dev/fleet=<name>``; proxies with another name do not count."""
    namespace: str = "gatekeeper-system"
    """Where the Leases live. Only the proxies may write there (the chart's Role); no tenant may."""
    identity: str = ""
    """This proxy's name in the fleet and its Lease; empty: ``NODE_NAME``, ``POD_NAME``, else the host name."""
    lease_duration_seconds: float = 15.0
    """A proxy whose Lease has not been renewed this long is gone; the others take its share one TTL later."""
    renew_interval_seconds: float = 5.0
    """How often each proxy renews its Lease and lists the fleet's (at most a third of the duration)."""
    fallback_members: int = 3
    """A proxy that could not renew its Lease for a whole duration assumes at least this many proxies alive."""

    def validate(self) -> None:
        if not DNS_LABEL.match(self.name):
            raise ValueError(f"fleet.name: {self.name!r} is not a lower-case DNS name")
        if not DNS_LABEL.match(self.namespace) or "." in self.namespace or len(self.namespace) > 63:
            raise ValueError(f"fleet.namespace: {self.namespace!r} is not a namespace name")
        if self.identity and not DNS_LABEL.match(self.identity):
            raise ValueError(f"fleet.identity: {self.identity!r} must be a lower-case DNS name (it names a Lease)")
        if self.lease_duration_seconds <= 0 or self.renew_interval_seconds <= 0:
            raise ValueError("fleet.leaseDurationSeconds and renewIntervalSeconds must be positive")
        if self.renew_interval_seconds * 3 > self.lease_duration_seconds:
            raise ValueError("fleet.renewIntervalSeconds must be at most a third of leaseDurationSeconds, or one "
                             "late renewal makes a live proxy look gone")
        if self.fallback_members < 1:
            raise ValueError("fleet.fallbackMembers must be at least 1")


@dataclass(frozen=True)
class ExpensiveListSettings:
    """Expensive LISTs per apiserver: what lands on one apiserver, not the proxy's total, decides its memory."""

    max_in_flight_per_backend: int = 0
    """At most this many expensive LISTs run on one apiserver at once; with the fleet on, across the fleet
    (divided as seats are: at most ``max(cap, proxies)``). 0: no cap."""
    min_bytes: int = 8 << 20
    """A LIST is expensive when its estimated response (the seat estimate's bytes) is at least this."""

    def validate(self) -> None:
        if self.max_in_flight_per_backend < 0:
            raise ValueError("expensiveLists.maxInFlightPerBackend: must be at least 0 (0: no cap)")
        if self.min_bytes < 1:
            raise ValueError("expensiveLists.minBytes: must be at least 1")


@dataclass(frozen=True)
class FlowControlSettings:
    """API Priority and Fairness in the proxy."""

    enabled: bool = True
    """Classify, queue and limit requests before they reach a backend."""
    server_concurrency_limit: int = 600
    """Seats shared by the Limited levels by nominalConcurrencyShares (upstream's default inflight, 400 + 200)."""
    queue_wait_seconds: float = 15.0
    """Longest a request waits in a queue before it gets 429 (reason time-out)."""
    retry_after_seconds: int = 1
    """Retry-After on 429s; client-go only retries when the header is present."""
    bytes_per_seat: int = 8 << 20
    """A LIST costs one seat per this many bytes of its observed response size (min 1)."""
    max_seats: int = 10
    """Most seats one request can cost (upstream's maximum); also capped per level as upstream does."""
    list_bytes_cap: int = 1 << 30
    """Cap on estimated response bytes of all LISTs executing in limited levels (one may always run)."""
    storage_only_resources: list[str] = field(default_factory=list)
    """Resources without a watch cache (``--watch-cache-sizes=R#0``): their selector LISTs cost the whole collection."""
    watch_init_seconds: float = 2.0
    """A watch holds its seat until its first body bytes, or at most this long after its response head."""
    read_ahead_bytes_per_connection: int = 32 << 20
    """Unsent LIST bytes read ahead per client connection, so seats go back when the apiserver has sent the last
    byte, not when a slow client took it (one chunk always). 0: no read ahead."""
    read_ahead_bytes: int = 256 << 20
    """All client connections' read-ahead bytes together, per worker process."""
    coalesce: bool = True
    """Serve identical queued LISTs of one identity with one upstream call."""
    fanout_buffer_bytes: int = 8 << 20
    """Per-client buffer of a coalesced response (the shared read waits while any client's is half full)."""
    fanout_stall_seconds: float = 10.0
    """A coalesced client that makes no room in its buffer for this long is cut off so the others go on."""
    flow_schemas: list[dict[str, Any]] = field(default_factory=list)
    """Inline FlowSchema objects (flowcontrol.apiserver.k8s.io/v1)."""
    priority_level_configurations: list[dict[str, Any]] = field(default_factory=list)
    """Inline PriorityLevelConfiguration objects (flowcontrol.apiserver.k8s.io/v1)."""
    files: list[str] = field(default_factory=list)
    """Multi-document YAML files of FlowSchemas and PriorityLevelConfigurations; re-read on change/SIGHUP."""
    reload_interval_seconds: float = 2.0
    """How often the files are checked for changes (0 = only on SIGHUP)."""
    reload_timeout_seconds: float = 30.0
    """A reload not read and validated within this long (a hung mount) is given up; the running policy stays."""
    max_stuck_reloads: int = 2
    """Given-up reloads whose threads (up to 1 MiB per file each) may still run; past it reloads wait (``stuck``)."""
    borrowing_adjustment_seconds: float = 10.0
    """How often levels' current limits are re-divided by seat demand (borrowing; upstream's period is 10 s)."""
    tokens: TokenSettings = field(default_factory=TokenSettings)
    """Who bearer-token callers are, for classification and queuing only (the apiserver still authenticates)."""
    fleet: FleetSettings = field(default_factory=FleetSettings)
    """Several proxies in front of the same apiservers hold one budget through Leases (off by default)."""
    expensive_lists: ExpensiveListSettings = field(default_factory=ExpensiveListSettings)
    """Per-apiserver cap on expensive LISTs in flight (off by default)."""
    impersonators: ImpersonatorSettings = field(default_factory=ImpersonatorSettings)
    """Callers (Pinniped, Teleport) whose ``Impersonate-User`` requests are classified as the impersonated
    identity, as upstream APF does once authorized; empty by default since any tenant could pick its FlowSchema."""

    def validate(self) -> None:
        for name in (
            "server_concurrency_limit",
            "max_seats",
            "bytes_per_seat",
            "list_bytes_cap",
            "fanout_buffer_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")
        if self.watch_init_seconds <= 0:
            raise ValueError("watchInitSeconds: must be positive")
        if self.read_ahead_bytes_per_connection < 0 or self.read_ahead_bytes < 0:
            raise ValueError("readAheadBytes and readAheadBytesPerConnection must be at least 0")
        for key, seconds in (("fanoutStallSeconds", self.fanout_stall_seconds),
                             ("borrowingAdjustmentSeconds", self.borrowing_adjustment_seconds),
                             ("queueWaitSeconds", self.queue_wait_seconds),
                             ("reloadTimeoutSeconds", self.reload_timeout_seconds)):
            if seconds <= 0:
                raise ValueError(f"{key}: must be positive")
        if self.max_stuck_reloads < 1:
            raise ValueError("maxStuckReloads: must be at least 1")
        if self.retry_after_seconds < 1:
            raise ValueError("retryAfterSeconds: must be a whole number of seconds >= 1")
        self.tokens.validate()
        self.impersonators.validate()
        self.fleet.validate()
        self.expensive_lists.validate()
