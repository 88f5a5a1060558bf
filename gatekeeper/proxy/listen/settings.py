"""The listener's settings: the TLS port and its side listener (``proxy.listener``) and the HTTP/2 and
HTTP/1.1 behaviour (``proxy.protocol``). ``gatekeeper.proxy.settings`` composes them into ``proxy:``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from gatekeeper.base.config import camel
from gatekeeper.proxy.h2wire import frames
from gatekeeper.serving.listener import TLSListenerSettings

MAX_GOAWAY_CHANCE = 0.02
"""kube-apiserver refuses --goaway-chance above 0.02; so do we, outside tests."""


@dataclass(frozen=True)
class ListenerSettings(TLSListenerSettings):
    """The client-facing TLS listener (h2 and http/1.1 via ALPN) and its plain-HTTP side listener."""

    tls_required_because: ClassVar[str] = "the proxy only serves TLS"

    port: int = 6443
    """TLS port serving both h2 and http/1.1 via ALPN (0 = pick a free port)."""
    client_ca_file: str = ""
    """If set, client certificates are requested and verified against this CA (CN=user, O=groups)."""
    metrics_address: str = "127.0.0.1"
    """Bind address of the plain-HTTP /metrics, /healthz and /readyz listener."""
    metrics_port: int = 0
    """Port of that listener (0 = pick a free port, -1 = disabled)."""
    metrics_groups: list[str] = field(default_factory=lambda: ["system:masters"])
    """Groups whose verified client-certificate users may read ``/metrics`` on the TLS port (others get 403)."""
    tls_handshake_timeout_seconds: float = 10.0
    """Seconds to finish the TLS handshake, extended while the proxy, not the client, is behind."""
    tls_handshake_max_seconds: float = 0.0
    """Hard cap on such an extended handshake; 0 means four times ``tls_handshake_timeout_seconds``."""

    @property
    def tls_handshake_cap_seconds(self) -> float:
        return self.tls_handshake_max_seconds or 4 * self.tls_handshake_timeout_seconds
    max_client_connections: int = 20000
    """Client connections open at once (handshaking included); more are closed at accept (counted)."""

    def validate(self) -> None:
        """Also refuses limits that would disable a defence or break every client."""
        super().validate()
        for name in ("tls_handshake_timeout_seconds", "max_client_connections"):
            if not (value := getattr(self, name)) > 0:
                raise ValueError(f"{camel(name)} must be > 0, got {value}")
        if self.tls_handshake_max_seconds and not self.tls_handshake_max_seconds >= self.tls_handshake_timeout_seconds:
            raise ValueError(f"tlsHandshakeMaxSeconds must be 0 (4 x tlsHandshakeTimeoutSeconds) or >= "
                             f"tlsHandshakeTimeoutSeconds ({self.tls_handshake_timeout_seconds:g}), "
                             f"got {self.tls_handshake_max_seconds:g}")


@dataclass(frozen=True)
class ProtocolSettings:
    """HTTP/2 and HTTP/1.1 behaviour, including GOAWAY rebalancing."""

    goaway_chance: float = 0.0
    """Per-request probability of a graceful GOAWAY (h2) or Connection: close (h1), in [0, 0.02]."""
    allow_unsafe_goaway_chance: bool = False
    """Test-only: allow goawayChance above 0.02 (up to 1.0)."""
    drain_timeout_seconds: float = 60.0
    """How long long-running streams (watches) may run after GOAWAY before the connection closes."""
    shutdown_timeout_seconds: float = 30.0
    """SIGTERM: how long to drain every connection before exiting."""
    max_concurrent_streams: int = 250
    """SETTINGS_MAX_CONCURRENT_STREAMS advertised to HTTP/2 clients."""
    stream_window_bytes: int = 1 << 20
    """Initial HTTP/2 stream flow-control window advertised to clients."""
    max_header_list_bytes: int = 1 << 20
    """Largest header block accepted from a client."""
    max_buffered_request_bytes: int = 128 << 20
    """HTTP/2 request DATA not yet taken by the pipeline, per process (windows bound only each connection)."""
    request_timeout_seconds: float = 60.0
    """A request that is not long-running ends this long after it arrived, whatever its client's read speed
    (kube-apiserver's --request-timeout); a client's ``?timeout=`` can only shorten it."""
    idle_timeout_seconds: float = 300.0
    """Close client connections idle (no open stream) for this long."""
    response_stall_timeout_seconds: float = 60.0
    """A response that cannot move for this long (window at 0, socket unread) is cut, freeing seat and upstream."""
    write_buffer_high_bytes: int = 65536
    """Stop reading a client's input while this much of our output to it is unsent (flood/slow reader)."""
    write_buffer_low_bytes: int = 16384
    """Resume reading once the unsent output is back under this."""
    h2_abuse_interval_seconds: float = 10.0
    """Window over which the per-connection HTTP/2 frame counters below are counted."""
    h2_max_resets_per_interval: int = 1000
    """RST_STREAM frames a client may send per interval (rapid reset, CVE-2023-44487), then GOAWAY ENHANCE_YOUR_CALM."""
    h2_max_pings_per_interval: int = 100
    """PING frames (not ACKs) a client may send per interval."""
    h2_max_settings_per_interval: int = 100
    """SETTINGS frames (not ACKs) a client may send per interval."""
    h2_max_empty_frames_per_interval: int = 1000
    """Zero-length DATA (without END_STREAM) and CONTINUATION frames a client may send per interval."""
    h2_max_closed_stream_frames_per_interval: int = 1000
    """DATA, HEADERS, CONTINUATION or RST_STREAM frames on already-closed streams per interval."""
    # --- harden-edge: HTTP/1.1 client timeouts ---------------------------------------------
    h1_header_timeout_seconds: float = 32.0
    """HTTP/1.1: a request's head must be complete this long after its first byte (kube-apiserver: 32 s)."""
    h1_max_header_fields: int = 1000
    """HTTP/1.1: header fields in one head, counted before parsing (~4 us of the loop per field); more is a 431."""
    h1_body_idle_timeout_seconds: float = 30.0
    """HTTP/1.1: an idle request body is cut after this, under kube-apiserver's 60 s so the proxy frees it first."""
    h2_body_idle_timeout_seconds: float = 30.0
    """HTTP/2: a request body idle this long while the client may send is reset, freeing its seat and upstream."""
    h1_write_stall_timeout_seconds: float = 60.0
    """HTTP/1.1 (upgraded tunnels too): a client that takes no response bytes this long is cut."""
    h1_upgrade_idle_timeout_seconds: float = 14400.0
    """HTTP/1.1: an upgraded tunnel idle both ways this long is closed, as is an unanswered upgrade (kubelet's
    streamingConnectionIdleTimeout default, 4 h)."""

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            key = camel(f.name)
            if f.name.endswith("_seconds"):
                # Zero or less would cut every client at once (or, for the drains, never wait).
                if not value > 0:
                    raise ValueError(f"{key} must be a positive number of seconds, got {value}")
            elif f.type in ("int", int) and f.name != "write_buffer_low_bytes" and not value >= 1:
                raise ValueError(f"{key} must be at least 1, got {value}")
        if self.stream_window_bytes > frames.MAX_WINDOW:
            raise ValueError(f"streamWindowBytes must be at most {frames.MAX_WINDOW} (RFC 9113 6.9.1), got "
                             f"{self.stream_window_bytes}")
        for name in ("max_concurrent_streams", "max_header_list_bytes"):  # SETTINGS values are 32-bit
            if (value := getattr(self, name)) > frames.MAX_SETTING:
                raise ValueError(f"{camel(name)} must be at most {frames.MAX_SETTING} (RFC 9113 6.5.1), got {value}")
        if self.max_buffered_request_bytes < frames.MIN_FRAME_SIZE:
            # One full-size DATA frame or header fragment must fit, or an idle proxy refuses every upload.
            raise ValueError(f"maxBufferedRequestBytes must be at least {frames.MIN_FRAME_SIZE} (one HTTP/2 frame), "
                             "got "
                             f"{self.max_buffered_request_bytes}")
        if not 0 <= self.write_buffer_low_bytes <= self.write_buffer_high_bytes:
            raise ValueError(f"writeBufferLowBytes must be within [0, writeBufferHighBytes "
                             f"({self.write_buffer_high_bytes})], got {self.write_buffer_low_bytes}")
        limit = 1.0 if self.allow_unsafe_goaway_chance else MAX_GOAWAY_CHANCE
        if not 0.0 <= self.goaway_chance <= limit:
            raise ValueError(
                f"goawayChance must be within [0, {limit}] (kube-apiserver's limit is 0.02; "
                f"0.001 is the upstream recommendation), got {self.goaway_chance}"
            )


class ServedSettings(Protocol):
    """What the listener reads of the proxy's settings (``ProxySettings`` is one)."""

    @property
    def listener(self) -> ListenerSettings: ...

    @property
    def protocol(self) -> ProtocolSettings: ...
