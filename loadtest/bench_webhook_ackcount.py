"""What counting unread answers costs the webhook: reviews per server CPU-second with and without it.

    nice -n 19 .venv/bin/python loadtest/bench_webhook_ackcount.py [--rounds 5] [--requests 12000] [--concurrency 16]

``maxBufferedRequestBytes`` counts the bytes of each answer until the client's kernel acknowledges them
(``listen.MeteredRequestHandler.will_write`` and ``_account``: a ``getsockopt(TCP_INFO)`` when an answer is
written and at the next count after it). Two webhooks run side by side from this tree (one worker each, the
default settings, TLS on 127.0.0.1): ``count`` as shipped, ``no count`` with ``will_write`` made a no-op at startup
(no answer is counted, so no ``TCP_INFO`` is read). For each payload (a 1 KiB Secret, a 200 KiB Secret), rounds
alternate between the two (the order flips every round): ``h2load --h1 -c CONCURRENCY -n REQUESTS`` posts the
review on keep-alive connections (a run not over in 120 s counts as nothing), and the server's CPU time
(``/proc/<pid>/stat`` utime + stime) is read before and after. Printed per round and as the median: reviews
answered per server CPU-second, and count / no count as a ratio. The load generator shares the machine: compare
the ratio, not the absolute figures.

Then, in process (less noisy than the end-to-end ratio on shared cores), what the count adds per answer: the
CPU time of ``listen.bytes_acked`` (one ``getsockopt(TCP_INFO)``) on a connected loopback socket and of one
``RequestBudget.hold`` among 1000 holders, best of 5 runs of 20000 calls each; an answer costs up to two of the
first (``strace -c`` of a count run: 2008 for 2000 answers on 4 keep-alive connections, one each) and one of the
second. And the protocol path of one 3 KB review (as in ``bench_webhook_heads.py``: parsed by
``MeteredRequestHandler``, answered by a trivial handler that reports its answer as the webhook's middleware
does), with the count and with ``will_write`` a no-op, best of 10 alternating runs of 3000; the transport writes
nothing, so no answer is ever acknowledged and every count reads ``TCP_INFO``: the most the count can cost.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gatekeeper.certs import PKI  # noqa: E402

NO_COUNT = """
import runpy, sys
from gatekeeper.webhook import listen
listen.MeteredRequestHandler.will_write = lambda self, size: None  # no answer counted: no TCP_INFO read
sys.argv = ["gatekeeper", *sys.argv[1:]]
runpy.run_module("gatekeeper", run_name="__main__", alter_sys=True)
"""


def secret_review(data_bytes: int) -> bytes:
    import orjson

    value = base64.b64encode(os.urandom(data_bytes)).decode()
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": "team-a"},
              "type": "Opaque", "data": {"bundle": value}}
    return orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "0b5f0e8c-1d1e-4c3e-9c55-5f2b3e1f7a10", "kind": {"group": "", "version": "v1", "kind": "Secret"},
        "resource": {"group": "", "version": "v1", "resource": "secrets"}, "operation": "CREATE",
        "namespace": "team-a", "name": "s", "object": secret, "userInfo": {"username": "u"}}})


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(cmd: list[str], tmp: Path, name: str, pki: PKI) -> tuple[subprocess.Popen[bytes], int]:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text("webhook:\n  server:\n    port: 0\n    certCheckIntervalSeconds: 0\n"
                   f"    certFile: {pki.cert_path('webhook')}\n    keyFile: {pki.key_path('webhook')}\n"
                   "  gpu:\n    enabled: false\n")
    port_file = tmp / f"{name}.port"
    proc = subprocess.Popen([*cmd, "webhook", "--config", str(cfg), "--port-file", str(port_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 30
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the webhook ({name}) did not start")
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def round_once(pid: int, port: int, body: Path, requests: int, concurrency: int) -> tuple[int, float]:
    """(reviews answered 200, server CPU seconds) of one h2load run; (0, 0) if it did not end within 120 s."""
    before = cpu_seconds(pid)
    try:
        proc = subprocess.run(["h2load", "--h1", "-c", str(concurrency), "-n", str(requests), "-d", str(body),
                               "-H", "Content-Type: application/json", f"https://127.0.0.1:{port}/validate"],
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return 0, 0.0
    out = proc.stdout + proc.stderr
    cpu = cpu_seconds(pid) - before
    m = re.search(r"status codes: (\d+) 2xx", out)
    if m is None or not int(m.group(1)):
        print(out[-1500:], file=sys.stderr)
    return (int(m.group(1)) if m else 0), cpu


def per_call(fn: Callable[[], object], calls: int = 20000, runs: int = 5) -> float:
    """Best CPU seconds per call of ``fn``."""
    best = float("inf")
    for _ in range(runs):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - t0) / calls)
    return best


def in_process() -> tuple[float, float]:
    """(seconds per ``bytes_acked``, seconds per ``RequestBudget.hold``)."""
    from gatekeeper.webhook.listen import bytes_acked
    from gatekeeper.webhook.request_budget import RequestBudget

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    try:
        conn.sendall(b"x" * 4096)
        client.recv(4096)
        assert bytes_acked(conn) is not None, "no TCP_INFO here"
        acked = per_call(lambda: bytes_acked(conn))
    finally:
        for s in (conn, client, server):
            s.close()
    budget: RequestBudget[int] = RequestBudget(8 << 20)
    for i in range(1000):
        budget.hold(i, 1000)
    return acked, per_call(lambda: budget.hold(7, 1000))


async def protocol_cpu(count: bool, n: int) -> float:
    """CPU seconds per review on the protocol path (see the module docstring), with or without the count."""
    import asyncio

    from aiohttp import web

    from gatekeeper.webhook.listen import MeteredRequestHandler
    from gatekeeper.webhook.request_budget import RequestBudget
    from loadtest.bench_webhook_heads import _Sink, drive_reviews

    lsock = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(lsock.getsockname())
    conn, _ = lsock.accept()

    class Sink(_Sink):
        def get_extra_info(self, name: str, default: object = None) -> object:
            return conn if name == "socket" else default

    async def ok(request: web.BaseRequest) -> web.Response:
        await request.read()
        resp = web.Response(text="ok")
        if count:
            protocol: Any = request.protocol  # a MeteredRequestHandler
            protocol.will_write(len(resp.text or "") + 64)
        return resp

    server = web.Server(ok)
    loop = asyncio.get_running_loop()
    handler = MeteredRequestHandler(server, budget=RequestBudget(1 << 30), on_evicted=lambda: None, loop=loop)
    try:
        return await drive_reviews(server, handler, Sink(), n)
    finally:
        for s in (conn, client, lsock):
            s.close()


def protocol_rows() -> tuple[float, float]:
    """Best (with the count, without) CPU seconds per review of 10 alternating runs of 3000."""
    import asyncio

    best = [1.0, 1.0]
    for _ in range(10):
        for i, count in enumerate((True, False)):
            best[i] = min(best[i], asyncio.run(protocol_cpu(count, 3000)))
    return best[0], best[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=12000, help="reviews per h2load run (the 1 KiB ones; a tenth "
                    "as many 200 KiB ones; at most 100000)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--same", action="store_true", help="both webhooks count (an A/A run: the bench's own bias)")
    args = ap.parse_args()
    requests = min(args.requests, 100000)
    if shutil.which("h2load") is None:
        raise SystemExit("h2load is needed (nghttp2-client)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-ackcount-"))
    servers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    try:
        pki = PKI(tmp / "pki")
        pki.init()
        pki.issue_serving("webhook", ips=["127.0.0.1"])
        servers["count"] = start([sys.executable, "-m", "gatekeeper"], tmp, "count", pki)
        servers["no count"] = start([sys.executable, "-m", "gatekeeper"] if args.same else
                                    [sys.executable, "-c", NO_COUNT], tmp, "nocount", pki)
        time.sleep(1)
        print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} interleaved rounds of "
              f"h2load --h1 -c {args.concurrency} -n {requests} (200 KiB: -n {requests // 10})")
        for label, size, n in (("1 KiB Secret", 1024, requests), ("200 KiB Secret", 200 * 1024, requests // 10)):
            body = tmp / "review.json"
            body.write_bytes(secret_review(size))
            rates: dict[str, list[float]] = {name: [] for name in servers}
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                cells = []
                for name in order:
                    proc, port = servers[name]
                    done, cpu = round_once(proc.pid, port, body, n, args.concurrency)
                    rates[name].append(done / cpu if cpu else 0.0)
                    cells.append(f"{name} {done} in {cpu:.2f} CPU-s = {rates[name][-1]:.0f}/CPU-s")
                print(f"  {label} round {r + 1}: " + "; ".join(cells), flush=True)
            med = {name: statistics.median(v) for name, v in rates.items()}
            ratios = [a / b for a, b in zip(rates["count"], rates["no count"], strict=True) if b]
            print(f"{label}: median reviews per server CPU-second: count {med['count']:.0f}, no count "
                  f"{med['no count']:.0f}; count / no count x{med['count'] / med['no count']:.3f} (per round "
                  f"{', '.join(f'{x:.3f}' for x in ratios)})", flush=True)
        acked, hold = in_process()
        print(f"in process: bytes_acked (getsockopt TCP_INFO) {acked * 1e6:.2f} us, RequestBudget.hold "
              f"{hold * 1e6:.2f} us; per answer (2 + 1) {(2 * acked + hold) * 1e6:.2f} us")
        with_count, without = protocol_rows()
        print(f"protocol path of a 3 KB review: {with_count * 1e6:.1f} us with the count, {without * 1e6:.1f} us "
              f"without (+{(with_count - without) * 1e6:.1f} us)")
        print(f"load average {os.getloadavg()[0]:.2f}")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
