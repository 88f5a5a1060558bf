"""A scenario run's context (where to write, how big, which sandbox) and Locust in a child process."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from loadtest.harness.cluster import ScenarioError
from loadtest.harness.report import LOCUST_CSV, locust_rows

REPO = Path(__file__).resolve().parents[2]


@dataclass
class RunContext:
    out: Path
    """Where report.md, the CSVs and PNGs go."""
    scale: float = 1.0
    """1.0: a scenario's full size (``all`` scales each by ``loadtest.cli.ALL_SCALES``); tests use ~0.05."""
    adopt: Path | None = None
    """``--state-dir``: a running sandbox to use instead of making one (left running)."""
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gk-loadtest-")))
    """Sandboxes, specs with credentials, logs: never inside ``out``."""
    log: TextIO = sys.stderr
    runs: int = 1
    """``--runs``: how many times each arm runs, interleaved (scenarios that take it)."""
    arms: tuple[str, ...] = ()
    """``--arms``: the arms to run, in this order; empty for the scenario's own list."""
    memory_limits: tuple[int, ...] = ()
    """``--memory-limits`` (bytes, list-storm-oom): every arm runs at each; empty for the scenario's own."""

    def n(self, default: float, minimum: int = 1) -> int:
        """A count scaled by ``--scale``, never below ``minimum``."""
        return max(minimum, round(default * self.scale))

    def say(self, line: str) -> None:
        print(time.strftime("%H:%M:%S ") + line, file=self.log, flush=True)


def run_locust(ctx: RunContext, name: str, spec: dict[str, Any], timeout: float) -> dict[str, dict[str, str]]:
    """Run ``loadtest.harness.driver`` with ``spec``; its CSVs land in ``out/<name>_*.csv``; returns stats rows."""
    spec_path = ctx.work / f"{name}-spec.json"  # holds tokens: stays out of the report directory
    spec_path.write_text(json.dumps(spec))
    prefix = ctx.out / name
    ctx.say(f"  locust {name}: {spec['users']} users of {', '.join(spec['user_classes'])}")
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "loadtest.harness.driver", str(spec_path), str(prefix)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout + 120)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - t0
    log = proc.stdout + proc.stderr
    (ctx.out / f"{name}-locust.log").write_text(log)  # kept with the report: Locust's own CPU warnings are in it
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    new = not (ctx.out / LOCUST_CSV).exists()
    with open(ctx.out / LOCUST_CSV, "a") as out:
        if new:
            out.write("arm,cpu_seconds,wall_seconds,cpu_warnings,load1\n")
        out.write(f"{name},{cpu:.2f},{wall:.2f},{log.count('CPU usage above')},{os.getloadavg()[0]:.2f}\n")
    if proc.returncode != 0 or not prefix.with_name(prefix.name + "_stats.csv").exists():
        raise ScenarioError(f"locust {name} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return locust_rows(prefix)


def ms(row: dict[str, str] | None, column: str) -> float:
    """A Locust stats column as a float (NaN when the row or value is missing)."""
    if not row or row.get(column) in (None, "", "N/A"):
        return float("nan")
    return float(row[column])
