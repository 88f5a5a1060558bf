"""Prometheus metrics of flow control: upstream APF's names under ``gatekeeper_flowcontrol_``.

Counters and histograms are recorded as requests pass; the current in-queue /
executing gauges are read from the live controller at scrape time (a
collector), so they can never drift from the queues' real state.

``gatekeeper_flowcontrol_dispatched_requests_total{flow_schema,priority_level}``
``gatekeeper_flowcontrol_rejected_requests_total{flow_schema,priority_level,reason}``
    reason: queue-full, time-out, concurrency-limit, cancelled (client left while queued).
``gatekeeper_flowcontrol_coalesced_requests_total{flow_schema,priority_level}``
    Requests served by another identical request's upstream call.
``gatekeeper_flowcontrol_request_wait_duration_seconds{flow_schema,priority_level,execute}``
``gatekeeper_flowcontrol_request_execution_seconds{flow_schema,priority_level,type}``
    type: regular, or watch (execution ends when the watch's response head arrives).
``gatekeeper_flowcontrol_work_estimated_seats{flow_schema,priority_level}``
``gatekeeper_flowcontrol_list_response_bytes{resource}``
    Observed LIST response sizes, the input of the seat estimate.
``gatekeeper_flowcontrol_current_inqueue_requests{priority_level}``
``gatekeeper_flowcontrol_current_executing_requests{priority_level}``
``gatekeeper_flowcontrol_current_executing_seats{priority_level}``
``gatekeeper_flowcontrol_nominal_limit_seats{priority_level}``
``gatekeeper_flowcontrol_peak_executing_requests{priority_level}``
    Highest number of requests of the level running upstream at once since start
    (the figure the seeds' "at most 2 secret LISTs" policy is checked against).
``gatekeeper_flowcontrol_executing_list_estimated_bytes``
    Sum of the estimates of executing LISTs, against ``listBytesCap``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gatekeeper.proxy.flowcontrol.controller import FlowController

_FS_PL = ["flow_schema", "priority_level"]
DISPATCHED = Counter("gatekeeper_flowcontrol_dispatched_requests", "Requests released to run upstream.", _FS_PL)
REJECTED = Counter(
    "gatekeeper_flowcontrol_rejected_requests",
    "Requests answered 429 (or dropped) by flow control.",
    [*_FS_PL, "reason"],
)
COALESCED = Counter(
    "gatekeeper_flowcontrol_coalesced_requests",
    "Requests served from an identical queued request's single upstream call.",
    _FS_PL,
)
WAIT = Histogram(
    "gatekeeper_flowcontrol_request_wait_duration_seconds",
    "Time requests spent queued.",
    [*_FS_PL, "execute"],
    buckets=(0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30),
)
EXECUTION = Histogram(
    "gatekeeper_flowcontrol_request_execution_seconds",
    "Time requests held their seats.",
    [*_FS_PL, "type"],
    buckets=(0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60),
)
SEATS = Histogram(
    "gatekeeper_flowcontrol_work_estimated_seats",
    "Seats charged per request.",
    _FS_PL,
    buckets=(1, 2, 4, 6, 8, 10),
)
LIST_BYTES = Histogram(
    "gatekeeper_flowcontrol_list_response_bytes",
    "Observed LIST response sizes.",
    ["resource"],
    buckets=(1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 23, 1 << 26, 1 << 28, 1 << 30),
)


class Source(Protocol):
    """A running flow-control instance (the middleware)."""

    controller: FlowController
    peak_executing: dict[str, int]


_sources: weakref.WeakSet[Source] = weakref.WeakSet()


def register_source(source: Source) -> None:
    _sources.add(source)


class _Gauges(Collector):
    def collect(self) -> Iterator[Metric]:
        names = {
            "inqueue": ("gatekeeper_flowcontrol_current_inqueue_requests", "Requests waiting in queues."),
            "exec": ("gatekeeper_flowcontrol_current_executing_requests", "Requests running upstream."),
            "seats": ("gatekeeper_flowcontrol_current_executing_seats", "Seats held by running requests."),
            "limit": ("gatekeeper_flowcontrol_nominal_limit_seats", "Nominal concurrency limit per level."),
            "peak": (
                "gatekeeper_flowcontrol_peak_executing_requests",
                "Most requests of a level running at once.",
            ),
        }
        fams = {k: GaugeMetricFamily(n, h, labels=["priority_level"]) for k, (n, h) in names.items()}
        list_bytes = GaugeMetricFamily(
            "gatekeeper_flowcontrol_executing_list_estimated_bytes",
            "Estimated bytes of LISTs running upstream.",
        )
        any_source = False
        for src in list(_sources):
            any_source = True
            c = src.controller
            for name, lv in c.levels.items():
                draining = [d for d in c.draining if d.spec.name == name]
                fams["inqueue"].add_metric([name], lv.waiting + sum(d.waiting for d in draining))
                fams["exec"].add_metric([name], lv.executing_requests + sum(d.executing_requests for d in draining))
                fams["seats"].add_metric([name], lv.executing_seats + sum(d.executing_seats for d in draining))
                if not lv.spec.exempt:
                    fams["limit"].add_metric([name], lv.limit)
                fams["peak"].add_metric([name], src.peak_executing.get(name, 0))
            list_bytes.add_metric([], c.budget.used)
        yield from fams.values()
        if any_source:
            yield list_bytes


REGISTRY.register(_Gauges())
