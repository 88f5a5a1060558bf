"""list-storm-oom's report: its CSVs, the run table, the per-(limit, arm) summary, the verdicts and the plots.

Kept apart from the run loop (:mod:`loadtest.scenarios.oom_storm`) so that each stays readable; everything here
reads the finished runs' figures and writes files, nothing touches the sandbox.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from typing import Any

from loadtest.harness.report import MIB, Report, line_plot
from loadtest.harness.rounds import spread
from loadtest.harness.run import RunContext
from loadtest.harness.sampler import Sampler, write_rows
from loadtest.scenarios.oom_kills import FAILOVER_MIN_LAG, FAILOVER_WINDOW, verdicts


def write(ctx: RunContext, report: Report, samplers: list[Sampler], results: list[dict[str, Any]],
          arm_events: Sequence[tuple[str, dict[str, Any]]], names: list[str], setup: dict[str, Any]) -> None:
    write_rows(ctx.out / "samples.csv", samplers)
    _kills_csv(ctx, results, arm_events)
    listers, limits = setup["listers"], setup["limits"]
    locust = [r["label"] for r in results if not r["arm"].startswith("informers-")]
    report.csvs += ["samples.csv", *(["kills.csv", "events.csv"] if arm_events else []),  # linked when not empty
                    *[f"{label}_stats.csv" for label in locust]]
    report.setup.update({
        "load": f"{setup['secrets']} Secrets x {setup['secret_kib']} KiB (type helm.sh/release.v1; one LIST is about "
                f"{setup['secrets'] * setup['secret_kib'] * 4 // 3 // 1024} MiB of JSON), {listers} tenant listers "
                "(half client certificates, half ServiceAccount tokens), one full LIST each; 429 retried after "
                "Retry-After and a cut LIST re-sent with client-go's reflector back-off (0.8 s doubling to 30 s) until "
                f"it completes; a run ends after {setup['arm_seconds']} s (a LIST not done by then is not ok)",
        "apiservers": "3 kube-apiservers on one etcd, each in a memory cgroup of "
                      f"{', '.join(f'{x / MIB:.0f}' for x in limits)} MiB (swap excluded; the limit set while "
                      "they are stopped, before each run), restarted after an OOM kill with kubelet's back-off (10 s "
                      "doubling, fresh per run), flags + " + " ".join(setup["storage_reads"]) + "; etcd "
                      + " ".join(setup["etcd"]),
        "runs": f"{ctx.runs} per arm and limit, interleaved: every (limit, arm) once per round, in the order of the "
                "run table, each on freshly restarted apiservers",
        "kills": f"own-load or failover: a failover kill is one {FAILOVER_MIN_LAG:g}-{FAILOVER_WINDOW:g} s after "
                 "another apiserver's kill, where clients can move (not in direct arms), and whose tenant requests in "
                 "flight rose after that kill (the timing alone where the observer FlowSchema is absent, the "
                 "kube-apf arms, or the apiserver's /metrics went unread)",
    })
    report.table(["limit MiB", "arm", "runs", "OOM kills", "own-load", "failover", "s all apiservers down",
                  "LISTs (informers: syncs) ok", "LIST p50 s", "peak RSS MiB (max of 3)"],
                 _summary(results, listers),
                 "Per memory limit and arm, median [min-max] over its runs")
    lines = verdicts(results)
    if lines:
        report.text("### Verdicts\n\nThresholds fixed in `loadtest/scenarios/oom_kills.py` before the runs; a bound "
                    "holds only when every run keeps it, and ranges that overlap are not distinguished.\n\n"
                    + "\n".join(lines))
    report.table(["order", "run", "limit MiB", "load (1 min) before -> after", "load generator CPU s", "OOM kills",
                  "own-load", "failover (s: apiserver after peer)", "kills per apiserver (1 2 3)",
                  "s all apiservers down", "s down per apiserver", "LISTs (informers: syncs) ok", "LIST p50 s",
                  "LIST p99 s (informers: last sync)", "429s",
                  "LISTs re-sent after an error (informers: LISTs of a watch-list informer)",
                  "peak RSS MiB per apiserver", "wall s"],
                 [_run_row(i, r, names, listers) for i, r in enumerate(results, 1)],
                 "Runs in the order run. Kills from the apiservers' memory cgroups (supervisor events); down: from a "
                 "kill to its restart")
    _seed_rows(report, results, listers)
    for s, r in zip(samplers, results, strict=True):
        if r["round"] == 1:
            line_plot(report.plot(f"rss-{s.arm}.png", f"{s.arm}: apiserver RSS, OOM kills marked"),
                      f"{s.arm}: RSS per apiserver (seconds from the run's start; gaps: down)", "MiB",
                      s.series("kube-apiserver", "rss_bytes"), events=s.events, scale=MIB)
    report.write()


def _summary(results: list[dict[str, Any]], listers: int) -> list[list[object]]:
    rows: list[list[object]] = []
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["limit"], r["arm"]), []).append(r)
    for (limit, arm), runs in sorted(groups.items(), key=lambda kv: kv[0][0]):
        p50s = [r["p50"] for r in runs if not math.isnan(r["p50"])]  # NaN: no LIST ended
        rows.append([f"{limit / MIB:.0f}", arm, len(runs), spread([len(r["kills"]) for r in runs]).show("g"),
                     spread([r["own"] for r in runs]).show("g"), spread([r["failover"] for r in runs]).show("g"),
                     spread([r["all_down"] for r in runs]).show(".0f"),
                     f"{spread([r['ok'] for r in runs]).show('g')} of {listers}",
                     spread(p50s).show(".1f") if p50s else "n/a",
                     spread([max(r["peak"].values(), default=0.0) / MIB for r in runs]).show(".0f")])
    return rows


def _run_row(order: int, r: dict[str, Any], names: list[str], listers: int) -> list[object]:
    failover = " ".join(f"{k.t:.1f}: {k.apiserver.removeprefix('kube-')} after {k.after.removeprefix('kube-')}"
                        for k in r["classified"] if k.kind == "failover") or "-"
    return [order, r["label"], f"{r['limit'] / MIB:.0f}", f"{r['load'][0]:.2f} -> {r['load'][1]:.2f}",
            f"{r['generator_cpu']:.1f}", len(r["kills"]), r["own"], failover,
            " ".join(f"{r['per_apiserver'][n]}" for n in names), f"{r['all_down']:.0f}",
            " ".join(f"{r['down'][n]:.0f}" for n in names), f"{r['ok']}/{listers}", r["p50"], r["p99"], r["429"],
            r["relisted"], " ".join(f"{r['peak'].get(n, 0) / MIB:.0f}" for n in names), f"{r['wall']:.0f}"]


def _kills_csv(ctx: RunContext, results: list[dict[str, Any]], arm_events: Sequence[tuple[str, dict[str, Any]]]
               ) -> None:
    with (ctx.out / "kills.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["run", "arm", "limit_mib", "seconds_from_run_start", "apiserver", "kind", "after", "evidence"])
        for r in results:
            for k in r["classified"]:
                w.writerow([r["label"], r["arm"], r["limit"] >> 20, f"{k.t:.1f}", k.apiserver, k.kind, k.after,
                            k.evidence])
    starts = {r["label"]: r["start"] for r in results}
    with (ctx.out / "events.csv").open("w", newline="") as fh:  # every kill and restart, from the run's start
        w = csv.writer(fh)
        w.writerow(["run", "seconds_from_run_start", "apiserver", "event"])
        for label, e in arm_events:
            w.writerow([label, f"{e['time'] - starts[label]:.1f}", e["component"], e["event"]])


def _seed_rows(report: Report, results: list[dict[str, Any]], listers: int) -> None:
    """The seed's figures beside ours, per limit: kills and failover kills of HAProxy TCP, the seeds' own APF and
    gatekeeper (medians over the runs)."""
    for limit in sorted({r["limit"] for r in results}):
        at = [r for r in results if r["limit"] == limit]

        def of(arm: str, at: list[dict[str, Any]] = at) -> list[dict[str, Any]]:
            return [r for r in at if r["arm"] == arm]

        mib = f"{limit / MIB:.0f} MiB"
        for arm, what, seed in (("haproxy", "HAProxy TCP (the seeds' load balancer)", "OOM crashes and the cascade"),
                                ("haproxy-kube-apf", "HAProxy TCP, the seeds' APF in the apiservers",
                                 "decreased OOM crashes"),
                                ("gatekeeper", "gatekeeper (seeds' policy, 2 concurrent LISTs)", "-")):
            runs = of(arm)
            if runs:
                report.seed_vs_ours.append((
                    f"{mib}: OOM kills, {what}", seed,
                    f"{spread([len(r['kills']) for r in runs]).show('g')} "
                    f"(failover {spread([r['failover'] for r in runs]).show('g')}), "
                    f"LISTs ok {spread([r['ok'] for r in runs]).show('g')} of {listers}"))
