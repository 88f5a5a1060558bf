"""``python -m loadtest bench soak --minutes N --rps R``: does the proxy's memory level off under a steady load?

Starts a proxy of its own (2 workers, the flow-control policy ``sandbox up --with-proxy`` deploys) in front of a
sandbox's apiservers (``--state-dir``, or a new sandbox with 3 apiservers), drives :mod:`loadtest.soak.load` through
it, samples every process's RSS each ``--sample-seconds``, and writes ``--out``/report.md: start, plateau and the
slope over the last third per process and for the whole tree, a plot, the samples as CSV, and provenance.
``--tracemalloc 1,10,30`` also has each worker write a tracemalloc snapshot and its allocators' statistics at those
minutes, and the report compares them by allocation site (tracemalloc slows the workers: its RSS is not the
deployed one). Not a test: the suite's short soak (tests/proxy/test_soak_sandbox.py) asserts a bound.
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gatekeeper.proxy.memtrace import DIR_ENV, FRAMES_ENV
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess, metric_sum
from gatekeeper.sandbox.with_proxy import default_flow_control
from loadtest.harness import report
from loadtest.harness.cluster import sandbox
from loadtest.soak import analysis, procmem, snapshots
from loadtest.soak.load import Load, prepare

WORKERS = 2


def start_proxy(state: SandboxState, work: Path, workers: int = WORKERS, extra: dict[str, Any] | None = None,
                env: dict[str, str] | None = None) -> ProxyProcess:
    """A fresh proxy as ``sandbox up --with-proxy`` configures it, with ``env`` added to its environment."""
    user: dict[str, Any] = {"flowControl": default_flow_control(), **(extra or {})}
    proxy = ProxyProcess(state, work, name="soak-proxy", user_config=user, workers=workers)
    proxy.start(timeout=120, env=env)
    return proxy


def soak(state: SandboxState, work: Path, *, minutes: float, rps: float, sample_seconds: float = 60.0,
         driver: str = "auto", tracemalloc_at: list[float] | None = None, round_seconds: float = 60.0,
         trace: bool = True, on_sample: Any = None, base: Path | None = None,
         ) -> tuple[list[analysis.Sample], Load, Path | None, str]:
    """Run the soak; the samples (minute 0 is before the load), the load's tally, the dump directory, the proxy's
    metrics page at the end. ``tracemalloc_at``: minutes at which each worker dumps its allocators' statistics, and
    with ``trace`` a tracemalloc snapshot too."""
    prepare(state)
    snaps = work / "snapshots" if tracemalloc_at else None
    env = {DIR_ENV: str(snaps)} if snaps else {}
    if snaps and not trace:
        env[FRAMES_ENV] = "0"  # the allocators' statistics only, at the deployed speed
    if base is not None:
        # PYTHONSAFEPATH: `python -m gatekeeper` would put the working directory (this tree) first on sys.path.
        env.update(PYTHONPATH=str(base), PYTHONSAFEPATH="1")
    proxy = start_proxy(state, work, env=env)
    assert proxy.proc is not None
    root = proxy.proc.pid
    load = Load(state=state, url=proxy.url, ca=Path(proxy.ca), work=work, rps=rps, driver=driver,
                round_seconds=round_seconds)
    samples: list[analysis.Sample] = []
    pending = sorted(tracemalloc_at or [])
    try:
        samples += procmem.sample_tree(root, 0.0)
        load.start()
        t0 = time.monotonic()
        step = 1
        while True:
            at = t0 + step * sample_seconds
            if at - t0 > minutes * 60 + 1e-6:
                break
            time.sleep(max(0.0, at - time.monotonic()))
            minute = (time.monotonic() - t0) / 60
            now = procmem.sample_tree(root, round(minute, 3))
            samples += now
            if on_sample is not None:
                on_sample(now)
            while pending and minute + 1e-6 >= pending[0]:
                pending.pop(0)
                for s in now:
                    if s.process.startswith("worker-"):
                        os.kill(s.pid, signal.SIGUSR2)
            step += 1
    finally:
        load.close()
        try:
            page = proxy.metrics()
        except OSError as exc:
            page = f"# metrics unavailable: {exc}"
        proxy.stop()
    return samples, load, snaps, page


def write_csv(path: Path, samples: list[analysis.Sample]) -> None:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(asdict(samples[0])))
        w.writeheader()
        for s in samples:
            w.writerow(asdict(s))


GC_FIGURES = {"timed full collections": "gatekeeper_proxy_gc_full_collections_total",
              "objects they freed": "gatekeeper_proxy_gc_full_collected_objects_total",
              "seconds they held the loops": "gatekeeper_proxy_gc_full_seconds_total"}


def write_report(out: Path, samples: list[analysis.Sample], load: Load, snaps: Path | None, page: str,
                 rep: report.Report) -> Path:
    t = load.tally
    rows = analysis.summarize(samples)
    header, table = analysis.growth_table(rows)
    rep.table(header, table, "RSS (VmRSS), MiB")
    header, table = analysis.growth_table(analysis.summarize(samples, "anon"))
    rep.table(header, table, "Anonymous memory (RssAnon), MiB")
    total = next(g for g in rows if g.process == "total")
    rep.seed_vs_ours += [
        ("failed requests", "0", f"{t.failed} of {t.requests}"),
        ("proxy RSS slope over the last third", "<= 0.5 MiB/min", f"{total.slope_last_third:+.3f} MiB/min"),
        ("proxy RSS start -> end", "174 -> 476 MiB in 60 min (the issue's run)", f"{total.start:.0f} -> "
                                                                                 f"{total.end:.0f} MiB"),
    ]
    rep.text(f"Requests: {t.requests} in {t.rounds} rounds ({load.driver_name()}), {t.failed} failed; "
             f"statuses {dict(t.statuses)}. Watches started {t.watches_started}, ended before their cut "
             f"{t.watches_ended_early}. Patches {t.patches}, failed {t.patches_failed}." +
             ("\n\nFirst errors:\n\n" + "\n".join(f"- `{e}`" for e in t.errors) if t.errors else ""))
    rep.text("Garbage collection in all workers at the end (the proxy's metrics): " + ", ".join(
        f"{what} {metric_sum(page, name):.4g}" for what, name in GC_FIGURES.items()) + ".")
    report.line_plot(rep.plot("rss.png", "RSS per process and in all, MiB, sampled each minute"),
                     "proxy RSS under the soak", "MiB", analysis.series(samples), xlabel="minutes")
    write_csv(out / "samples.csv", samples)
    rep.csvs.append("samples.csv")
    if snaps is not None and snaps.exists():
        for worker, stats in snapshots.by_worker(snaps, ".malloc.txt").items():
            rep.table(["dump", "traced Python MiB", "glibc system MiB", "glibc in use MiB", "glibc free held MiB",
                       "glibc arenas", "pymalloc arenas"], snapshots.allocator_rows(stats),
                      f"{worker}: Python objects and the allocators at each dump")
        for worker, files in snapshots.by_worker(snaps).items():
            if len(files) > 1:
                rep.table(["allocation site (innermost frames)", "KiB first", "KiB last", "growth KiB", "blocks"],
                          snapshots.growth_rows(files[0], files[-1]),
                          f"{worker}: allocation sites by growth, first to last snapshot")
    return rep.write()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtest bench soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="how long the load runs (default 60)")
    ap.add_argument("--rps", type=float, default=300.0, help="small requests per second in all (default 300)")
    ap.add_argument("--out", type=Path, default=None, help="report directory (default: a new temporary one)")
    ap.add_argument("--state-dir", type=Path, default=None,
                    help="a running sandbox (3 apiservers); default: bring one up for the run and down after")
    ap.add_argument("--sample-seconds", type=float, default=60.0, help="RSS sampling interval (default 60)")
    ap.add_argument("--driver", choices=["auto", "h2load", "python"], default="auto",
                    help="small-request client: h2load (nghttp2-client) or our own asyncio one (default: h2load "
                         "when installed)")
    ap.add_argument("--tracemalloc", default="", metavar="MINUTES",
                    help="comma-separated minutes at which each worker writes a tracemalloc snapshot (slows it)")
    ap.add_argument("--malloc-stats", default="", metavar="MINUTES",
                    help="comma-separated minutes at which each worker dumps glibc's and pymalloc's statistics "
                         "(no tracemalloc: full speed)")
    ap.add_argument("--base", type=Path, default=None,
                    help="run the proxy from this source tree instead (git archive COMMIT gatekeeper | tar -x -C DIR)")
    ap.add_argument("--allow-dirty", action="store_true", help="write the report from an uncommitted tree")
    return ap


def main() -> int:
    args = parser().parse_args()
    try:
        report.PROVENANCE.update(report.provenance(args.allow_dirty))
    except ValueError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="soak-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="soak-work-"))
    trace = bool(args.tracemalloc.strip())
    at = [float(x) for x in (args.tracemalloc if trace else args.malloc_stats).split(",") if x.strip()]
    rep = report.Report(out=out, title=f"Proxy memory under a {args.minutes:g}-minute soak at {args.rps:g} req/s",
                        command=shlex.join(["python", "-m", "loadtest", "bench", "soak", *sys.argv[1:]]),
                        claim="Issue 46: a proxy in front of the control plane runs for months; its memory has to "
                              "reach a plateau an operator can size for. Done when a 60-minute soak at 300 req/s has "
                              "0 failed requests and the proxy's RSS grows <= 0.5 MiB/min over the last third.")
    rep.setup.update({"proxy source": str(args.base) if args.base else "this tree", "workers": str(WORKERS),
                      "rps": f"{args.rps:g}", "minutes": f"{args.minutes:g}",
                      "tracemalloc at": args.tracemalloc or "off", "allocator statistics at":
                          args.tracemalloc or args.malloc_stats or "off"})

    def progress(now: list[analysis.Sample]) -> None:
        print(f"{time.strftime('%H:%M:%S')} min {now[0].minute:5.1f} load {os.getloadavg()[0]:.2f} " +
              " ".join(f"{s.process} {s.rss / analysis.MIB:.1f}" for s in now), flush=True)

    with open(work / "sandbox.log", "w") as log, sandbox(work / "sandbox", args.state_dir, log) as state:
        rep.use_sandbox(state)
        samples, load, snaps, page = soak(state, work, minutes=args.minutes, rps=args.rps,
                                          sample_seconds=args.sample_seconds, driver=args.driver,
                                          tracemalloc_at=at, trace=trace, on_sample=progress, base=args.base)
    rep.setup["load driver"] = load.driver_name()
    path = write_report(out, samples, load, snaps, page, rep)
    print(f"report: {path}")
    return 0 if load.tally.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
