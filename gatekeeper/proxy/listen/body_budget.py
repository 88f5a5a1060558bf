"""A process-wide ceiling on HTTP/2 request DATA received but not yet taken by the pipeline.

Windows bound each connection, not the process (20000 connections x 4 MiB is 80 GiB). A DATA frame past
``protocol.maxBufferedRequestBytes`` resets its stream (ENHANCE_YOUR_CALM) unless its connection is under its fair share
(:class:`Share`); other streams' bytes are untouched. Sans-IO; the gauge is the only side effect."""

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

    Past the limit, a connection under its fair share (the limit split over the connections holding bytes) may go on, up
    to twice the limit in all: otherwise a client parking bodies on a few connections would get every other client's
    uploads reset."""

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
