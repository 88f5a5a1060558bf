"""``gogc``: "High memory usage until we restart the apiserver ... GOGC 100 -> 50".

Steady churn for a fixed time (Secrets and Pods created, updated, deleted, with
periodic LISTs) against apiservers restarted with GOGC=100, then with GOGC=50.
Apiserver RSS and Go heap are sampled throughout; at the end the apiservers are
restarted once more and the RSS a restart frees is measured (the seed saw up to 40%).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from loadtest.harness import cluster
from loadtest.harness.report import MIB, Report, line_plot
from loadtest.harness.run import RunContext, ms, run_locust
from loadtest.harness.sampler import Sampler, proc_figures, write_rows

NAME = "gogc"
ARMS = (100, 50)
CLAIM = """High memory usage until we restart the apiserver: the apiserver frees up to 40% of its memory when
restarted. Main suspect: garbage collection. Tuned GOGC from the default 100 to 50. Result: lower memory
utilisation and no more growth over time. (seed 000, KubeCon EU 2025)"""


def _rss(state: SandboxState) -> int:
    recs = cluster.apiserver_records(state)
    return sum((proc_figures(r.pid) or (0, 0.0))[0] for r in recs)


def slope_mib_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of the second half of ``points`` (RSS bytes over seconds), in MiB per minute."""
    half = points[len(points) // 2:]
    if len(half) < 2:
        return float("nan")
    n = len(half)
    mt = sum(t for t, _ in half) / n
    mv = sum(v for _, v in half) / n
    den = sum((t - mt) ** 2 for t, _ in half)
    return (sum((t - mt) * (v - mv) for t, v in half) / den) * 60 / MIB if den else float("nan")


def run(ctx: RunContext) -> None:
    users, duration = ctx.n(8, 2), max(20.0, 240 * ctx.scale)
    report = Report(ctx.out, "gogc: apiserver memory under churn, GOGC 100 vs 50", CLAIM)
    samplers: list[Sampler] = []
    results: list[dict[str, Any]] = []
    with cluster.sandbox(ctx.work / "sandbox", ctx.adopt, ctx.log) as state:
        report.use_sandbox(state)
        for gogc in ARMS:
            arm, ns = f"GOGC={gogc}", f"loadtest-gogc-{gogc}"
            cluster.restart_apiservers(state, env={"GOGC": str(gogc)})
            identities = cluster.tenants(state, ns, users, ctx.work)
            with cluster.admin(state) as c:
                c.post(f"/api/v1/namespaces/{ns}/serviceaccounts",
                       json={"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
            time.sleep(2)
            sampler = Sampler(state, arm, interval=1.0)
            spec = {"user_classes": ["loadtest.harness.users:ChurnUser"], "users": users, "spawn_rate": users,
                    "run_time": duration, "targets": state.apiserver_urls, "identities": identities,
                    "namespace": ns, "ca": str(SandboxPKI(Path(state.certs_dir)).ca), "secret_bytes": 64 * 1024}
            with sampler:
                rows = run_locust(ctx, arm, spec, timeout=duration)
                before = _rss(state)
                sampler.mark("restart all apiservers")
                cluster.restart_apiservers(state, env={"GOGC": str(gogc)})
                time.sleep(5)
                after = _rss(state)
                sampler.mark("after restart")
            samplers.append(sampler)
            rss = sampler.summed("kube-apiserver", "rss_bytes")
            during = [v for t, v in rss if t <= duration]
            results.append({"arm": arm, "rows": rows, "before": before, "after": after,
                            "mean": sum(during) / len(during) if during else float("nan"),
                            "peak": max(during, default=0.0), "slope": slope_mib_per_min(rss[:len(during)]),
                            "heap_peak": sampler.peak("kube-apiserver", "heap_bytes")})
            ctx.say(f"  {arm}: RSS {before / MIB:.0f} MiB before restart, {after / MIB:.0f} after")
    write_rows(ctx.out / "samples.csv", samplers)
    report.csvs += ["samples.csv", *[f"GOGC={g}_stats.csv" for g in ARMS]]
    report.setup["load"] = (f"{users} tenant users churning (create/update/delete 64 KiB Secrets, create/delete "
                            f"Pods, LIST Secrets) for {duration:.0f} s per arm over 3 apiservers; apiservers "
                            "restarted with the arm's GOGC before it, and again at its end")
    table = []
    for r in results:
        freed = 1 - r["after"] / r["before"] if r["before"] else float("nan")
        agg = r["rows"].get("Aggregated")
        table.append([r["arm"], f"{r['mean'] / MIB:.0f}", f"{r['peak'] / MIB:.0f}", f"{r['heap_peak'] / MIB:.0f}",
                     f"{r['slope']:+.1f}", f"{r['before'] / MIB:.0f}", f"{r['after'] / MIB:.0f}",
                     f"{freed * 100:.0f}%", ms(agg, "Requests/s"), int(ms(agg, "Failure Count"))])
        r["freed"] = freed
    report.table(["arm", "mean RSS MiB", "peak RSS MiB", "peak Go heap MiB", "RSS slope, 2nd half MiB/min",
                  "RSS before restart", "RSS after restart", "freed by restart", "req/s", "failed"], table,
                 "Sum over the 3 apiservers")
    a, b = results[0], results[-1]
    report.seed_vs_ours += [
        ("RSS freed by a restart (GOGC=100)", "up to 40%", f"{a['freed'] * 100:.0f}%"),
        ("RSS freed by a restart (GOGC=50)", "(not given)", f"{b['freed'] * 100:.0f}%"),
        ("mean RSS, GOGC 50 vs 100", "lower", f"x{b['mean'] / a['mean']:.2f}"),
        ("RSS growth over time, GOGC 100 -> 50", "stops growing",
         f"{a['slope']:+.1f} -> {b['slope']:+.1f} MiB/min"),
    ]
    line_plot(report.plot("rss.png", "Apiserver RSS (sum of 3) under churn, per GOGC; restart at the end"),
              "Apiserver RSS, sum of 3", "MiB", {s.arm: s.summed("kube-apiserver", "rss_bytes") for s in samplers},
              events=samplers[0].events[:1], scale=MIB)
    line_plot(report.plot("heap.png", "Apiserver Go heap in use (go_memstats_heap_alloc_bytes, sum of 3)"),
              "Apiserver Go heap, sum of 3", "MiB", {s.arm: s.summed("kube-apiserver", "heap_bytes") for s in samplers},
              scale=MIB)
    report.write()
