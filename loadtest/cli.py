"""``python -m loadtest SCENARIO --out DIR`` (also ``gatekeeper loadtest ...``): one seed claim, end to end.

``python -m loadtest bench NAME`` runs one of the benchmarks instead (:mod:`loadtest.bench`).

Brings up the sandbox the scenario needs (or adopts ``--state-dir``), drives the
load with Locust, samples /proc and the components' /metrics, tears down, and
writes DIR/report.md with the seed's figure beside ours, DIR/*.csv and DIR/*.png.
``all`` runs every scenario into DIR/<scenario>/ at its :data:`ALL_SCALES` share
of ``--scale`` (the checked-in reports' scales); ``--scale`` grows or shrinks every scenario, and every arm runs
:data:`RUNS` times, interleaved, unless ``--runs`` says otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from gatekeeper.base.errors import UsageError
from gatekeeper.sandbox.memlimit import parse_limit
from loadtest.harness import report
from loadtest.harness.cluster import ScenarioError
from loadtest.harness.run import RunContext

SCENARIOS = {
    "list-storm": "loadtest.scenarios.list_storm",
    "list-storm-oom": "loadtest.scenarios.oom_storm",
    "skew": "loadtest.scenarios.skew",
    "admission": "loadtest.scenarios.admission",
    "gogc": "loadtest.scenarios.gogc",
    "dra-scale": "loadtest.scenarios.dra_scale",
}
"""In the issue's priority order; ``all`` runs them in this order."""
ARMED = ("list-storm", "list-storm-oom", "skew", "admission")
"""Scenarios that take ``--arms`` and ``--runs`` (gogc and dra-scale interleave their own 3 runs)."""
RUNS = 3
"""``--runs`` when not given: every verdict rests on at least 3 interleaved runs per arm (the reports' method)."""

ALL_SCALES = {"list-storm": 1.0, "list-storm-oom": 1.0, "skew": 0.5, "admission": 0.5, "gogc": 1.0, "dra-scale": 1.0}
"""``all`` multiplies ``--scale`` by these: the scales of the checked-in reports, so ``all`` at ``--scale 1``
reproduces them (each report's setup gives its own command), every arm :data:`RUNS` times: well over 3 hours on a
2-core machine (list-storm-oom's 2 arms at 3 limits x 3 runs took 37 min; its 6 arms about three times that; skew's
6 arms x 3 runs about an hour; gogc 6 and dra-scale 9 fresh sandboxes). A scenario run on its own uses ``--scale``
as given."""
QUICK = 0.25
"""``all --quick`` runs every scenario at this share of its :data:`ALL_SCALES` scale, still :data:`RUNS` runs per
arm interleaved: the same method and verdicts on a smaller storm (fewer objects and clients, shorter arms). Its
figures are not the checked-in reports' (each report's setup gives the scale it ran at)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=[*SCENARIOS, "all"])
    p.add_argument("--out", type=Path, required=True, help="report directory (created; files overwritten)")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="use this running sandbox instead of starting one (it is left running)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every scenario's counts and durations (default 1.0; 0.05 takes seconds)")
    p.add_argument("--runs", type=int, default=None,
                   help=f"run every arm this many times, interleaved (list-storm, list-storm-oom, skew, admission, "
                        f"and those in all; default {RUNS}, the fewest a verdict rests on; 1 for a quick look)")
    p.add_argument("--arms", default="",
                   help="comma-separated arms to run, in this order (list-storm, list-storm-oom, skew, admission; "
                        "default: the scenario's own)")
    p.add_argument("--memory-limits", default="",
                   help="comma-separated apiserver memory limits, e.g. 2Gi,2560Mi,4Gi: every arm runs at each, "
                        "interleaved (list-storm-oom; default: its three around where two LISTs fit)")
    p.add_argument("--quick", action="store_true",
                   help=f"with all: every scenario at {QUICK:g} of its report's scale, same interleaved runs and "
                        "verdicts (figures differ from the checked-in reports')")
    p.add_argument("--keep-work", action="store_true", help="keep the work directory (sandbox logs, specs)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="write reports from a working tree with uncommitted changes (each report says so)")
    return p


def memory_limits(text: str) -> tuple[int, ...]:
    """``--memory-limits``: bytes of each comma-separated size, in the order given (UsageError names a bad one)."""
    return tuple(parse_limit(part.strip()) for part in text.split(",") if part.strip())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # ``python -m loadtest bench NAME``: the benchmarks (loadtest/bench/)
        from loadtest import bench

        return bench.main(argv[1:])
    args = parser().parse_args(argv)
    if not 0 < args.scale <= 100:
        print("--scale must be in (0, 100]", file=sys.stderr)
        return 2
    arms = tuple(a for a in args.arms.split(",") if a)
    if arms and args.scenario not in ARMED:
        print(f"--arms is taken by {', '.join(ARMED)} only", file=sys.stderr)
        return 2
    if args.runs is not None and args.scenario not in (*ARMED, "all"):
        print(f"--runs is taken by {', '.join(ARMED)} and all only", file=sys.stderr)
        return 2
    args.runs = RUNS if args.runs is None else args.runs
    if args.runs < 1:
        print("--runs must be at least 1", file=sys.stderr)
        return 2
    if args.quick and args.scenario != "all":
        print("--quick is taken by all only (a scenario on its own takes --scale)", file=sys.stderr)
        return 2
    try:
        limits = memory_limits(args.memory_limits)
    except UsageError as exc:
        print(f"loadtest: --memory-limits: {exc}", file=sys.stderr)
        return 2
    if limits and args.scenario != "list-storm-oom":
        print("--memory-limits is taken by list-storm-oom only", file=sys.stderr)
        return 2
    try:
        report.PROVENANCE.update(report.provenance(args.allow_dirty))
    except ValueError as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    failed = []
    for name in names:
        out = args.out / name if args.scenario == "all" else args.out
        out.mkdir(parents=True, exist_ok=True)
        scale = args.scale * (ALL_SCALES[name] * (QUICK if args.quick else 1.0) if args.scenario == "all" else 1.0)
        ctx = RunContext(out=out, scale=scale, adopt=args.state_dir, runs=args.runs, arms=arms,
                         memory_limits=limits)
        t0 = time.monotonic()
        ctx.say(f"== {name} (scale {scale:g}) -> {out}; work in {ctx.work}")
        try:
            importlib.import_module(SCENARIOS[name]).run(ctx)
        except ScenarioError as exc:
            print(f"loadtest {name}: error: {exc}", file=sys.stderr)
            failed.append(name)
        except Exception:
            if args.scenario != "all":
                raise
            traceback.print_exc()  # ``all`` goes on with the next scenario; the exit code says one failed
            failed.append(name)
        finally:
            if not args.keep_work:
                shutil.rmtree(ctx.work, ignore_errors=True)
        ctx.say(f"== {name} done in {time.monotonic() - t0:.0f}s: {out / 'report.md'}")
    if failed:
        print(f"loadtest: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
