"""The seeds' secret-LIST incident in miniature: direct vs HAProxy vs gatekeeper, in one run.

For each scenario a fresh sandbox (3 kube-apiservers on one etcd) is started
in its own state directory, N Secrets of SIZE bytes are written, and C
concurrent listers (distinct users, client certificates) each LIST all Secrets
of the namespace R times, as client-go would: full LIST, body streamed and
counted (not parsed), 429 + Retry-After retried up to 10 times. Reported per
scenario:

* peak kube-apiserver RSS (sum over the 3 apiservers, sampled from /proc
  every 200 ms) and its growth over the idle baseline (apiservers restarted
  after the fixtures are written, so the baseline is a fresh heap plus the
  watch cache), and the same for the Go heap in use
  (``go_memstats_heap_alloc_bytes`` from each apiserver's /metrics): Go keeps
  freed memory mapped, so RSS hides allocation bursts the heap figure shows,
* LIST latency p50/p99 (end to end, including queueing and retries),
* errors (anything but a complete 200 after retries) and 429s seen,
* upstream LIST count (the apiservers' own ``apiserver_request_total``),

and ratios against the direct run. Scenarios: ``direct`` (clients spread
round-robin over the apiservers), ``haproxy`` (TCP mode, TLS passthrough,
leastconn; Debian's haproxy), ``gatekeeper`` (seeds' policy,
deploy/examples/flowcontrol-seeds.yaml), and ``gatekeeper-same-user`` (all
listers one identity, so coalescing applies).

Run: ``.venv/bin/python loadtest/bench_list_storm.py [--secrets 300 --size-kib 200 --clients 20 --rounds 2]``.
Bounded: every LIST has a 300 s limit and each scenario tears its sandbox down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "flowcontrol"))
import storm_kit as kit

from gatekeeper.certs.pki import PKI
from gatekeeper.sandbox import processes
from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState

NS = "bench-storm"


@dataclass
class Result:
    name: str
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    throttled: int = 0
    upstream_lists: float = 0.0
    baseline_rss: int = 0
    peak_rss: int = 0
    baseline_heap: float = 0.0
    peak_heap: float = 0.0
    wall: float = 0.0
    notes: str = ""
    first_error: str = ""


def sandbox_up(directory: Path) -> SandboxState:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gatekeeper",
            "sandbox",
            "up",
            "--state-dir",
            str(directory),
            "--apiservers",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if p.returncode != 0:
        raise SystemExit(f"sandbox up failed:\n{p.stdout}\n{p.stderr}")
    return SandboxState.load(directory)


def restart_apiservers(state: SandboxState) -> None:
    """Restart every kube-apiserver of this (private) sandbox so the storm starts from a fresh heap.

    Writing the fixtures grows the Go heap, and Go keeps freed heap mapped, so
    without a restart the storm would reuse that memory and RSS would hide
    what the storm itself costs. After the restart each apiserver only holds
    its watch cache (which loads all Secrets), as after a rollout.
    """
    recs = [r for r in state.processes if r.name.startswith("kube-apiserver")]
    processes.stop(recs)
    fresh = [
        processes.start(r.name, r.cmd, Path(r.log), env=r.env, ports=r.ports, urls=r.urls, health=r.health)
        for r in recs
    ]
    state.processes = [next((f for f in fresh if f.name == p.name), p) for p in state.processes]
    state.save()
    deadline = time.monotonic() + 120
    for u in state.apiserver_urls:
        while True:
            try:

                async def ready(url: str = u) -> int:
                    async with kit.admin_client(state, url, timeout=5) as c:
                        return (await c.get("/readyz")).status_code

                if asyncio.run(ready()) == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"apiserver {u} not ready after restart")
            time.sleep(0.5)


def sandbox_down(directory: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "gatekeeper", "sandbox", "down", "--state-dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@contextlib.contextmanager
def haproxy(state: SandboxState, directory: Path) -> Iterator[str]:
    port = kit.free_port()
    servers = "\n".join(f"    server a{i} {u.removeprefix('https://')}" for i, u in enumerate(state.apiserver_urls))
    cfg = directory / "haproxy.cfg"
    cfg.write_text(f"""global
    maxconn 4096
defaults
    mode tcp
    timeout connect 5s
    timeout client 600s
    timeout server 600s
frontend fe
    bind 127.0.0.1:{port}
    default_backend apiservers
backend apiservers
    balance leastconn
{servers}
""")
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        if proc.poll() is not None:
            raise SystemExit("haproxy did not start (apt-get install -y haproxy)")
        yield f"https://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def client_context(state: SandboxState, user: str) -> ssl.SSLContext:
    issued = PKI(state.certs_dir).issue_client(f"bench-{user}", user=user, groups=[kit.STORM_GROUP])
    ctx = ssl.create_default_context(cafile=str(SandboxPKI(Path(state.certs_dir)).ca))
    ctx.load_cert_chain(str(issued.cert), str(issued.key))
    return ctx


async def lister(url: str, ctx: ssl.SSLContext, rounds: int, expect_bytes: int, res: Result) -> None:
    # identity encoding: the apiserver would otherwise gzip (CPU-bound on this 2-core box) and the
    # byte count below checks completeness on the plain JSON size
    headers = {"accept": "application/json", "accept-encoding": "identity"}
    async with httpx.AsyncClient(
        base_url=url, verify=ctx, timeout=httpx.Timeout(300, connect=10), headers=headers
    ) as c:
        for _ in range(rounds):
            t0 = time.monotonic()
            ok = False
            for _attempt in range(11):
                try:
                    async with c.stream("GET", f"/api/v1/namespaces/{NS}/secrets") as r:
                        if r.status_code == 429 and "retry-after" in r.headers:
                            res.throttled += 1
                            await r.aread()
                            await asyncio.sleep(int(r.headers["retry-after"]))
                            continue
                        n = 0
                        async for chunk in r.aiter_raw():
                            n += len(chunk)
                        ok = r.status_code == 200 and n >= expect_bytes
                        if not ok and not res.first_error:
                            res.first_error = f"status {r.status_code}, {n} bytes (expected >= {expect_bytes})"
                except (httpx.HTTPError, OSError) as exc:
                    ok = False
                    res.first_error = res.first_error or f"{type(exc).__name__}: {exc}"
                break
            if ok:
                res.latencies.append(time.monotonic() - t0)
            else:
                res.errors += 1


async def storm(state: SandboxState, urls: list[str], users: list[str], rounds: int, expect: int, res: Result) -> None:
    sampler = kit.ApiserverSampler(state, interval=0.2)
    res.baseline_rss = sampler.rss_total()
    texts = await kit.apiserver_metrics(state)
    res.baseline_heap = sum(kit.metric_sum(t, "go_memstats_heap_alloc_bytes") for t in texts)
    before = sum(kit.metric_sum(t, "apiserver_request_total", verb="LIST", resource="secrets") for t in texts)
    sampling = asyncio.create_task(sampler.run(with_metrics=True))
    ctxs = [client_context(state, u) for u in users]
    t0 = time.monotonic()
    await asyncio.gather(*(lister(urls[i % len(urls)], ctxs[i], rounds, expect, res) for i in range(len(users))))
    res.wall = time.monotonic() - t0
    sampler.stop()
    await sampling
    res.peak_rss = sampler.peak_rss_total
    res.peak_heap = max(sampler.peak_heap_total, res.baseline_heap)
    after = sum(
        kit.metric_sum(t, "apiserver_request_total", verb="LIST", resource="secrets")
        for t in await kit.apiserver_metrics(state)
    )
    res.upstream_lists = after - before


def scenario(name: str, args: argparse.Namespace, root: Path) -> Result:
    directory = root / name
    res = Result(name)
    state = sandbox_up(directory / "sandbox")
    try:
        asyncio.run(kit.create_secrets(state, NS, args.secrets, args.size_kib * 1024))
        rbac = kit.kubectl(state, "apply", "-f", "-", input=kit.storm_rbac_and_observer())
        if rbac.returncode != 0:
            raise SystemExit(rbac.stderr)
        restart_apiservers(state)
        time.sleep(3)  # watch caches filled; baseline next
        expect = args.secrets * args.size_kib * 1024 * 4 // 3
        users = [f"lister-{i}" for i in range(args.clients)]
        if name == "direct":
            asyncio.run(storm(state, state.apiserver_urls, users, args.rounds, expect, res))
        elif name == "haproxy":
            with haproxy(state, directory) as url:
                asyncio.run(storm(state, [url], users, args.rounds, expect, res))
        else:
            if name == "gatekeeper-same-user":
                users = ["lister-same"] * args.clients
            with kit.run_proxy(state, directory, {"files": [str(kit.SEEDS)]}) as proxy:
                asyncio.run(storm(state, [proxy.url], users, args.rounds, expect, res))
                text = proxy.metrics()
                coalesced = kit.metric_sum(text, "gatekeeper_flowcontrol_coalesced_requests_total")
                peak = kit.metric_sum(
                    text, "gatekeeper_flowcontrol_peak_executing_requests", priority_level="secrets-list"
                )
                res.notes = f"coalesced={coalesced:.0f} peak_upstream_secret_lists={peak:.0f}"
    finally:
        sandbox_down(directory / "sandbox")
    return res


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(results: list[Result], args: argparse.Namespace) -> None:
    ref = results[0]
    mib = 1 << 20
    print(
        f"\nLIST storm: {args.secrets} Secrets x {args.size_kib} KiB, "
        f"{args.clients} listers x {args.rounds} rounds, 3 apiservers\n"
    )
    print(
        f"{'scenario':22} {'peak RSS':>9} {'+RSS':>6} {'peak heap':>9} {'+heap':>7} {'p50 s':>6} {'p99 s':>6} "
        f"{'ok':>3} {'err':>3} {'429':>4} {'upstream':>8} {'wall s':>6}"
    )
    for r in results:
        print(
            f"{r.name:22} {r.peak_rss / mib:8.0f}M {(r.peak_rss - r.baseline_rss) / mib:5.0f}M "
            f"{r.peak_heap / mib:8.0f}M {(r.peak_heap - r.baseline_heap) / mib:6.0f}M "
            f"{pct(r.latencies, 0.5):6.2f} {pct(r.latencies, 0.99):6.2f} {len(r.latencies):3d} {r.errors:3d} "
            f"{r.throttled:4d} {r.upstream_lists:8.0f} {r.wall:6.1f}  {r.notes}"
            + (f" first error: {r.first_error}" if r.first_error else "")
        )
    print("\nratios against direct:")
    for r in results[1:]:
        heap_ref = max(1.0, ref.peak_heap - ref.baseline_heap)
        print(
            f"  {r.name:22} peak RSS x{r.peak_rss / max(1, ref.peak_rss):.2f}  "
            f"peak heap x{r.peak_heap / max(1.0, ref.peak_heap):.2f}  "
            f"heap growth x{(r.peak_heap - r.baseline_heap) / heap_ref:.2f}  "
            f"p50 x{pct(r.latencies, 0.5) / pct(ref.latencies, 0.5):.2f}  "
            f"p99 x{pct(r.latencies, 0.99) / pct(ref.latencies, 0.99):.2f}  "
            f"upstream LISTs x{r.upstream_lists / max(1.0, ref.upstream_lists):.2f}"
        )
    if results:
        print(f"\n(median of client wall times: {statistics.median(r.wall for r in results):.1f} s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--secrets", type=int, default=300)
    ap.add_argument("--size-kib", type=int, default=200)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scenarios", default="direct,haproxy,gatekeeper,gatekeeper-same-user")
    ap.add_argument("--work-dir", default="", help="where sandboxes live (default: a temp dir, removed)")
    args = ap.parse_args()
    if shutil.which("haproxy") is None and "haproxy" in args.scenarios:
        print("haproxy not found: apt-get install -y haproxy", file=sys.stderr)
        return 2
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-list-storm-"))
    results = []
    try:
        for name in args.scenarios.split(","):
            print(f"--- {name}", flush=True)
            results.append(scenario(name, args, root))
    finally:
        if not args.work_dir:
            shutil.rmtree(root, ignore_errors=True)
    report(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
