"""Typed ``proxy.flowControl`` section. ``validate()`` does no I/O (``gatekeeper.proxy.settings.load_section``
reads ``files``), and a bad object stops the proxy at load as ``FILE: proxy.flowControl: FlowSchema/NAME: ...``.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gatekeeper.base.config import require
from gatekeeper.proxy.identity.impersonation import ImpersonatorSettings
from gatekeeper.proxy.identity.tokens.settings import TokenSettings

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,200}[a-z0-9])?$")


@dataclass(frozen=True)
class PublishEndpointsSettings:
    """The fleet writes the ``default/kubernetes`` Service's endpoints, so in-cluster callers reach the proxies."""

    enabled: bool = False
    """Off: whatever wrote them before (the apiservers' lease reconciler) keeps them. On: run the apiservers with
    ``--endpoint-reconciler-type=none``, or each puts its own address back every 10 s."""
    advertise_address: str = ""
    """The IP in-cluster callers connect to for this proxy; empty: ``$HOST_IP`` (the static pod sets it from
    ``status.hostIP``). Not loopback, link-local or unspecified: the API refuses those in endpoints."""
    advertise_port: int = 0
    """The port in-cluster callers connect to; 0: ``listener.port``."""

    def validate(self) -> None:
        if self.advertise_address:
            check_advertise_address(self.advertise_address, "fleet.publishEndpoints.advertiseAddress")
        if not 0 <= self.advertise_port <= 65535:
            raise ValueError("fleet.publishEndpoints.advertisePort: must be 0 (listener.port) to 65535")

    def resolve(self, listener_port: int, environ: Mapping[str, str] = os.environ) -> tuple[str, int]:
        """(address, port) in-cluster callers reach this proxy at; a ValueError says what to set."""
        address = self.advertise_address or environ.get("HOST_IP", "")
        if not address:
            raise ValueError("fleet.publishEndpoints: set advertiseAddress, or HOST_IP in the environment (the "
                             "static pod sets it from status.hostIP)")
        address = check_advertise_address(address, "fleet.publishEndpoints.advertiseAddress (or HOST_IP)")
        port = self.advertise_port or listener_port
        if not 0 < port < 65536:
            raise ValueError("fleet.publishEndpoints: listener.port is 0 (any free port); set advertisePort")
        return address, port


def check_advertise_address(value: str, key: str) -> str:
    """``value`` as the API accepts it in an EndpointSlice, or a ValueError naming ``key``."""
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{key}: {value!r} is not an IP address") from None
    if ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast:
        raise ValueError(f"{key}: {value} is loopback, link-local, unspecified or multicast; the API refuses it "
                         "in endpoints (use the node's address)")
    return str(ip)


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
    seat_leases: bool = True
    """A level with fewer seats than live proxies shares them as seat Leases, so the fleet holds exactly its seats
    (each proxy takes one when it has requests of the level); off: every proxy keeps at least one (max(L, N))."""
    seat_poll_seconds: float = 0.1
    """A process with requests waiting for a seat Lease asks again this often (doubling up to 4x while refused)."""
    seat_max_hold_seconds: float = 5.0
    """A seat Lease held this long goes back once the request on it ends, even with more waiting, so proxies take
    turns; the proxy that gave it back waits ``seatTurnPauseSeconds`` before asking again."""
    seat_turn_pause_seconds: float = 0.3
    """How long a proxy that gave a seat back to take turns lets the others ask first."""
    seat_linger_seconds: float = 0.05
    """A seat Lease no longer needed is kept this long first, so back-to-back requests do not write a Lease each."""
    publish_endpoints: PublishEndpointsSettings = field(default_factory=PublishEndpointsSettings)
    """The fleet owns the ``default/kubernetes`` Service's endpoints (off by default)."""

    def validate(self) -> None:
        if not DNS_LABEL.match(self.name):
            raise ValueError(f"fleet.name: {self.name!r} is not a lower-case DNS name")
        if not DNS_LABEL.match(self.namespace) or "." in self.namespace or len(self.namespace) > 63:
            raise ValueError(f"fleet.namespace: {self.namespace!r} is not a namespace name")
        if self.identity and not DNS_LABEL.match(self.identity):
            raise ValueError(f"fleet.identity: {self.identity!r} must be a lower-case DNS name (it names a Lease)")
        require(self, "fleet.", at_least_one=("fallback_members",), positive=(
            "lease_duration_seconds", "renew_interval_seconds", "seat_poll_seconds", "seat_max_hold_seconds",
            "seat_turn_pause_seconds", "seat_linger_seconds"))
        if self.renew_interval_seconds * 3 > self.lease_duration_seconds:
            raise ValueError("fleet.renewIntervalSeconds must be at most a third of leaseDurationSeconds, or one "
                             "late renewal makes a live proxy look gone")
        self.publish_endpoints.validate()
        if self.publish_endpoints.enabled and not self.enabled:
            raise ValueError("fleet.publishEndpoints needs fleet.enabled: the endpoints list the fleet's live members")


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
        require(self, "expensiveLists.", at_least_one=("min_bytes",))


@dataclass(frozen=True)
class WatchStartSettings:
    """How fast one caller may start new watches (kubernetes#98423: upstream limits neither their number nor
    rate)."""

    per_flow_per_second: float = 50.0
    """New watches per second per caller and FlowSchema after the burst; more get 429 with a Retry-After of the
    time until the next one may start. 0: no limit. Each worker process keeps its own buckets: a client's
    connection is served by one worker, so one that spreads its watches over several connections can get up to
    ``workers`` times as many."""
    burst: int = 200
    """Watches a caller may start at once: a controller's informers all start together (kube-controller-manager
    starts about 100 on its own)."""
    max_flows: int = 10_000
    """Callers whose bucket is remembered; the least recently used is forgotten first (a forgotten caller starts
    with a full burst again), so the table cannot grow without bound."""

    def validate(self) -> None:
        if self.per_flow_per_second < 0:
            raise ValueError("watchStarts.perFlowPerSecond: must be at least 0 (0: no limit)")
        require(self, "watchStarts.", at_least_one=("burst", "max_flows"))


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
    """A watch without a resourceVersion (which sends every existing object first) holds its seat until its first
    body bytes, or at most this long after its response head; a watch from a resourceVersion frees it at the head."""
    watch_list_sync_seconds: float = 60.0
    """A watch-list (``sendInitialEvents=true``) holds its LIST seats until the apiserver has sent the
    initial-events-end bookmark, or at most this long (the apiservers' default request timeout)."""
    watch_starts: WatchStartSettings = field(default_factory=WatchStartSettings)
    """The rate at which each flow may start new watches."""
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
        require(self, at_least_one=(
            "server_concurrency_limit", "max_seats", "bytes_per_seat", "list_bytes_cap", "fanout_buffer_bytes",
            "max_stuck_reloads"), positive=(
            "watch_init_seconds", "watch_list_sync_seconds", "fanout_stall_seconds", "borrowing_adjustment_seconds",
            "queue_wait_seconds", "reload_timeout_seconds"))
        if self.read_ahead_bytes_per_connection < 0 or self.read_ahead_bytes < 0:
            raise ValueError("readAheadBytes and readAheadBytesPerConnection must be at least 0")
        if self.retry_after_seconds < 1:
            raise ValueError("retryAfterSeconds: must be a whole number of seconds >= 1")
        self.tokens.validate()
        self.impersonators.validate()
        self.fleet.validate()
        self.expensive_lists.validate()
        self.watch_starts.validate()
