"""The proxy benchmark's rate comparison: gatekeeper beside Caddy and HAProxy at fixed rates and in a closed loop.

Part 4 of ``python -m loadtest bench proxy`` (``--only-modes`` runs only this). Each round runs, for each
worker count compared (1 and 2), gatekeeper ``--workers N``, Caddy ``GOMAXPROCS=N`` and HAProxy ``nbthread N``
back to back at every open-loop rate (``--rates``, h2load ``--rps``) and then in a closed loop; the order of
the three rotates from round to round so that none always runs first after a pause. For every run it reads
the proxy's CPU (utime + stime of its processes, /proc) over the run and divides by the requests answered:
at a fixed rate that includes what the proxy does per wake-up and per second with no request to serve, the
cost that makes CPU per request rise as the rate falls.

Every ratio is to Caddy (issue 42's reference: a mainstream Go L7 proxy; the goal is gatekeeper <= x1.0 of
its CPU per request at every rate and p99 at 600 req/s <= Caddy's), computed per round and reported as the
median of the rounds with each round's value beside it: on a shared 2-core machine one round moves by 30 %
with what else runs, and the arms of one round see the same machine. The load average is printed with
every round.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from typing import Any

from loadtest.bench.proxies import Env, cpu_seconds, h2load, load_average, start_warm, tree_pids, worker_requests

Run = dict[str, float]
"""One h2load run's figures: rps, p50, p99 (ms), ok2xx, failed, cpu_ms (proxy CPU per request), ..."""
PROXIES = ("gatekeeper", "caddy", "haproxy")
"""Every comparison's arms; ratios are to ``caddy``."""


def with_cpu(env: Env, pid: int, run: Callable[[], Run]) -> Run:
    """``run()`` plus the proxy's CPU per request (``cpu_ms``) and that of the apiservers and etcd behind it
    (``behind_ms``: on a machine they share, the proxy's protocol toward them costs throughput too)."""
    pids = tree_pids(pid)
    sandbox = [p.pid for p in env.state.processes if p.pid]
    cpu0, behind0 = cpu_seconds(pids), cpu_seconds(sandbox)
    r = run()
    r["cpu_ms"] = (cpu_seconds(pids) - cpu0) * 1000 / max(1.0, r["ok2xx"])
    r["behind_ms"] = (cpu_seconds(sandbox) - behind0) * 1000 / max(1.0, r["ok2xx"])
    return r


def open_loop(env: Env, base: str, pid: int, rate: int, seconds: float, clients: int = 4) -> Run:
    """``rate`` req/s for ``seconds`` (h2load --rps per client): p50/p99 and the proxy's CPU per request."""
    return with_cpu(env, pid, lambda: h2load(env, base, int(rate * seconds), clients, 8, rps=max(1, rate // clients)))


def at_rate(env: Env, rate: int, seconds: float, base: str, pid: int) -> Run:
    return open_loop(env, base, pid, rate, seconds)


def closed_loop(env: Env, base: str, pid: int, n: int, clients: int, streams: int) -> Run:
    """Closed loop plus CPU per request; for gatekeeper with several workers also how the requests split over
    them (``busiest_share``: a closed loop runs at the speed of the busiest worker)."""
    metrics = env.gk_metrics.get(base)
    split0 = worker_requests(metrics) if metrics else []
    r = with_cpu(env, pid, lambda: h2load(env, base, n, clients, streams))
    if len(split0) > 1 and metrics:
        split = [b - a for a, b in zip(split0, worker_requests(metrics), strict=True)]
        r["busiest_share"] = max(split) / max(1.0, sum(split))
    return r


def spread(ratios: list[float]) -> str:
    """A ratio over rounds: the median, and every round when there are several."""
    if len(ratios) == 1:
        return f"x{ratios[0]:.2f}"
    return f"x{statistics.median(ratios):.2f} (rounds {', '.join(f'{r:.2f}' for r in ratios)})"


def rotated(items: tuple[str, ...], by: int) -> list[str]:
    """``items`` started at position ``by`` (mod its length): each round's order of the arms."""
    k = by % len(items)
    return [*items[k:], *items[:k]]


def start_all(env: Env, counts: list[int], pairs: list[int]) -> dict[str, dict[int, tuple[str, int]]]:
    """gatekeeper for every worker count, Caddy and HAProxy for every compared count, each warmed up."""
    gk, hap = start_warm(env, {w: {"name": f"gk-w{w}", "workers": w} for w in counts},
                         {t: {"nbthread": t, "name": f"hap-t{t}"} for t in pairs})
    caddy = {p: env.start_caddy(p, f"caddy-p{p}") for p in pairs}
    for url, _ in caddy.values():
        h2load(env, url, 400, 4, 4)
    return {"gatekeeper": gk, "caddy": caddy, "haproxy": hap}


def label(proxy: str, n: int) -> str:
    return {"gatekeeper": f"gatekeeper --workers {n}", "caddy": f"caddy GOMAXPROCS={n}",
            "haproxy": f"haproxy nbthread {n}"}[proxy]


def summary(runs: dict[str, list[Run]], n: int, keys: tuple[str, ...]) -> None:
    """One line per proxy (medians over rounds), then each one's ratios to Caddy, round by round."""
    for proxy in PROXIES:
        rs = runs[proxy]
        med = {k: statistics.median([r[k] for r in rs]) for k in keys}
        shares = [r["busiest_share"] for r in rs if "busiest_share" in r]
        share = f"  busiest worker {statistics.median(shares):.0%} of requests" if shares else ""
        print(f"  {label(proxy, n):24s} {med['rps']:7.0f} req/s  p50 {med['p50']:6.2f} p99 {med['p99']:6.2f} ms  "
              f"CPU {med['cpu_ms']:.3f} ms/req (apiservers+etcd {med['behind_ms']:.3f})  "
              f"failed {sum(r['failed'] for r in rs):.0f}{share}")
    for proxy in ("gatekeeper", "haproxy"):
        pairs = list(zip(runs[proxy], runs["caddy"], strict=True))
        print(f"  {proxy} / caddy: CPU per request {spread([g['cpu_ms'] / max(c['cpu_ms'], 1e-6) for g, c in pairs])}"
              f", p50 {spread([g['p50'] / c['p50'] for g, c in pairs])}, "
              f"p99 {spread([g['p99'] / c['p99'] for g, c in pairs])}, "
              f"throughput {spread([g['rps'] / c['rps'] for g, c in pairs])}")


def modes(env: Env, args: argparse.Namespace) -> None:
    """Open loop at each fixed rate and the closed loop, gatekeeper beside Caddy and HAProxy, ``--rounds``
    interleaved rounds; then throughput by gatekeeper worker count (``--workers-table``)."""
    counts = sorted({1, 2, *args.workers_table})
    pairs = sorted(set(args.compare_workers))
    rounds = max(1, args.rounds)
    targets = start_all(env, counts, pairs)
    n, c, m = args.requests, args.clients, args.streams
    stages: list[tuple[str, Callable[[str, int], Run]]] = []
    if "rates" not in args.skip:
        for rate in args.rates:
            stages.append((f"{rate} req/s open loop ({args.rate_seconds:.0f} s, h2load --rps, 4 connections)",
                           functools.partial(at_rate, env, rate, args.rate_seconds)))
    if "closed" not in args.skip:
        stages.append((f"closed loop (h2load -n {n} -c {c} -m {m})",
                       lambda url, pid: closed_loop(env, url, pid, n, c, m)))
    results: dict[tuple[int, int], dict[str, list[Run]]] = {}
    extra: dict[int, list[Run]] = {w: [] for w in counts if w not in pairs}
    print(f"\nload average before: {load_average()}; {rounds} interleaved round(s); ratios are to Caddy")
    for rnd in range(rounds):
        for s, (_, run) in enumerate(stages):
            for w in pairs:
                for proxy in rotated(PROXIES, rnd + s + w):
                    url, pid = targets[proxy][w]
                    results.setdefault((s, w), {p: [] for p in PROXIES})[proxy].append(run(url, pid))
            if s == len(stages) - 1 and "closed" not in args.skip:
                for w, rs in extra.items():  # worker counts only the throughput table needs
                    rs.append(run(*targets["gatekeeper"][w]))
        print(f"round {rnd + 1} done; load average {load_average()}", flush=True)
    keys = ("rps", "p50", "p99", "cpu_ms", "behind_ms")
    for s, (title, _) in enumerate(stages):
        print(f"\n== {title} ==")
        for w in pairs:
            summary(results[(s, w)], w, keys)
    if "closed" not in args.skip:
        last = len(stages) - 1
        by_workers = {w: results[(last, w)]["gatekeeper"] if w in pairs else extra[w] for w in counts}
        print("throughput by gatekeeper workers: " + ", ".join(
            f"{w}: {spread([g['rps'] / b['rps'] for g, b in zip(rs, by_workers[1], strict=True)])}"
            for w, rs in by_workers.items()))
    print(f"load average after: {load_average()}")


def cpu_ticks() -> tuple[int, int]:
    """(all ticks, idle + iowait ticks) since boot, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values), values[3] + values[4]


def static_scaling(env: Env, args: argparse.Namespace) -> None:
    """Closed loop by worker count with the proxy as the bottleneck (static backends)."""
    counts = sorted({1, 2, *args.workers_table})
    static = env.start_static_backends(3)
    gk, hap = start_warm(env, {w: {"name": f"gk-static-w{w}", "workers": w} for w in counts},
                         {t: {"nbthread": t, "name": f"hap-static-t{t}"} for t in counts}, backends=static)
    n, c, m = args.requests, args.clients, args.streams
    print(f"\n== scaling, static backends: h2load -n {n} -c {c} -m {m}; load average {load_average()} ==")
    res: dict[str, dict[str, Any]] = {}
    for key, (url, pid) in [*((f"gk{w}", gk[w]) for w in counts), *((f"hap{t}", hap[t]) for t in counts)]:
        t0, i0 = cpu_ticks()
        r = closed_loop(env, url, pid, n, c, m)
        t1, i1 = cpu_ticks()
        r["busy"] = 1 - (i1 - i0) / max(1, t1 - t0)
        res[key] = r
        name = f"gatekeeper --workers {key[2:]}" if key.startswith("gk") else f"haproxy nbthread {key[3:]}"
        print(f"{name:24s} {r['rps']:7.0f} req/s  p50 {r['p50']:6.2f} ms  CPU {r['cpu_ms']:.3f} ms/req  "
              f"machine busy {r['busy']:.0%}  failed {r['failed']:.0f}")
    for w in counts:
        g, h = res[f"gk{w}"], res[f"hap{w}"]
        print(f"workers {w} / nbthread {w}: throughput x{g['rps'] / h['rps']:.2f}, "
              f"CPU per request x{g['cpu_ms'] / max(h['cpu_ms'], 1e-6):.1f}")
    print("throughput by workers: " + ", ".join(f"{w}: x{res[f'gk{w}']['rps'] / res['gk1']['rps']:.2f}"
                                                for w in counts))
    print(f"load average after: {load_average()}")
