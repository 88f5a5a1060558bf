"""Prometheus metrics of flow control, upstream APF's names under ``gatekeeper_flowcontrol_`` (docs/proxy/metrics.md).

Current in-queue/executing gauges are read from the live controller at scrape time so they cannot drift.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gatekeeper.proxy.flowcontrol.core.controller import FlowController
from gatekeeper.proxy.tally import CounterTally, HistogramTally  # before the metrics: its flush collects first

_FS_PL = ["flow_schema", "priority_level"]
DISPATCHED = Counter("gatekeeper_flowcontrol_dispatched_requests", "Requests released to run upstream.", _FS_PL)
REJECTED = Counter(
    "gatekeeper_flowcontrol_rejected_requests",
    "Requests answered 429 (or dropped) by flow control.",
    [*_FS_PL, "reason"],
)
POLICY_RELOADS = Counter(
    "gatekeeper_flowcontrol_policy_reloads",
    "Flow-control policy reloads (SIGHUP or a policy file changed), by result: applied, or failed (the "
    "running policy stays; the log says why).",
    ["result"],
)
RELOAD_FAILURE_REASONS = ("invalid", "not_regular_file", "timeout", "stuck")
POLICY_RELOAD_FAILURES = Counter(
    "gatekeeper_flowcontrol_policy_reload_failures",
    "Failed flow-control policy reloads by reason: invalid (the files do not make a valid policy), "
    "not_regular_file (a policy path is a FIFO, a device, ...: refused before reading), timeout (not read and "
    "validated within reloadTimeoutSeconds: given up, the next reload runs on a fresh thread), stuck "
    "(maxStuckReloads given-up reloads still running: this one waits until one ends).",
    ["reason"],
)
for _reason in RELOAD_FAILURE_REASONS:
    POLICY_RELOAD_FAILURES.labels(_reason)
POLICY_STALE = Gauge(
    "gatekeeper_flowcontrol_policy_reload_failing",
    "1 while this process's last policy reload failed and it runs an older policy than its files say "
    "(with --workers: how many workers do).",
    multiprocess_mode="livesum",
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


class PairMetrics:
    """One (FlowSchema, level) pair's labelled children, looked up once: ``labels()`` costs more than observing."""

    __slots__ = ("coalesced", "dispatched", "exec_regular", "exec_watch", "seats", "wait_executed", "wait_rejected")

    def __init__(self, fs: str, pl: str) -> None:
        self.dispatched = CounterTally(DISPATCHED.labels(fs, pl))
        self.coalesced = COALESCED.labels(fs, pl)
        self.wait_executed = HistogramTally(WAIT.labels(fs, pl, "true"))
        self.wait_rejected = WAIT.labels(fs, pl, "false")
        self.seats = HistogramTally(SEATS.labels(fs, pl))
        self.exec_regular = HistogramTally(EXECUTION.labels(fs, pl, "regular"))
        self.exec_watch = HistogramTally(EXECUTION.labels(fs, pl, "watch"))


for_pair = functools.cache(PairMetrics)
"""The pair's metrics, built once per (FlowSchema, level)."""


class Source(Protocol):
    """A running flow-control instance (the middleware)."""

    controller: FlowController
    peak_executing: dict[str, int]
    executing_by_schema: dict[tuple[str, str], int]
    """(flow_schema, priority_level) -> requests running upstream now."""


_sources: weakref.WeakSet[Source] = weakref.WeakSet()


def register_source(source: Source) -> None:
    _sources.add(source)


PER_LEVEL = {
    "seats": ("gatekeeper_flowcontrol_current_executing_seats", "Seats held by running requests."),
    "limit": ("gatekeeper_flowcontrol_nominal_limit_seats", "Nominal concurrency limit per level."),
    "current": ("gatekeeper_flowcontrol_current_limit_seats", "Current limit (nominal moved by borrowing)."),
    "lower": ("gatekeeper_flowcontrol_lower_limit_seats", "Nominal limit minus what the level may lend."),
    "upper": ("gatekeeper_flowcontrol_upper_limit_seats", "Nominal limit plus what the level may borrow."),
    "avg": ("gatekeeper_flowcontrol_demand_seats_average", "Time-averaged seat demand, last period."),
    "stdev": ("gatekeeper_flowcontrol_demand_seats_stdev", "Standard deviation of seat demand, last period."),
    "high": ("gatekeeper_flowcontrol_demand_seats_high_watermark", "Peak seat demand, last period."),
    "smoothed": ("gatekeeper_flowcontrol_demand_seats_smoothed", "Smoothed seat demand envelope."),
    "target": ("gatekeeper_flowcontrol_target_seats", "Seat allocation target of the last adjustment."),
    "peak": ("gatekeeper_flowcontrol_peak_executing_requests", "Most requests of a level running at once."),
}
"""Per priority level gauges: key -> (name, help)."""


def _add_levels(src: Source, levels: dict[str, dict[str, float]]) -> None:
    """Add ``src``'s per-level values (``PER_LEVEL``) into ``levels``."""
    c = src.controller
    for name, lv in c.levels.items():
        agg = levels.setdefault(name, dict.fromkeys(PER_LEVEL, 0.0))
        agg["seats"] += lv.executing_seats + sum(d.executing_seats for d in c.draining if d.spec.name == name)
        agg["peak"] = max(agg["peak"], src.peak_executing.get(name, 0))
        b = c.bounds.get(name)
        if b is not None:
            st = lv.demand_stats
            values: dict[str, float] = {
                "limit": b.nominal, "current": lv.limit, "lower": b.lower, "upper": b.upper,
                "avg": st.avg, "stdev": st.stddev, "high": st.high_watermark, "smoothed": st.smoothed,
                "target": lv.target,
            }
            for k, x in values.items():
                agg[k] += x


def _family(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str, labels: list[str],
            values: dict[tuple[str, ...], float]) -> Metric:
    """A family of one value per label set, in label order."""
    family = kind(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family


class _Gauges(Collector):
    """Read at scrape time; summed over flow-control instances (a process normally has one)."""

    def collect(self) -> Iterator[Metric]:
        waiting: dict[tuple[str, ...], float] = {}
        running: dict[tuple[str, ...], float] = {}
        per_backend: dict[tuple[str, ...], float] = {}
        slots: dict[tuple[str, ...], float] = {}
        held_total = 0
        levels: dict[str, dict[str, float]] = {}
        used = 0
        frac = 0.0
        sources = list(_sources)
        for src in sources:
            c = src.controller
            for lv in [*c.levels.values(), *c.draining]:
                for q in lv.queues:
                    for t in q.items:
                        fs = getattr(t.payload, "fs", None)
                        key = (fs.name if fs is not None else "", lv.spec.name)
                        waiting[key] = waiting.get(key, 0) + 1
            for key, v in src.executing_by_schema.items():
                running[key] = running.get(key, 0) + v
            _add_levels(src, levels)
            used += c.budget.used
            frac = max(frac, c.fair_frac)
            caps = c.budget.backends
            for name in caps.names:
                per_backend[(name,)] = per_backend.get((name,), 0) + caps.in_flight.get(name, 0)
            for name, n in caps.limits.items():
                slots[(name,)] = max(slots.get((name,), 0), n)
            held_total += caps.held_total
        gauge = GaugeMetricFamily
        yield _family(gauge, "gatekeeper_flowcontrol_current_inqueue_requests", "Requests waiting in queues.", _FS_PL,
                      waiting)
        yield _family(gauge, "gatekeeper_flowcontrol_current_executing_requests",
                      "Requests running upstream (watches until their response starts).", _FS_PL, running)
        for k, (name, doc) in PER_LEVEL.items():
            yield _family(gauge, name, doc, ["priority_level"], {(level,): agg[k] for level, agg in levels.items()})
        if sources:
            yield _family(gauge, "gatekeeper_flowcontrol_executing_list_estimated_bytes",
                          "Estimated bytes of LISTs running upstream.", [], {(): used})
            yield _family(gauge, "gatekeeper_flowcontrol_seat_fair_frac",
                          "Fair fraction of the last borrowing allocation.", [], {(): frac})
            yield _family(gauge, "gatekeeper_flowcontrol_expensive_lists_in_flight",
                          "Expensive LISTs running on each apiserver.", ["backend"], per_backend)
            yield _family(gauge, "gatekeeper_flowcontrol_expensive_lists_cap",
                          "This proxy's slots for expensive LISTs on each apiserver (its fleet share).", ["backend"],
                          slots)
            yield _family(CounterMetricFamily, "gatekeeper_flowcontrol_expensive_lists_held",
                          "LISTs that waited because every apiserver had its cap of expensive LISTs.", [],
                          {(): held_total})


REGISTRY.register(_Gauges())
