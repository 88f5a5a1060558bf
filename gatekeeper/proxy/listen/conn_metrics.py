"""Collectors for the client-facing side of the proxy (connections, GOAWAYs, refused streams). Apart from the pipeline's
metrics so the protocol adapters import nothing from the pipeline."""

from __future__ import annotations

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
TLS_HANDSHAKES_LATE = Counter(
    "gatekeeper_proxy_tls_handshakes_late",
    "Client TLS handshakes given more time at tlsHandshakeTimeoutSeconds because the client's bytes waited "
    "unread in the proxy's socket buffer (the proxy, not the client, was behind: short of CPU).",
)
REFUSED_STREAMS = Counter(
    "gatekeeper_proxy_refused_streams",
    "HTTP/2 streams refused with REFUSED_STREAM: after our GOAWAY, or over MAX_CONCURRENT_STREAMS.",
)
HANDED_OFF = Counter(
    "gatekeeper_proxy_connections_handed_off",
    "Client connections the supervisor accepted and handed to each worker "
    "(with --workers N): the split shows how even the workers' load is.",
    ["worker"],
)
HANDOFF_STALLS = Counter(
    "gatekeeper_proxy_handoff_stalls",
    "Times a worker left a connection handed to it unread (stopped, or its event loop blocked; "
    "with --workers N): for 50 ms while another worker kept up (its unread connections "
    "are taken back and it is passed over for 0.5 s at a time), or for 0.5 s with no other worker keeping up. "
    "Counted once until it reads again.",
    ["worker"],
)
HANDOFF_TAKEN_BACK = Counter(
    "gatekeeper_proxy_handoff_taken_back",
    "Client connections the supervisor took back unread from a worker and handed to another "
    "(with --workers N): the worker had left one unread for 50 ms while another kept "
    "up (stopped, its event loop blocked), began to drain, or exited.",
    ["worker"],
)
HANDOFF_WAITS = Counter(
    "gatekeeper_proxy_handoff_waits",
    "Times the supervisor held a connection because no worker could take it (every hand-off socket full, "
    "or none serving): accepting paused until one could. Rising steadily: the workers are saturated or stuck.",
)
HANDOFF_RECEIVE_ERRORS = Counter(
    "gatekeeper_proxy_handoff_receive_errors",
    "Failed reads of a worker's hand-off socket (with --workers N), by errno name. "
    "ENOBUFS and ENOMEM are retried after a back-off (0.1 s doubling to 1 s); any other ends the hand-off: "
    "the worker drains and exits, and the supervisor starts a successor.",
    ["error"],
)
DRAIN_CUT = Counter(
    "gatekeeper_proxy_drain_cut_connections",
    "Client connections a drain (SIGTERM, or the supervisor ending a worker's hand-off) still had to cut when "
    "shutdownTimeoutSeconds (+ the close delay) ran out, by stage: handshake (its TLS handshake unfinished), "
    "serving (a response or an idle HTTP/1.1 connection still open). Connections already accepted finish their "
    "handshake and are answered or told to go away during the drain; only these are cut.",
    ["stage"],
)
for _stage in ("handshake", "serving"):
    DRAIN_CUT.labels(stage=_stage)
