"""Cost of proxy-wide seats: admit + finish through the flow controller, with and without the seat ledger.

Not a test; prints microseconds per request for one uncontended worker (every
request finds a free seat: the common case), so the ledger's price (one file
lock taken and released twice, a few shared-memory reads and writes) shows
against the controller's own work. Run::

    python loadtest/bench_ledger.py [--requests 200000] [--workers 4]
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "flowcontrol"))

from fc_helpers import Req, User
from test_queueing import controller

from gatekeeper.proxy.flowcontrol.edge.ledger import LedgerLevel, SeatLedger


def run(n: int, ledger: SeatLedger | None) -> float:
    fc = controller(total=600)
    if ledger is not None:
        fc.level_factory = functools.partial(LedgerLevel, ledger=ledger)
        fc.levels, fc.draining = {}, []
        fc.update(fc.policy)
    user, req = User("alice"), Req("get", "configmaps", namespace="ns")
    t0 = time.perf_counter()
    for _ in range(n):
        t, _, _ = fc.admit(user, req, 0.0)
        fc.finish(t)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--workers", type=int, default=4, help="columns in the ledger (the scan is over them)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        SeatLedger.create(Path(d) / "ledger", args.workers)
        ledger = SeatLedger(Path(d) / "ledger", 0)
        plain = min(run(args.requests, None) for _ in range(3))
        shared = min(run(args.requests, ledger) for _ in range(3))
    print(f"admit+finish, one free-seat request: local {plain:.2f} us, with the ledger ({args.workers} workers) "
          f"{shared:.2f} us: +{shared - plain:.2f} us per request")


if __name__ == "__main__":
    main()
