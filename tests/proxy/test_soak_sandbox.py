"""A short soak through a 2-worker proxy: each worker's RSS levels off (issue 46).

The load of ``python -m loadtest bench soak`` (loadtest/soak/load.py) at a rate our own asyncio client keeps on a
2-core CI machine: small GETs and LISTs over HTTP/2 connections renewed every minute with a new ServiceAccount token
each minute, five watches cut every 20 s, a ConfigMap patched every 0.5 s. RSS is sampled every
``SAMPLE_SECONDS``; the test fails if a worker's least-squares slope over the last half of the run exceeds
``MAX_SLOPE_MIB_PER_MIN``. The bound comes from this soak run through ``python -m loadtest bench soak`` on a
shared 2-core machine at load 7-11 (loadtest/reports/2026-12-06-proxy-memory-investigation.md): before the fixes
of issue 46 the workers grew +2.74 and +2.56 MiB/min over the last half, with them -0.21 and -0.23; 1.5 leaves
room both ways for a noisy machine. The 60-minute soak is a benchmark (loadtest/reports/), not this test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gatekeeper.sandbox.state import SandboxState
from loadtest.soak import analysis
from loadtest.soak.run import soak

pytestmark = pytest.mark.sandbox

MINUTES = 4.0
SAMPLE_SECONDS = 15.0
RPS = 80.0
MAX_SLOPE_MIB_PER_MIN = 1.5


@pytest.mark.timeout(900)  # 4 minutes of load, the sandbox's proxy start, the load's last round and close
def test_worker_rss_levels_off_under_a_short_soak(sandbox: SandboxState, tmp_path: Path) -> None:
    samples, load, _, _ = soak(sandbox, tmp_path, minutes=MINUTES, rps=RPS, sample_seconds=SAMPLE_SECONDS,
                               driver="python")
    t = load.tally
    header, rows = analysis.growth_table(analysis.summarize(samples))
    table = "\n".join(" | ".join(map(str, r)) for r in [header, *rows])
    workers = {s.process for s in samples if s.process.startswith("worker-")}
    assert len(workers) == 2, table
    name, slope = analysis.worst_worker_slope(samples, 0.5)
    assert slope <= MAX_SLOPE_MIB_PER_MIN, f"{name} grew {slope:.2f} MiB/min over the last half:\n{table}"
    assert t.failed == 0 and t.patches_failed == 0, f"{t.failed} failed, {t.patches_failed} patches: {t.errors}"
    # The load really ran (on a starved machine our client falls behind: it skips, and says so, rather than queue).
    assert t.requests >= RPS * 60 * MINUTES * 0.3, f"the load fell short: {t.requests} requests, {dict(t.statuses)}"
    assert t.watches_started >= 5 * (MINUTES * 3 - 1) and t.patches >= MINUTES * 60, t
