"""One record of everything the proxy refuses or cuts to protect itself: ``gatekeeper_proxy_rejected_total{reason}``.

A fixed set of reasons so an attacker cannot mint new series; the log line is rate-limited per reason because an
attacker also controls how often a rejection happens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal, get_args

from prometheus_client import Counter

from gatekeeper.runtime.metrics import child

RejectReason = Literal[
    # listener (server.py)
    "connection_cap",  # over listener.maxClientConnections: closed at accept, before any TLS work
    "handshake_timeout",  # TLS handshake not done within listener.tlsHandshakeTimeoutSeconds
    "handshake_failed",  # TLS handshake error (untrusted certificate, not TLS, ...)
    "write_stall",  # client stopped reading: outbound buffer stayed full for responseStallTimeout
    "no_descriptors",  # a worker out of file descriptors: a connection handed to it was closed by the kernel
    # HTTP/2 (h2.py, h2_limits.py)
    "h2_malformed",  # RFC 9113 8.1.1 malformed request: RST_STREAM PROTOCOL_ERROR
    "h2_protocol_error",  # connection error (GOAWAY with the codec's error code)
    "h2_flood_rst_stream",  # more RST_STREAM frames than h2MaxResetsPerInterval (rapid reset)
    "h2_flood_ping",  # more PINGs than h2MaxPingsPerInterval
    "h2_flood_settings",  # more SETTINGS than h2MaxSettingsPerInterval
    "h2_flood_empty_frame",  # more zero-length DATA/CONTINUATION frames than h2MaxEmptyFramesPerInterval
    "h2_flood_closed_stream",  # more frames on closed streams than h2MaxClosedStreamFramesPerInterval
    "body_budget",  # request DATA over maxBufferedRequestBytes (process-wide): RST_STREAM ENHANCE_YOUR_CALM
    # both protocols: a response that cannot move (h2 window held at 0, h1 client not reading)
    "response_stall",
    # HTTP/1.1 (h1.py)
    "length_and_chunked",  # Content-Length with Transfer-Encoding
    "h1_malformed",  # a request head h11 refuses (syntax, unsupported Transfer-Encoding, ...): 400/501, closed
    "h1_head_too_large",  # request head over maxHeaderListBytes or h1MaxHeaderFields: 431, closed
    "header_timeout", "body_timeout",  # slow request head / idle request body
    "upgrade_idle",  # an upgraded tunnel (exec, port-forward, proxy) moved no byte for h1UpgradeIdleTimeoutSeconds
    # pipeline: request target (target.py) and identity (auth.py)
    "target_form", "dot_segment", "nul", "bad_byte", "fragment",
    "bad_escape",  # a path with a malformed percent escape (%zz): Go's server refuses it (400, or an h2 stream reset)
    "bad_identity",  # client certificate name with control characters or edge whitespace
    # upstream too slow
    "pool_timeout", "upstream_header_timeout",
    "deadline",  # not done within protocol.requestTimeoutSeconds (or its ?timeout=): 504, or the response cut
    "bad_timeout",  # a ?timeout= Go's time.ParseDuration refuses: 400, as kube-apiserver answers
    "long_running_cap",  # a caller already holds upstream.maxLongRunningPerCaller watches/logs/exec open: 429
]
REJECT_REASONS: tuple[str, ...] = get_args(RejectReason)
REJECTED = Counter(
    "gatekeeper_proxy_rejected",
    "Connections, streams or requests the proxy refused or cut to protect itself, by reason (a fixed set).",
    ["reason"],
)
for _reason in REJECT_REASONS:
    REJECTED.labels(_reason)
LOG_INTERVAL = 10.0
"""Seconds between two log lines for the same rejection reason; the rest are only counted."""

class RateLimitedLog:
    """One warning per key per interval with the count left out: a flood must show in the log, not become one."""

    def __init__(self, logger: logging.Logger, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._next: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warning(self, key: str, message: str, *args: object) -> bool:
        """Log ``message % args`` unless ``key`` was logged within the interval (True if logged). Formatted here,
        never by ``logging``: client bytes (``%`` in a target) must not be read as a format string."""
        now = self.clock()
        if now < self._next.get(key, 0.0):
            self._skipped[key] = self._skipped.get(key, 0) + 1
            return False
        skipped = self._skipped.pop(key, 0)
        self._next[key] = now + self.interval
        text = message % args if args else message
        suffix = f" ({skipped} more {key} since the last report)" if skipped else ""
        self.logger.warning("%s: %s%s", key, text, suffix)
        return True


reject_log = RateLimitedLog(logging.getLogger("gatekeeper.proxy.rejected"), LOG_INTERVAL)


def reject(reason: RejectReason, message: str, *args: object) -> None:
    """Count a refusal under ``reason`` and log it (``message % args``), rate-limited per reason."""
    child(REJECTED, reason).inc()
    reject_log.warning(reason, message, *args)
