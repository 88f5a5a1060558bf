"""How the proxy talks to the apiservers (``proxy.upstream``); ``gatekeeper.proxy.settings`` composes it."""

from __future__ import annotations

from dataclasses import dataclass


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
    max_long_running_connections_per_backend: int = 8192
    """Separate pool for watches, exec and followed logs (one HTTP/1.1 connection each), per backend."""
    max_long_running_per_caller: int = 1024
    """Long-running requests one caller may hold through this process; past it 429 (``long_running_cap``), so
    no tenant can take the whole long-running pool."""
    pool_acquire_timeout_seconds: float = 10.0
    """Longest wait for a free pooled connection; past it the client gets 503 + Retry-After."""
    cert_check_interval_seconds: float = 2.0
    """How often caFile and the front-proxy certificate are checked for changes (new connections use them)."""
    response_header_timeout_seconds: float = 60.0
    """Longest wait for a backend's response headers on a non-long-running request (apiserver's --request-timeout)."""
    http2_max_streams: int = 100
    """Streams per upstream HTTP/2 connection (fewer if the apiserver allows fewer); past it a new one opens."""
    http2_retry_seconds: float = 300.0
    """A backend that picked HTTP/1.1 in ALPN is asked for HTTP/2 again by one request this often (0 = never)."""
    http2_unauthorized_pause_seconds: float = 60.0
    """After a 401 on a stream (the apiserver then GOAWAYs), that kind of caller uses HTTP/1.1 this long."""

    def validate(self) -> None:
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
