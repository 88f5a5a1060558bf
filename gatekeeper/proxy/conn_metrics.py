"""Collectors for the client-facing side of the proxy (connections, GOAWAYs, refused streams, rejections).

They live apart from the pipeline's request metrics so the protocol adapters
import nothing from the pipeline; both register on prometheus-client's default
registry, so one ``/metrics`` page shows them together.
"""

from __future__ import annotations

import logging
import math
import time

from prometheus_client import Counter, Gauge

CLIENT_CONNECTIONS = Gauge(
    "gatekeeper_proxy_client_connections",
    "Open client connections, by negotiated protocol (h2 or http/1.1).",
    ["protocol"],
    multiprocess_mode="livesum",  # with --workers: the sum over live workers
)
CLIENT_CONNECTIONS_ACCEPTED = Counter(
    "gatekeeper_proxy_client_connections_accepted",
    "Client connections accepted (TLS handshake done), by protocol: rises as GOAWAYs move clients.",
    ["protocol"],
)
GOAWAY_SENT = Counter(
    "gatekeeper_proxy_goaway_sent",
    "Graceful GOAWAYs (h2) or Connection: close (http/1.1) sent to clients, by reason.",
    ["reason"],
)
"""reason: chance (goawayChance), shutdown (SIGTERM), idle (idle timeout)."""
REFUSED_STREAMS = Counter(
    "gatekeeper_proxy_refused_streams",
    "HTTP/2 streams refused with REFUSED_STREAM: after our GOAWAY, or over MAX_CONCURRENT_STREAMS.",
)
CLIENT_REJECTED = Counter(
    "gatekeeper_proxy_client_rejected",
    "Client connections or HTTP/2 streams the proxy cut or refused to protect itself, by reason.",
    ["reason"],
)
"""reason is one of :data:`REJECT_REASONS` (a fixed set, so the series count stays bounded)."""

REJECT_REASONS = frozenset({
    "connection_cap",         # over listener.maxClientConnections: closed at accept, before any TLS work
    "handshake_timeout",      # TLS handshake not done within listener.tlsHandshakeTimeoutSeconds
    "handshake_failed",       # TLS handshake error (untrusted certificate, not TLS, ...)
    "write_stall",            # client stopped reading: outbound buffer stayed full for responseStallTimeout
    "response_stall",         # client kept a stream's flow-control window at 0 for responseStallTimeout
    "h2_malformed",           # RFC 9113 8.1.1 malformed request: RST_STREAM PROTOCOL_ERROR
    "h2_protocol_error",      # connection error (GOAWAY with h2's error code)
    "h2_flood_rst_stream",    # more RST_STREAM frames than h2MaxResetsPerInterval (rapid reset)
    "h2_flood_ping",          # more PINGs than h2MaxPingsPerInterval
    "h2_flood_settings",      # more SETTINGS than h2MaxSettingsPerInterval
    "h2_flood_empty_frame",   # more zero-length DATA/CONTINUATION frames than h2MaxEmptyFramesPerInterval
    "h2_flood_closed_stream",  # more frames on closed streams than h2MaxClosedStreamFramesPerInterval
})

_log = logging.getLogger("gatekeeper.proxy.limits")
LOG_INTERVAL_SECONDS = 10.0
"""At most one log line per reason per this many seconds; the rest are only counted."""
_last_logged: dict[str, float] = {}
_suppressed: dict[str, int] = {}


def reject(reason: str, message: str, *args: object) -> None:
    """Count a rejection and log it at WARNING, at most once per reason per LOG_INTERVAL_SECONDS.

    An attacker controls how often this runs; the counter is the record, the log line
    is the pointer to it, so a flood cannot flood the log too.
    """
    assert reason in REJECT_REASONS, reason
    CLIENT_REJECTED.labels(reason=reason).inc()
    now = time.monotonic()
    if now - _last_logged.get(reason, -math.inf) < LOG_INTERVAL_SECONDS:
        _suppressed[reason] = _suppressed.get(reason, 0) + 1
        return
    _last_logged[reason] = now
    more = _suppressed.pop(reason, 0)
    suffix = f" ({more} more like it since the last line; see gatekeeper_proxy_client_rejected_total)" if more else ""
    _log.warning("rejected (%s): " + message + "%s", reason, *args, suffix)
