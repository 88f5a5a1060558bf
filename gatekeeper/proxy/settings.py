"""Typed ``proxy:`` section of the gatekeeper config file.

Ownership: ``ListenerSettings``/``ProtocolSettings`` belong to the client-facing
listener and live beside it (``proxy/listen/settings.py``, imported here to
compose the section); ``BackendSettings``/``UpstreamSettings`` to the pipeline
(balancer.py, upstream.py); ``flowControl`` to ``gatekeeper.proxy.flowcontrol``.
Add fields where they belong, each with a one-line docstring; the loader
(gatekeeper.config.from_mapping) maps camelCase YAML keys onto these snake_case
fields and rejects unknown keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gatekeeper.config import ConfigError, from_mapping, register_section
from gatekeeper.proxy.flowcontrol.edge.loading import load_policy
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings
from gatekeeper.proxy.listen.settings import MAX_GOAWAY_CHANCE as MAX_GOAWAY_CHANCE  # re-exported
from gatekeeper.proxy.listen.settings import ListenerSettings, ProtocolSettings


@dataclass(frozen=True)
class BackendSettings:
    """One kube-apiserver behind the proxy."""

    url: str
    """https://host:port of the apiserver."""
    weight: int = 1
    """Relative share of requests (power-of-two-choices on in-flight / weight)."""
    name: str = ""
    """Label used in metrics (defaults to host:port)."""


@dataclass(frozen=True)
class UpstreamSettings:
    """How the proxy talks to apiservers."""

    ca_file: str = ""
    """CA that signed the apiservers' serving certificates."""
    client_cert_file: str = ""
    """Front-proxy client certificate (CN must be in --requestheader-allowed-names)."""
    client_key_file: str = ""
    """Key of the front-proxy client certificate."""
    max_connections_per_backend: int = 256
    """Short-request connection pool size per backend (connections in use; idle ones are reused LIFO)."""
    connect_timeout_seconds: float = 5.0
    """TCP+TLS connect timeout; a connect failure on a safe request is retried on another backend."""
    health_interval_seconds: float = 2.0
    """Active /readyz probe interval."""
    # --- harden-edge: upstream timeouts and pools -------------------------------------------
    max_long_running_connections_per_backend: int = 8192
    """Separate pool for watches, exec and followed logs (one HTTP/1.1 connection each), per backend."""
    max_long_running_per_caller: int = 1024
    """Long-running requests (watches, followed logs, exec/attach/port-forward, proxy) one caller may hold open
    through this process, all backends together; past it 429 + Retry-After (``long_running_cap``). Without it one
    tenant could hold every connection of the long-running pool (and ~80 KiB of proxy memory per watch)."""
    pool_acquire_timeout_seconds: float = 10.0
    """Longest wait for a free pooled connection; past it the client gets 503 + Retry-After."""
    cert_check_interval_seconds: float = 2.0
    """How often caFile and the front-proxy certificate are checked for changes (new connections use them)."""
    response_header_timeout_seconds: float = 60.0
    """Longest wait for a backend's response headers on a non-long-running request (apiserver's --request-timeout)."""
    client: str = "lean"
    """Request-path HTTP/1.1 client: ``lean`` (asyncio Protocol + httptools) or ``aiohttp`` (the older one)."""
    http2: bool = True
    """Multiplex short bodiless GET/HEAD of verified callers over HTTP/2 connections (``upstream/mux.py``;
    with ``client: lean``, the default; the ``aiohttp`` client is HTTP/1.1 only)."""
    http2_max_streams: int = 100
    """Streams per upstream HTTP/2 connection (fewer if the apiserver allows fewer); past it a new one opens."""
    http2_retry_seconds: float = 300.0
    """A backend that picked HTTP/1.1 in ALPN is asked for HTTP/2 again by one request this often (0 = never);
    each ask is a new connection, kept for HTTP/1.1 if the answer is still no (``upstream/mux_pool.py``)."""
    http2_unauthorized_pause_seconds: float = 60.0
    """After a 401 on a multiplexed stream (kube-apiserver then sends GOAWAY), that kind of caller (certificate
    or token) goes over HTTP/1.1 this long, so revoked tokens cost one reconnect per pause, not one each."""

    def validate(self) -> None:
        if self.client not in ("lean", "aiohttp"):
            raise ValueError(f"client must be 'lean' or 'aiohttp', got {self.client!r}")
        if self.max_long_running_per_caller < 1:
            raise ValueError(f"maxLongRunningPerCaller must be at least 1, got {self.max_long_running_per_caller}")
        if not 1 <= self.http2_max_streams <= 1000:
            raise ValueError(f"http2MaxStreams must be 1..1000, got {self.http2_max_streams}")
        if not (self.http2_retry_seconds == 0 or self.http2_retry_seconds >= 1):
            raise ValueError(f"http2RetrySeconds must be 0 (never) or at least 1 (each retry is a new "
                             f"connection), got {self.http2_retry_seconds}")
        if not 1 <= self.http2_unauthorized_pause_seconds <= 86400:
            raise ValueError(f"http2UnauthorizedPauseSeconds must be 1..86400 (each 401 on a multiplexed stream "
                             f"costs a reconnect; the pause bounds how often), got "
                             f"{self.http2_unauthorized_pause_seconds}")
        if not self.ca_file:
            raise ValueError(
                "caFile is required: the CA that signed the apiservers' serving certificates "
                "(the proxy never trusts the system roots for its backends)"
            )


CONNECTION_BALANCING = ("least-connections", "kernel")


@dataclass(frozen=True)
class ProxySettings:
    """Root of the ``proxy:`` section."""

    listener: ListenerSettings = field(default_factory=ListenerSettings)
    protocol: ProtocolSettings = field(default_factory=ProtocolSettings)
    backends: list[BackendSettings] = field(default_factory=list)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    flow_control: FlowControlSettings = field(default_factory=FlowControlSettings)
    workers: int = 0
    """Worker processes sharing the TLS port (0 = one per usable core, at most maxWorkers; 1 = no supervisor)."""
    max_workers: int = 8
    """Cap on the automatic worker count (an explicit ``workers``/``--workers`` may exceed it)."""
    connection_balancing: str = "least-connections"
    """With several workers: ``least-connections`` (the supervisor accepts and hands each connection to the worker
    with the fewest open ones, see ``proxy/handoff.py``) or ``kernel`` (every worker listens with SO_REUSEPORT and
    the kernel hashes connections to workers, blind to their load)."""
    worker_hang_seconds: float = 30.0
    """With several workers: a serving worker whose private ``/healthz`` has not answered for this long (its
    event loop is stuck, or it was stopped) is killed and restarted, and its seats are released (0 = never)."""
    gc_young_threshold: int = 20000
    """Allocations between young-generation garbage collections in a serving process (0 = Python's default,
    700): each request allocates hundreds of short-lived objects, and a collection every 700 of them cost ~2%
    of CPU for a few KiB of memory saved."""

    def validate(self) -> None:
        if not self.backends:
            raise ValueError("backends: at least one apiserver URL is required")
        if self.workers < 0 or self.max_workers < 1:
            raise ValueError("workers must be >= 0 (0 = one per usable core) and maxWorkers >= 1")
        if self.connection_balancing not in CONNECTION_BALANCING:
            raise ValueError(f"connectionBalancing must be one of {', '.join(CONNECTION_BALANCING)}, "
                             f"got {self.connection_balancing!r}")
        if not (self.worker_hang_seconds == 0 or self.worker_hang_seconds >= 1):
            raise ValueError(f"workerHangSeconds must be 0 (never) or at least 1, got {self.worker_hang_seconds}")
        if self.gc_young_threshold < 0:
            raise ValueError("gcYoungThreshold must be >= 0 (0 = Python's default)")


def load_section(data: Any, source: str, key: str) -> ProxySettings:
    """Parse ``proxy:`` (pure dataclasses), then read and check the flow-control policy it names.

    The policy files are read here, in the load step, not in a dataclass's
    ``validate()``: parsing stays free of I/O, and a bad policy still stops
    ``gatekeeper proxy`` with ``FILE: proxy.flowControl: <object>: <field>: <problem>``.
    """
    settings = from_mapping(ProxySettings, data, source, key)
    if settings.flow_control.enabled:
        try:
            load_policy(settings.flow_control)
        except ValueError as exc:
            raise ConfigError(source, f"{key}.flowControl", str(exc)) from None
    return settings


register_section("proxy", load_section)
