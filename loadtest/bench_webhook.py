"""Benchmark the admission webhook over TLS; prints figures, asserts nothing.

    .venv/bin/python loadtest/bench_webhook.py [--seconds 5] [--concurrency 16]

For each server (a trivial aiohttp+uvloop TLS handler as the *reference*, the
webhook with 1 worker, the webhook with ``--workers 2``) and each payload
(a small GPU pod -> DRA rewrite; a 200 KiB Secret -> denial), a closed loop of
``--concurrency`` keep-alive HTTPS clients runs for ``--seconds`` and reports
reviews/s and p50/p99 latency. Then an open loop at half the single-worker
small-pod rate reports p50/p99 at that load, and the pure policy core
(parse + decide + encode, no HTTP) is timed in-process for the per-core ceiling.

Caveats: the load generator shares the machine (2 cores here, shared with
other work), so absolute numbers are noisy; compare each row with the
reference measured in the same run (``vs ref``). GPU reviews are sent with
``dryRun: true`` so no apiserver is needed for ResourceClaimTemplates (a
non-dryRun review only adds a cache lookup once the template exists).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gatekeeper.certs.pki import PKI  # noqa: E402


def gpu_pod_review() -> bytes:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "job-", "namespace": "team-a"},
           "spec": {"containers": [{"name": "main", "image": "cuda:12",
                                    "resources": {"limits": {"nvidia.com/gpu": "2", "cpu": "4"}}}]}}
    return _review("Pod", "pods", pod, dry_run=True)


def big_secret_review() -> bytes:
    meta = {"name": "model-certs", "namespace": "team-a"}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": meta,
              "type": "Opaque", "data": {"bundle": base64.b64encode(os.urandom(200 * 1024)).decode()}}
    return _review("Secret", "secrets", secret)


def _review(kind: str, resource: str, obj: dict[str, Any], dry_run: bool = False) -> bytes:
    return orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": kind},
        "resource": {"group": "", "version": "v1", "resource": resource}, "operation": "CREATE",
        "namespace": "team-a", "object": obj, "dryRun": dry_run, "userInfo": {"username": "bench"}}})


REFERENCE_SERVER = r'''
import ssl, sys, uvloop
from aiohttp import web
async def echo(request):
    await request.read()
    return web.Response(body=b'{"ok":true}', content_type="application/json")
app = web.Application(client_max_size=32 * 1024 * 1024)
app.router.add_post("/validate", echo)
app.router.add_post("/mutate", echo)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
async def main():
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    print(site._server.sockets[0].getsockname()[1], flush=True)
    import asyncio
    await asyncio.Event().wait()
uvloop.run(main())
'''


class Server:
    def __init__(self, argv: list[str], port_file: Path | None = None) -> None:
        self.port_file = port_file
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True)

    def port(self) -> int:
        if self.port_file is None:
            assert self.proc.stdout is not None
            return int(self.proc.stdout.readline())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.port_file.exists() and self.port_file.read_text().strip():
                return int(self.port_file.read_text())
            time.sleep(0.05)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


async def closed_loop(url: str, body: bytes, ctx: ssl.SSLContext, seconds: float, concurrency: int,
                      max_requests: int = 2_000_000) -> tuple[float, list[float]]:
    lat: list[float] = []
    conn = aiohttp.TCPConnector(ssl=ctx, limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        for _ in range(concurrency):  # warm up connections and TLS sessions
            async with s.post(url, data=body) as r:
                await r.read()
        end = time.perf_counter() + seconds
        started = time.perf_counter()

        async def worker() -> None:
            while time.perf_counter() < end and len(lat) < max_requests:
                t = time.perf_counter()
                async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}")
                lat.append(time.perf_counter() - t)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return len(lat) / elapsed, lat


async def open_loop(url: str, body: bytes, ctx: ssl.SSLContext, rate: float, seconds: float) -> list[float]:
    lat: list[float] = []
    conn = aiohttp.TCPConnector(ssl=ctx, limit=64)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def one() -> None:
            t = time.perf_counter()
            async with s.post(url, data=body) as r:
                await r.read()
            lat.append(time.perf_counter() - t)

        for _ in range(8):
            await one()
        lat.clear()
        tasks = []
        start = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return lat


def group_cpu_seconds(pgid: int) -> float:
    """utime+stime of every live process in the group (server parent + workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return total


def h2load(url: str, body: bytes, seconds: float, concurrency: int, tmp: Path,
           rate: float | None = None) -> tuple[float, list[float]]:
    """nghttp2's h2load over HTTP/1.1+TLS (a C client: far less CPU than ours).

    Closed loop, or with ``rate`` an open-ish loop: each client sends at rate/concurrency per second.
    """
    data, log = tmp / "body.json", tmp / "h2load.log"
    data.write_bytes(body)
    log.unlink(missing_ok=True)
    paced = [f"--rps={rate / concurrency:.2f}"] if rate else []
    out = subprocess.run(["h2load", "--h1", "-c", str(concurrency), "-m", "1", "-D", str(int(seconds)),
                          "--warm-up-time", "1", "-d", str(data), "-H", "Content-Type: application/json",
                          *paced, f"--log-file={log}", url], capture_output=True, text=True,
                         timeout=seconds + 60)
    rows = [line.split("\t") for line in log.read_text().splitlines() if line.strip()]
    bad = [r for r in rows if r[1] != "200"]
    if out.returncode != 0 or bad or not rows:
        raise RuntimeError(f"h2load failed ({len(bad)} non-200): {out.stdout[-500:]} {out.stderr[-500:]}")
    lat = [int(r[2]) / 1e6 for r in rows]
    return len(rows) / seconds, lat


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))] * 1000


def core_rate(body: bytes, route: str, seconds: float = 2.0) -> float:
    from dataclasses import replace

    from gatekeeper.kube.admission import parse_review, response
    from gatekeeper.webhook import policies
    from gatekeeper.webhook.settings import GpuSettings, WebhookSettings

    settings = WebhookSettings(gpu=GpuSettings(default_mode="dra"))
    fn = policies.mutate if route == "mutate" else policies.validate
    n, end = 0, time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < end:
        for _ in range(100):
            req = parse_review(body)
            _, d = fn(req, settings)
            orjson.dumps(response(req.uid, replace(d, templates=[])))
        n += 100
    return n / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of each closed-loop run (max 60)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--python-client", action="store_true",
                    help="use the aiohttp client even if h2load exists")
    args = ap.parse_args()
    seconds = min(args.seconds, 60.0)
    tmp = Path(tempfile.mkdtemp(prefix="bench-webhook-"))
    pki = PKI(tmp / "pki")
    pki.init()
    issued = pki.issue_serving("webhook", ips=["127.0.0.1"])
    ctx = ssl.create_default_context(cafile=str(pki.cert_path("ca")))
    cfg = tmp / "config.yaml"
    cfg.write_text("webhook:\n  server:\n    port: 0\n"
                   f"    certFile: {issued.cert}\n    keyFile: {issued.key}\n"
                   f"  gpu:\n    defaultMode: dra\n")
    payloads = {"small GPU pod": ("mutate", gpu_pod_review()),
                "200 KiB Secret": ("validate", big_secret_review())}
    py = sys.executable
    servers = {
        "reference (aiohttp TLS echo)": lambda: Server([py, "-c", REFERENCE_SERVER, str(issued.cert),
                                                        str(issued.key)]),
        "webhook, 1 worker": lambda: Server([py, "-m", "gatekeeper", "webhook", "--config", str(cfg),
                                             "--port-file", str(tmp / "p1")], tmp / "p1"),
        "webhook, --workers 2": lambda: Server([py, "-m", "gatekeeper", "webhook", "--config", str(cfg),
                                                "--workers", "2", "--port-file", str(tmp / "p2")],
                                               tmp / "p2"),
    }
    use_h2load = shutil.which("h2load") is not None and not args.python_client
    client = "h2load (nghttp2, HTTP/1.1)" if use_h2load else "python aiohttp client"
    print(f"cpus={os.cpu_count()} concurrency={args.concurrency} seconds={seconds} client={client}")
    rows: dict[tuple[str, str], tuple[float, float, float, float]] = {}
    for sname, factory in servers.items():
        srv = factory()
        try:
            port = srv.port()
            for pname, (route, body) in payloads.items():
                url = f"https://127.0.0.1:{port}/{route}"
                cpu0 = group_cpu_seconds(srv.proc.pid)
                if use_h2load:
                    rate, lat = h2load(url, body, seconds, args.concurrency, tmp)
                else:
                    rate, lat = asyncio.run(closed_loop(url, body, ctx, seconds, args.concurrency))
                cpu = group_cpu_seconds(srv.proc.pid) - cpu0
                # h2load's warm-up second is in the CPU time too: count it at the measured rate.
                served = rate * (seconds + (1 if use_h2load else 0))
                per_core = served / cpu if cpu > 0 else float("nan")
                rows[(sname, pname)] = (rate, pct(lat, 50), pct(lat, 99), per_core)
            if sname == "webhook, 1 worker":
                half = rows[(sname, "small GPU pod")][0] / 2
                url = f"https://127.0.0.1:{port}/mutate"
                if use_h2load:
                    _, lat = h2load(url, gpu_pod_review(), seconds, args.concurrency, tmp, rate=half)
                else:
                    lat = asyncio.run(open_loop(url, gpu_pod_review(), ctx, half, seconds))
                rows[(sname, f"small GPU pod @ {half:.0f}/s open loop")] = (
                    half, pct(lat, 50), pct(lat, 99), float("nan"))
        finally:
            srv.stop()
    print(f"\n{'server':30} {'payload':34} {'reviews/s':>9} {'vs ref':>6} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'per server-CPU-s':>16}")
    for (sname, pname), (rate, p50, p99, per_core) in rows.items():
        ref = rows.get(("reference (aiohttp TLS echo)", pname.split(" @ ")[0]))
        ratio = f"{rate / ref[0]:.2f}" if ref and "@" not in pname else "-"
        print(f"{sname:30} {pname:34} {rate:9.0f} {ratio:>6} {p50:7.2f} {p99:7.2f} {per_core:16.0f}")
    print("\npolicy core in-process (parse + decide + encode, one core, no HTTP/TLS):")
    for pname, (route, body) in payloads.items():
        print(f"  {pname:20} {core_rate(body, route):10.0f} reviews/s")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n(HTTP figures include the load generator on the same {os.cpu_count()} cores: "
          "read the 'vs ref' column)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
