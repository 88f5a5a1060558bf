"""CPU per request of the pipeline alone (no client TLS or HTTP/2): front stage, flow control, balancer,
lean upstream client, metrics; A/B between two source trees, interleaved.

Not a test. The whole-proxy figures (``split_ab.py``) move by +-15% on a busy
2-core machine, more than a hot-path change in the pipeline is worth. Here each
run is a separate process that builds the pipeline from the config
``sandbox up --with-proxy`` would give it (flow control as deployed), sends small
GETs with a bearer token straight into ``pipeline.handler`` (8 at a time), drains
each body and calls ``finish()`` as an adapter does, and reports its own
``process_time`` per request: the apiservers' CPU is not in it. ``--base DIR``
runs a second process from another tree (``git archive <commit> gatekeeper | tar -x -C DIR``); the
two take turns batch by batch, and the figure is the median ratio of adjacent batches, so the
load of the moment (other tenants of a shared machine) cancels out::

    python loadtest/bench_pipeline.py --state-dir /tmp/bench [--base /tmp/base] [-n 800] [--rounds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


async def drive(config: str, token: str, n: int, concurrency: int) -> None:
    from gatekeeper.base.config import load_config
    from gatekeeper.proxy import process
    from gatekeeper.proxy.messages import ProxyRequest

    settings = load_config(Path(config), need="proxy").proxy
    start = getattr(process, "start_pipeline", None)
    if start is not None:
        flow, pipeline = await start(settings)
    else:  # a --base tree from before start_pipeline: what its process.run did
        from gatekeeper.proxy.pipeline.stages import build

        flow = process.flow_control_middleware(settings)
        pipeline = build(settings, flow_control=flow)
        if flow is not None:
            flow.use_upstream(list(pipeline.clients.values()))
            await flow.start()
        await pipeline.start()
    memos: list[dict[str, object]] = [{} for _ in range(concurrency)]

    async def one(i: int) -> None:
        request = ProxyRequest(
            method="GET", target="/api/v1/namespaces/default",
            headers=[("authorization", f"Bearer {token}"), ("accept", "application/json"),
                     ("user-agent", "bench-pipeline")],
            body=None, protocol="h2", peer="127.0.0.1:40000", connection_memo=memos[i % concurrency],
        )
        response = await pipeline.handler(request)
        error: BaseException | None = None
        try:
            async for _ in response.body:
                pass
        except Exception as exc:  # counted as a failure below
            error = exc
        response.finish(error)
        if response.status != 200 or error is not None:
            raise SystemExit(f"request failed: {response.status} {error}")

    async def loop(worker: int, count: int) -> None:
        for k in range(count):
            await one(worker + k)

    async def batch(total: int) -> None:
        await asyncio.gather(*(loop(w, total // concurrency) for w in range(concurrency)))

    try:
        await batch(max(concurrency, n))  # warm: pools, token cache, memos
        ev = asyncio.get_running_loop()
        while True:  # one batch per line on stdin; its CPU per request on stdout
            line = await ev.run_in_executor(None, sys.stdin.readline)
            if not line.strip():
                return
            start = time.process_time()
            await batch(n)
            print((time.process_time() - start) / (n // concurrency * concurrency) * 1e6, flush=True)
    finally:
        await pipeline.close()
        if flow is not None:
            await flow.close()


def run_child(args: argparse.Namespace) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(drive(args.run, os.environ["BENCH_TOKEN"], args.n, args.concurrency))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir")
    ap.add_argument("--base")
    ap.add_argument("-n", type=int, default=800, help="requests per batch")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        run_child(args)
        return
    from gatekeeper.sandbox.testing import ProxyProcess
    from gatekeeper.sandbox.with_proxy import default_flow_control
    from loadtest.bench.proxies import Env

    env = Env(args.state_dir, Path(tempfile.mkdtemp(prefix="bench-pipeline-")))
    env.make_token()
    gk = ProxyProcess(env.state, env.work, name="bench-pipeline", health_interval=0.5,
                      user_config={"flowControl": default_flow_control() or {}})
    trees = [("new", None), ("base", args.base)] if args.base else [("new", None)]
    children: dict[str, subprocess.Popen[str]] = {}
    for name, tree in trees:
        child_env = {**os.environ, "BENCH_TOKEN": env.token}
        child_env.pop("PYTHONPATH", None)
        if tree:
            child_env["PYTHONPATH"] = tree
        children[name] = subprocess.Popen(
            [sys.executable, __file__, "--run", str(gk.config_path), "-n", str(args.n),
             "--concurrency", str(args.concurrency)], env=child_env, cwd=env.work, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    results: dict[str, list[float]] = {name: [] for name, _ in trees}
    ratios: list[float] = []

    def batch(name: str) -> float:
        child = children[name]
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if not line:
            raise SystemExit(f"{name} exited ({child.wait()})")
        results[name].append(float(line))
        return float(line)

    try:
        for r in range(args.rounds):
            order = trees if r % 2 == 0 else trees[::-1]
            got = {name: batch(name) for name, _ in order}
            if args.base:
                ratios.append(got["new"] / got["base"])
            print(f"round {r:2d} " + "  ".join(f"{k} {v:6.1f}" for k, v in got.items())
                  + f"  us/req  load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        for child in children.values():
            if child.stdin is not None:
                child.stdin.close()
            child.wait(timeout=60)
    for name, values in results.items():
        print(f"{name:4s} median {statistics.median(values):.1f} us/req  min {min(values):.1f}")
    if ratios:
        print(f"new/base: median of paired ratios {statistics.median(ratios):.3f} "
              f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f}, "
              f"{len(ratios)} pairs)")


if __name__ == "__main__":
    main()
