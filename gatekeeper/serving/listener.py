"""Settings of a TLS listener, shared by the webhook's and the proxy's (base layer).

Both servers bind an address and port, serve a certificate/key pair that
cert-manager or ``gatekeeper certs`` rotates in place, and check those files
for changes; each component subclasses :class:`TLSListenerSettings` with its
own default port and extra fields (the webhook's workers, the proxy's client
CA and metrics side listener).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class TLSListenerSettings:
    """A TLS listener: where it binds and the serving pair it presents."""

    tls_required_because: ClassVar[str] = "the listener only serves TLS"

    address: str = "127.0.0.1"
    """Bind address (loopback by default; ``0.0.0.0`` inside a pod)."""
    port: int = 443
    """TLS port (0 = pick a free port)."""
    cert_file: str = ""
    """Serving certificate (PEM); re-read when its mtime changes, for new connections."""
    key_file: str = ""
    """Serving key (PEM); re-read together with the certificate."""
    cert_check_interval_seconds: float = 2.0
    """How often (at most) a new connection checks the serving files' mtime."""

    def validate(self) -> None:
        if not self.cert_file or not self.key_file:
            raise ValueError(f"certFile and keyFile are required: {self.tls_required_because}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535 (0 = any free port), got {self.port}")
        if self.cert_check_interval_seconds < 0:
            raise ValueError(f"certCheckIntervalSeconds must be >= 0, got {self.cert_check_interval_seconds}")
