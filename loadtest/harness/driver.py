"""Locust through its library API, in a child process: ``python -m loadtest.harness.driver SPEC PREFIX``.

A child because Locust monkey-patches the interpreter with gevent on import,
while the scenario around it (sandbox, samplers, plots) uses threads and
subprocesses. Here Locust does what it is for: the ``Environment`` and local
runner spawn the users, ``stats_history`` and ``StatsCSVFileWriter`` keep the
statistics (PREFIX_stats.csv, PREFIX_stats_history.csv, PREFIX_failures.csv),
and the run ends at ``run_time`` or, with ``until_done``, when every user left.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

import gevent
from locust import events
from locust.env import Environment
from locust.stats import CSV_STATS_INTERVAL_SEC, PERCENTILES_TO_REPORT, StatsCSVFileWriter, stats_history


def resolve(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    prefix = argv[1]
    env = Environment(user_classes=[resolve(p) for p in spec["user_classes"]], events=events)
    env.spec = spec  # type: ignore[attr-defined]
    runner = env.create_local_runner()
    writer = StatsCSVFileWriter(env, PERCENTILES_TO_REPORT, prefix, full_history=True)
    history = gevent.spawn(stats_history, runner)
    writing = gevent.spawn(writer)
    users = int(spec["users"])
    runner.start(users, spawn_rate=float(spec.get("spawn_rate", users)))
    deadline = time.monotonic() + float(spec["run_time"])
    spawned = time.monotonic() + users / float(spec.get("spawn_rate", users)) + 1
    while time.monotonic() < deadline:
        gevent.sleep(0.5)
        if spec.get("until_done") and time.monotonic() > spawned and runner.user_count == 0:
            break
    runner.quit()
    gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)  # one more pass of the writer with the final figures
    writing.kill()
    history.kill()
    writer.close_files()
    total = env.stats.total
    print(json.dumps({"requests": total.num_requests, "failures": total.num_failures,
                      "timed_out": time.monotonic() >= deadline}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
