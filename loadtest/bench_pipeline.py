"""CPU per request of the pipeline alone (no client TLS or HTTP/2): front stage, flow control, balancer,
lean upstream client, metrics; A/B between two source trees, interleaved.

Not a test. The whole-proxy figures (``split_ab.py``) move by +-15% on a busy
2-core machine, more than a hot-path change in the pipeline is worth. Here each
run is a separate process that builds the pipeline from the config
``sandbox up --with-proxy`` would give it (flow control as deployed), sends small
GETs with a bearer token straight into ``pipeline.handler`` (8 at a time), drains
each body and calls ``finish()`` as an adapter does, and reports its own
``process_time`` per request: the apiservers' CPU is not in it. ``--base DIR``
runs every other round from another tree (``git archive <commit> gatekeeper | tar -x -C DIR``)::

    python loadtest/bench_pipeline.py --state-dir /tmp/bench [--base /tmp/base] [-n 6000] [--rounds 6]
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


async def drive(config: str, token: str, n: int, concurrency: int) -> float:
    from gatekeeper.config import load_config
    from gatekeeper.proxy.command import flow_control_middleware
    from gatekeeper.proxy.messages import ProxyRequest
    from gatekeeper.proxy.pipeline.stages import build

    settings = load_config(Path(config), need="proxy").proxy
    flow = flow_control_middleware(settings)
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
        await batch(max(concurrency, n // 5))  # warm: pools, token cache, memos
        start = time.process_time()
        await batch(n)
        return (time.process_time() - start) / (n // concurrency * concurrency)
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
    import gatekeeper

    per = asyncio.run(drive(args.run, os.environ["BENCH_TOKEN"], args.n, args.concurrency))
    print(f"{per * 1e6:.1f} {Path(gatekeeper.__file__).parent}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir")
    ap.add_argument("--base")
    ap.add_argument("-n", type=int, default=6000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        run_child(args)
        return
    from bench_proxy import Env

    from gatekeeper.sandbox.testing import ProxyProcess
    from gatekeeper.sandbox.with_proxy import default_flow_control

    env = Env(args.state_dir, Path(tempfile.mkdtemp(prefix="bench-pipeline-")))
    env.make_token()
    gk = ProxyProcess(env.state, env.work, name="bench-pipeline", health_interval=0.5,
                      user_config={"flowControl": default_flow_control() or {}})
    trees = [("new", None), ("base", args.base)] if args.base else [("new", None)]
    results: dict[str, list[float]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        for name, tree in (trees if r % 2 == 0 else trees[::-1]):
            child_env = {**os.environ, "BENCH_TOKEN": env.token}
            child_env.pop("PYTHONPATH", None)
            if tree:
                child_env["PYTHONPATH"] = tree
            out = subprocess.run([sys.executable, __file__, "--run", str(gk.config_path), "-n", str(args.n),
                                  "--concurrency", str(args.concurrency)], env=child_env, cwd=env.work,
                                 capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
            us, src = out.stdout.split()
            results[name].append(float(us))
            print(f"round {r} {name:4s} {float(us):7.1f} us/req  ({src})  load {os.getloadavg()[0]:.2f}", flush=True)
    for name, values in results.items():
        print(f"{name:4s} median {statistics.median(values):.1f} us/req  min {min(values):.1f}  all {values}")
    if args.base:
        print(f"new/base (medians) {statistics.median(results['new']) / statistics.median(results['base']):.3f}")


if __name__ == "__main__":
    main()
