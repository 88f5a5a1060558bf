"""A process-wide ceiling on HTTP/2 request DATA received but not yet taken by the pipeline.

Why: each client connection may have up to its connection window of request DATA
in flight to us (4 stream windows, 4 MiB by default), and the proxy holds what the
pipeline has not taken yet: the body of a request queued for a flow-control seat,
or of one whose apiserver reads slowly. The windows bound each connection, not the
process: ``maxClientConnections`` (20000) times 4 MiB is 80 GiB. This budget bounds
the process. A DATA frame that would take the total past
``protocol.maxBufferedRequestBytes`` resets its stream (RST_STREAM
ENHANCE_YOUR_CALM, reason ``body_budget``); that stream's queued DATA is released
and its window given back, so the bytes other streams hold are untouched and
honest uploads (etcd caps an object at 1.5 MiB) keep flowing under the limit.

Sans-IO: the adapter (``h2.H2Protocol``) takes and gives bytes; the gauge is the
only side effect.
"""

from __future__ import annotations

from prometheus_client import Gauge

BUFFERED_REQUEST_BYTES = Gauge(
    "gatekeeper_proxy_buffered_request_bytes",
    "HTTP/2 request DATA received from clients and not yet taken by the pipeline (see maxBufferedRequestBytes).",
    multiprocess_mode="livesum",  # with --workers: the sum over live workers
)


class BodyBudget:
    """Bytes held against a limit; shared by every HTTP/2 connection of one process."""

    __slots__ = ("gauge", "held", "limit")

    def __init__(self, limit: int, gauge: Gauge | None = BUFFERED_REQUEST_BYTES) -> None:
        self.limit = limit
        self.held = 0
        self.gauge = gauge

    def take(self, size: int) -> bool:
        """Hold ``size`` more bytes; False (nothing held) when that would pass the limit."""
        if self.held + size > self.limit:
            return False
        self.held += size
        if self.gauge is not None:
            self.gauge.set(self.held)
        return True

    def give(self, size: int) -> None:
        self.held -= size
        if self.gauge is not None:
            self.gauge.set(self.held)
