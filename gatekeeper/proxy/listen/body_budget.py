"""A process-wide ceiling on HTTP/2 request DATA received but not yet taken by the pipeline.

Why: each client connection may have up to its connection window of request DATA
in flight to us (4 stream windows, 4 MiB by default), and the proxy holds what the
pipeline has not taken yet: the body of a request queued for a flow-control seat,
or of one whose apiserver reads slowly. The windows bound each connection, not the
process: ``maxClientConnections`` (20000) times 4 MiB is 80 GiB. This budget bounds
the process. A DATA frame that would take the total past
``protocol.maxBufferedRequestBytes`` resets its stream (RST_STREAM
ENHANCE_YOUR_CALM, reason ``body_budget``) unless its connection is still under
its fair share (see :class:`Share`); that stream's queued DATA is released and its
window given back, so the bytes other streams hold are untouched and honest uploads
(etcd caps an object at 1.5 MiB) keep flowing.

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


class RequestBodyBudget:
    """Bytes held against a limit, by every HTTP/2 connection of one process; each holds a :class:`Share`."""

    __slots__ = ("gauge", "held", "holders", "limit")

    def __init__(self, limit: int, gauge: Gauge | None = BUFFERED_REQUEST_BYTES) -> None:
        self.limit = limit
        self.held = 0
        self.holders = 0
        """Connections holding at least one byte."""
        self.gauge = gauge

    def share(self) -> Share:
        return Share(self)


class Share:
    """One connection's part of the budget.

    Over the limit, the connection that holds the most must not be the one that wins: a client
    that parks bodies on a few connections would otherwise get every other client's uploads
    reset. So past the limit, a connection still under its fair share (the limit split evenly
    over the connections holding bytes, itself included) may go on, up to twice the limit in
    all; one at or over its share is refused. A client with many connections gets a share per
    connection (``listener.maxClientConnections`` bounds how many).
    """

    __slots__ = ("budget", "held")

    def __init__(self, budget: RequestBodyBudget) -> None:
        self.budget = budget
        self.held = 0

    def take(self, size: int) -> bool:
        """Hold ``size`` more bytes; False (nothing held) when this connection may not."""
        budget = self.budget
        total = budget.held + size
        if total > budget.limit:
            holders = budget.holders + (0 if self.held else 1)
            if total > 2 * budget.limit or self.held + size > budget.limit // holders:
                return False
        if not self.held:
            budget.holders += 1
        self.held += size
        budget.held = total
        if budget.gauge is not None:
            budget.gauge.set(total)
        return True

    def give(self, size: int) -> None:
        if size <= 0:
            return  # not a holder's last byte: holders must not move
        budget = self.budget
        self.held -= size
        if not self.held:
            budget.holders -= 1
        budget.held -= size
        if budget.gauge is not None:
            budget.gauge.set(budget.held)
