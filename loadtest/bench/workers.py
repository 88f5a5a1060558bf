"""How evenly ``--workers N`` spreads long-lived HTTP/2 clients, and who serves new clients while a worker is stopped.

The question behind the worker model: HTTP/2 clients keep one connection for hours, so the split of
connections at connect time is the split of load for their whole lives. Each round starts a proxy with
``--workers`` processes in front of a sandbox, opens ``--clients`` long-lived HTTP/2 clients (httpx, one GET
each, connection kept), reads each worker's open client connections from its own gauge, then SIGSTOPs
one worker and counts how many of ``--new-clients`` fresh clients get an answer within ``--timeout``.

``--base DIR`` also runs, interleaved round by round, the worker model of another source tree (e.g.
``git archive 2dafaaa gatekeeper | tar -x -C DIR``) with ``--base-config`` merged into its proxy section,
e.g. ``'{"connectionBalancing": "kernel"}'`` for the kernel's SO_REUSEPORT model that 2dafaaa still had.

    python -m loadtest.bench.workers --rounds 3 [--state-dir .sandbox] [--base /tmp/base]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import ssl
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess, metric_sum, run_down, sandbox_up

GAUGE = "gatekeeper_proxy_client_connections"


@dataclass
class Round:
    arm: str
    per_worker: list[int]
    new_served: int
    new_total: int
    new_p50_ms: float

    def line(self) -> str:
        spread = f"{max(self.per_worker)}/{min(self.per_worker)}" if self.per_worker else "-"
        return (f"{self.arm:<10} per worker {self.per_worker} (max/min {spread}); with one worker stopped: "
                f"{self.new_served}/{self.new_total} new clients served, p50 {self.new_p50_ms:.0f} ms")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def workers_of(p: ProxyProcess) -> list[dict[str, Any]]:
    return list(json.loads(_get(f"{p.metrics_url}/workers")))


def connections_per_worker(p: ProxyProcess) -> list[int]:
    return [int(metric_sum(_get(f"{w['metricsUrl']}/metrics/worker"), GAUGE, protocol="h2"))
            for w in sorted(workers_of(p), key=lambda w: w["index"]) if w["metricsUrl"]]


def tls(p: ProxyProcess) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=p.ca)
    ctx.load_cert_chain(*p.admin_cert)
    return ctx


async def open_clients(p: ProxyProcess, n: int, wait_seconds: float) -> tuple[list[httpx.AsyncClient], list[float]]:
    """``n`` clients, each with one answered GET on its own HTTP/2 connection (kept open); answer times."""
    ctx = tls(p)
    clients = [httpx.AsyncClient(http2=True, verify=ctx, timeout=wait_seconds) for _ in range(n)]
    times: list[float] = []

    async def one(c: httpx.AsyncClient) -> None:
        start = time.monotonic()
        with contextlib.suppress(httpx.HTTPError):
            r = await c.get(f"{p.url}/api/v1/namespaces/default")
            if r.status_code == 200 and r.http_version == "HTTP/2":
                times.append(time.monotonic() - start)

    sem = asyncio.Semaphore(20)  # the connects themselves: 20 TLS handshakes at a time

    async def bounded(c: httpx.AsyncClient) -> None:
        async with sem:
            await one(c)

    await asyncio.gather(*(bounded(c) for c in clients))
    return clients, times


async def one_round(arm: str, p: ProxyProcess, args: argparse.Namespace) -> Round:
    clients, _ = await open_clients(p, args.clients, 30)
    try:
        await asyncio.sleep(1)  # gauges are live state: nothing to flush
        per = connections_per_worker(p)
        victim = workers_of(p)[0]["pid"]
        os.kill(victim, signal.SIGSTOP)
        try:
            fresh, times = await open_clients(p, args.new_clients, args.timeout)
        finally:
            os.kill(victim, signal.SIGCONT)
        for c in fresh:
            await c.aclose()
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                await c.aclose()
    times.sort()
    return Round(arm, per, len(times), args.new_clients, times[len(times) // 2] * 1000 if times else float("nan"))


def run_arm(arm: str, state: SandboxState, workdir: Path, args: argparse.Namespace, tree: str | None,
            user_config: dict[str, Any]) -> Round:
    # PYTHONSAFEPATH: `python -m gatekeeper` would put the working directory (this checkout) first.
    p = ProxyProcess(state, workdir, name=f"bench-{arm}", workers=args.workers, user_config=user_config)
    p.start(env={"PYTHONPATH": tree, "PYTHONSAFEPATH": "1"} if tree else None)
    try:
        return asyncio.run(one_round(arm, p, args))
    finally:
        p.stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=None, help="a running sandbox (default: start one, 1 apiserver)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--clients", type=int, default=200, help="long-lived HTTP/2 clients per round")
    p.add_argument("--new-clients", type=int, default=40, help="clients opened while one worker is stopped")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds a new client waits for its answer")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--base", default=None, help="source tree (holds gatekeeper/) of a second arm, run interleaved")
    p.add_argument("--base-config", default="{}", help="JSON merged into the base arm's proxy section")


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.rounds <= 20 or not 1 <= args.clients <= 2000 or not 2 <= args.workers <= 16:
        print("--rounds 1..20, --clients 1..2000, --workers 2..16", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        state_dir = args.state_dir
        started = state_dir is None
        if started:
            state_dir = Path(tmp) / "sandbox"
            sandbox_up(state_dir, "--apiservers", "1", "--gpu-nodes", "0")
        try:
            state = SandboxState.load(state_dir)
            print(f"# load average {os.getloadavg()[0]:.2f}; {args.workers} workers, {args.clients} clients")
            for r in range(args.rounds):
                arms: list[tuple[str, str | None, dict[str, Any]]] = [("this tree", None, {})]
                if args.base:
                    arms.append(("base", args.base, json.loads(args.base_config)))
                for name, tree, cfg in arms:
                    work = Path(tmp) / f"{name.replace(' ', '-')}-{r}"
                    work.mkdir()
                    print(f"round {r + 1}: " + run_arm(name, state, work, args, tree, cfg).line(), flush=True)
            print(f"# load average {os.getloadavg()[0]:.2f}")
        finally:
            if started:
                run_down(state_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
