"""skew's report: its CSVs, the per-run and per-arm tables, the verdicts and each run's panels.

Kept apart from the run loop (:mod:`loadtest.scenarios.skew`, which imports this module when it writes) so each
stays readable. The verdicts are judged over every run of an arm against thresholds fixed here before any run.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtest.harness.report import MIB, Report
from loadtest.harness.rounds import apart_verdict, bound_verdict, floor_verdict
from loadtest.harness.rounds import spread as over_runs
from loadtest.harness.run import RunContext
from loadtest.harness.sampler import Sampler, write_rows
from loadtest.scenarios.skew import BALANCED, RESTARTED, SECRET_KIB, STORAGE_READS, spread

SKEWED = 1.5
"""HAProxy TCP shows the seeds' memory skew: peak RSS max/min across the apiservers at least this in every run."""
EVEN = 1.3
"""Per-request balancing keeps peak RSS max/min at most this in every run."""


def verdicts(results: Sequence[dict[str, Any]]) -> list[str]:
    """From each run's ``arm`` and ``skew`` (peak RSS max/min across apiservers after the storm)."""
    by: dict[str, list[float]] = {}
    for r in results:
        by.setdefault(str(r["arm"]), []).append(float(r["skew"]))
    lines = []
    base = by.get("haproxy")
    if base:
        lines.append(f"- HAProxy TCP leaves a memory skew (peak RSS max/min >= {SKEWED} in every run): "
                     f"**{floor_verdict(base, SKEWED)}**: {over_runs(base).show('.2f')}")
    for arm, values in by.items():
        if arm.startswith("gatekeeper"):
            lines.append(f"- {arm} keeps the apiservers even (peak RSS max/min <= {EVEN} in every run): "
                         f"**{bound_verdict(values, EVEN)}**: {over_runs(values).show('.2f')}")
        if base and arm != "haproxy":
            lines.append(f"- {arm} skews less than HAProxy TCP in every run: **{apart_verdict(values, base)}**: "
                         f"{over_runs(values).show('.2f')} against {over_runs(base).show('.2f')}")
    if "haproxy-goaway" in by and "haproxy-goaway-0.02" in by:
        lines.append("- --goaway-chance=0.02 skews less than 0.001 in every run: "
                     f"**{apart_verdict(by['haproxy-goaway-0.02'], by['haproxy-goaway'])}**")
    return lines


def write(ctx: RunContext, report: Report, samplers: list[Sampler], results: list[dict[str, Any]],
           duration: float, python_clients: int, gogo_clients: int, rate: float, window: float,
           secrets: int) -> None:
    write_rows(ctx.out / "samples.csv", samplers)
    with (ctx.out / "events.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["arm", "t", "event"])
        w.writerows((s.arm, f"{t:.1f}", what) for s in samplers for t, what in s.events)
    report.csvs += ["samples.csv", "events.csv", *[f"{r['label']}_stats.csv" for r in results]]
    with (ctx.out / "shares.csv").open("w") as fh:
        fh.write("arm,t,apiserver,share\n")
        for r in results:
            for n, pts in r["shares"].items():
                fh.writelines(f"{r['label']},{t:.1f},{n},{v:.4f}\n" for t, v in pts)
    report.csvs.append("shares.csv")
    report.setup["load"] = (
        f"{python_clients} Python HTTP/2 clients (httpx, one connection each) + {gogo_clients} client-go clients "
        f"(kubectl proxy), each {rate:.0f} LIST configmaps?limit=1 per second, {duration:.0f} s per arm; "
        f"{RESTARTED} restarted at {duration / 6:.0f} s (events.csv); at {duration * 2 / 3:.0f} s every client "
        f"sends one full LIST of {secrets} Secrets x {SECRET_KIB} KiB on its own connection; shares over "
        f"{window:.0f} s windows from each apiserver's apiserver_request_total; RSS from /proc, Go heap "
        "(go_memstats_heap_alloc_bytes) from each apiserver's /metrics, the front's established connections "
        "to each apiserver from /proc/net/tcp, every second")
    report.setup["apiservers"] = "3 kube-apiservers on one etcd, each arm's --goaway-chance + " + " ".join(
        STORAGE_READS) + " (every Secret LIST reads etcd)"
    report.setup["runs"] = (f"{ctx.runs} per arm, interleaved (every arm once per round, in the order of the "
                            "tables), each on freshly restarted apiservers")

    def fmt(h: float | None, r: dict[str, Any]) -> str:
        return f"{h:.0f} s" if h is not None else f"not within the run (> {duration - r['since']:.0f} s)"

    def per(values: dict[str, float], scale: float = MIB) -> str:
        return " / ".join(f"{v / scale:.0f}" for _, v in sorted(values.items()))

    rows, mem_rows = [], []
    for r in results:
        final = r["final"]
        low = min(final.values()) if final else 0.0
        ratio = f"{max(final.values()) / low:.2f}" if low > 0 else "inf (one apiserver idle)"
        rows.append([r["label"], f"{r['load'][0]:.2f} -> {r['load'][1]:.2f}", f"{r['generator_cpu']:.1f}",
                     fmt(r["healed"], r), " / ".join(f"{v:.2f}" for _, v in sorted(final.items())),
                     ratio, r["rps"], r["p99"], r["requests"], r["failures"],
                     f"{r['lifetime']:.0f} s" if r["lifetime"] else "-"])
        m = r["mem"]
        mem_rows.append([r["label"], per(m["conns"], 1), per(m["before"]), per(m["peak"]), f"{spread(m['peak']):.2f}",
                         per(m["growth"]), f"{spread(m['growth']):.2f}", per(m["end"]), f"{spread(m['end']):.2f}",
                         per(m["heap"]), f"{r['lists_ok']}/{python_clients + gogo_clients}", r["list_p99"],
                         r["throttled"]])
    report.table(["run", "load (1 min) before -> after", "load generator CPU s",
                  f"time until max/min share <= {BALANCED} after the restart",
                  "final shares (1/2/3)", "final max/min", "req/s", "small LIST p99 ms", "requests", "failed",
                  "expected connection lifetime (1 / (goaway chance x req/s per connection))"], rows,
                 "Requests per apiserver")
    report.table(["run", "front's connections before the storm (1/2/3)", "RSS before the storm MiB (1/2/3)",
                  "peak RSS MiB (1/2/3)", "peak max/min", "RSS growth by the storm MiB (1/2/3)", "growth max/min",
                  "RSS at the end MiB (1/2/3)", "end max/min", "peak Go heap MiB (1/2/3)", "storm LISTs ok",
                  "storm LIST p99 s (waits included)",
                  "429 answers (retried)"], mem_rows, "Memory per apiserver: the LIST storm after the restart")
    report.text(
        "Memory follows requests: the storm's LISTs land on the apiservers that hold the clients' connections. "
        "Go returns freed heap to the OS slowly, so the RSS an apiserver reached stays for minutes after the "
        "storm (the end column): the skew the seed saw between apiserver pods. max/min is inf where one "
        "apiserver grew by nothing.")
    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by.setdefault(r["arm"], []).append(r)
    report.table(["arm", "runs", "peak RSS max/min", "RSS growth max/min", "balanced within the run",
                  "time to balance s (runs that did)"],
                 [[arm, len(runs), over_runs([r["skew"] for r in runs]).show(".2f"),
                   over_runs([spread(r["mem"]["growth"]) for r in runs]).show(".2f"), _balanced(runs),
                   over_runs(healed).show(".0f") if (healed := _healed(runs)) else "-"] for arm, runs in by.items()],
                 "Per arm, median [min-max] over its runs")
    lines = verdicts(results)
    if lines:
        report.text("### Verdicts\n\nThresholds fixed in `loadtest/scenarios/skew_report.py` before the runs; a "
                    "bound holds only when every run keeps it, and ranges that overlap are not distinguished.\n\n"
                    + "\n".join(lines))
    for arm, seed in (("haproxy", "large skew (seed)"), ("haproxy-goaway", "within 15 minutes (seed)"),
                      ("haproxy-goaway-0.02", "(not in the seed)"), ("gatekeeper", "n/a (the project's fix)")):
        if arm in by:
            healed = _healed(by[arm])
            shown = f"{over_runs(healed).show('.0f')} s" if healed else "-"
            report.seed_vs_ours.append((f"time to balance requests after an apiserver restart, {arm}", seed,
                                        f"{shown} ({_balanced(by[arm])} runs balanced within the run)"))
    for arm, seed in (("haproxy", "large skew in memory between apiserver pods (seed)"),
                      ("haproxy-goaway", "goaway-chance fixes it (seed)"),
                      ("haproxy-kube-apf", "(the seeds' APF fix of the LIST storm, not their skew fix)"),
                      ("haproxy-goaway-0.02", "(not in the seed)"),
                      ("gatekeeper", "n/a (the project's fix)"), ("gatekeeper-policy", "n/a (the project's fix)")):
        if arm in by:
            report.seed_vs_ours.append((f"peak apiserver RSS after the restart and the LIST storm, max/min across "
                                        f"apiservers, {arm}", seed,
                                        over_runs([r["skew"] for r in by[arm]]).show(".2f")))
    for s, r in zip(samplers, results, strict=True):
        _panels(report.plot(f"skew_{s.arm}.png", f"Requests, connections and memory per apiserver, {s.arm}"),
                s, r)
    report.write()


def _healed(runs: list[dict[str, Any]]) -> list[float]:
    return [float(r["healed"]) for r in runs if r["healed"] is not None]


def _balanced(runs: list[dict[str, Any]]) -> str:
    return f"{len(_healed(runs))} of {len(runs)}"


def _panels(path: Path, sampler: Sampler, result: dict[str, Any]) -> None:
    """Three panels over one time axis: share of requests, the front's connections, RSS; events marked."""
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    panels = ((result["shares"], "share of requests", 1.0),
              (sampler.series("kube-apiserver", "connections"), "front's connections", 1.0),
              (sampler.series("kube-apiserver", "rss_bytes"), "RSS MiB", MIB))
    for ax, (series, label, scale) in zip(axes, panels, strict=True):
        for name, pts in sorted(series.items()):
            ax.plot([t for t, _ in pts], [v / scale for _, v in pts], label=name, linewidth=1.2)
        for t, what in sampler.events:
            ax.axvline(t, color="grey", linestyle=":", linewidth=1)
            if ax is axes[0]:
                ax.annotate(what, (t, 1.0), rotation=90, fontsize=7, va="top", ha="right")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper right")
    axes[0].set_title(f"skew, {sampler.arm}")
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
