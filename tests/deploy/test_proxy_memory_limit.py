"""The static pod's memory limit is the sizing table's (docs/proxy/memory.md), for the config it ships with.

The figures are the 60-minute soak's (loadtest/reports/2026-12-06-proxy-soak-60min/report.md): the parent and
each worker at plateau, plus each worker's read-ahead and request-body budgets full at the RSS per byte the
read-ahead benchmark measured, for the worker count of deploy/proxy/config.yaml. Raising a budget or the worker
count without the limit fails here.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings
from gatekeeper.proxy.listen.settings import ProtocolSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MIB = 1 << 20
PARENT_MIB = 54
"""The supervisor's RSS, flat through the soak."""
WORKER_PLATEAU_MIB = 75
"""A worker's RSS at the soak's plateau (mean of the last third: 70.6 and 70.8 MiB), with a little room."""
RSS_PER_BUFFERED_BYTE = 1.14
"""RSS a worker gains per byte its read ahead holds (``python -m loadtest bench read-ahead-memory``: +72.8 MiB for
63.9 MiB held); taken for buffered request bodies too."""


def _mib(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * factor
    raise AssertionError(f"unexpected memory quantity {quantity!r}")


def test_the_static_pods_memory_limit_covers_its_workers_with_their_budgets_full() -> None:
    proxy = yaml.safe_load((DEPLOY / "proxy" / "config.yaml").read_text())["proxy"]
    workers = proxy.get("workers", 0)
    assert workers > 0, "a limit cannot be sized for workers: 0 (one per core of whatever node it lands on)"
    read_ahead = (proxy.get("flowControl") or {}).get("readAheadBytes", FlowControlSettings().read_ahead_bytes)
    bodies = (proxy.get("protocol") or {}).get("maxBufferedRequestBytes",
                                               ProtocolSettings().max_buffered_request_bytes)
    need = PARENT_MIB + workers * (WORKER_PLATEAU_MIB + RSS_PER_BUFFERED_BYTE * (read_ahead + bodies) / MIB)
    (container,) = yaml.safe_load((DEPLOY / "proxy" / "static-pod.yaml").read_text())["spec"]["containers"]
    resources = container["resources"]
    limit = _mib(resources["limits"]["memory"])
    assert need <= limit <= need * 1.25, f"limit {limit:.0f} MiB for {need:.0f} MiB (docs/proxy/memory.md)"
    assert _mib(resources["requests"]["memory"]) >= PARENT_MIB + workers * WORKER_PLATEAU_MIB
