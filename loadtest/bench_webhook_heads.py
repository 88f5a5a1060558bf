"""Peak RSS of one webhook worker under request-head floods, this tree against a baseline ref; asserts nothing.

    .venv/bin/python loadtest/bench_webhook_heads.py [--baseline dev] [--scale 1.0]

For each scenario a fresh ``gatekeeper webhook`` process (one worker, uvloop, the default settings) is started from
the baseline's sources (``git archive <ref>``, imported ahead of this tree's editable install) and from this tree,
and one client process opens TLS connections on 127.0.0.1 that

* ``slow-heads``: send a head of 31 fields of 8 KB (within maxHeaderFields 32 / maxHeaderFieldBytes 8190) and never
  end it (400 connections);
* ``pipelined-heads``: pipeline 40 GET /metrics with such heads and never read an answer (10 connections);
* ``pipelined-bodies``: pipeline 40 GET /metrics with a 120 KB body each and never read (30 connections);
* ``pipelined-small``: pipeline 20000 plain GET /metrics with a 4 KiB receive buffer and never read: the parser,
  paused at 32 queued requests, keeps the rest of each read (200 connections).

Reported: the worker's VmHWM (peak RSS) growth over its RSS before the flood, 3 s after the last byte was sent, and
this tree's growth as a ratio of the baseline's in the same run. Then (this tree only) the CPU the budget's
bookkeeping adds per small review on the protocol path: aiohttp's RequestHandler and MeteredRequestHandler parse the
same request and answer it from a trivial handler, in process, best of 10 alternating runs of 3000. Connections
are bounded in count and time; the client is killed at the end of each run. The machine's other work makes the
figures noisy: compare ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gatekeeper.certs import PKI  # noqa: E402
from loadtest.webhook_flood import flood, run_one  # noqa: E402

SCENARIOS = {"slow-heads": 400, "pipelined-heads": 10, "pipelined-bodies": 30, "pipelined-small": 200}

# Imports gatekeeper from SRC, not from the editable install (whose finder would win over PYTHONPATH).
BOOT = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
        "sys.path.insert(0, sys.argv.pop(1)); from gatekeeper.cli import main; sys.exit(main())")


async def _client(port: int, ca: str, scenario: str, n: int) -> None:
    ctx = ssl.create_default_context(cafile=ca)
    fields = b"".join(b"X-F%02d: %s\r\n" % (i, b"a" * 8180) for i in range(31))
    held = []

    async def one() -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
        if scenario == "slow-heads":
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + fields)
        elif scenario == "pipelined-heads":
            for _ in range(40):
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
        elif scenario == "pipelined-bodies":
            for _ in range(40):
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 120000\r\n\r\n" + b"b" * 120000)
        else:
            writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 20000)
        await writer.drain()
        held.append(writer)

    await flood(n, one, (OSError,))  # cut by the server: what the budget is for
    print("sent", flush=True)
    await asyncio.sleep(60)  # killed by the parent long before


class _Sink(asyncio.Transport):
    """Counts writes; everything else a no-op (the in-process CPU comparison has no socket)."""

    def __init__(self) -> None:
        super().__init__()
        self.answered = asyncio.Event()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def write(self, data: object) -> None:
        self.answered.set()

    def writelines(self, data: object) -> None:
        self.answered.set()

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


REVIEW_REQUEST_BODY = (b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"x"},"pad":"'
                       + b"p" * 2900 + b'"}')
REVIEW_REQUEST = (b"POST /validate?timeout=10s HTTP/1.1\r\nHost: gatekeeper-webhook.gatekeeper-system.svc:443\r\n"
                  b"User-Agent: kube-apiserver-admission\r\nContent-Length: %d\r\nAccept: application/json, */*\r\n"
                  b"Content-Type: application/json\r\nAccept-Encoding: gzip\r\n\r\n" % len(REVIEW_REQUEST_BODY)
                  ) + REVIEW_REQUEST_BODY
"""A kube-apiserver-shaped POST of a ~3 KB review, as it arrives in one read."""


async def drive_reviews(server: Any, handler: Any, sink: _Sink, n: int) -> float:
    """CPU seconds per review: ``n`` times :data:`REVIEW_REQUEST` straight into ``handler`` (no socket), each
    until ``sink`` saw the answer; then the handler and ``server`` (an aiohttp ``web.Server``) are shut down."""
    handler.connection_made(sink)
    await asyncio.sleep(0)
    started = time.process_time()
    for _ in range(n):
        sink.answered.clear()
        handler.data_received(REVIEW_REQUEST)
        await sink.answered.wait()
    spent = (time.process_time() - started) / n
    handler.connection_lost(None)
    await asyncio.sleep(0)
    await server.shutdown()
    return spent


async def _protocol_cpu(metered: bool, n: int) -> float:
    from aiohttp import web

    from gatekeeper.webhook.listen import MeteredRequestHandler
    from gatekeeper.webhook.request_budget import RequestBudget

    async def ok(request: web.BaseRequest) -> web.Response:
        await request.read()
        return web.Response(text="ok")

    server = web.Server(ok)
    loop = asyncio.get_running_loop()
    handler = (MeteredRequestHandler(server, budget=RequestBudget(1 << 30), on_evicted=lambda: None, loop=loop)
               if metered else server())
    return await drive_reviews(server, handler, _Sink(), n)


async def _cpu_rows() -> tuple[float, float]:
    best = [1.0, 1.0]
    for _ in range(10):
        for metered in (0, 1):
            best[metered] = min(best[metered], await _protocol_cpu(bool(metered), 3000))
    return best[0], best[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="dev", help="git ref of the unpatched build")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the connection counts")
    ap.add_argument("--client", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        port, ca, scenario, n = args.client
        asyncio.run(_client(int(port), ca, scenario, int(n)))
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-heads-"))
    try:
        base_src = tmp / "baseline"
        base_src.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline, "gatekeeper"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base_src)], input=archive, check=True)
        pki = PKI(tmp / "pki")
        pki.init()
        pki.issue_serving("webhook", ips=["127.0.0.1"])
        mib = 1024 * 1024
        print(f"{'scenario':18} {'conns':>5} {'baseline':>16} {'this tree':>16} {'growth ratio':>12}")
        for scenario, n in SCENARIOS.items():
            n = max(1, int(n * args.scale))
            grown = {}
            for name, src in (("baseline", base_src), ("tree", ROOT)):
                base, peak, _ = run_one([sys.executable, "-c", BOOT, str(src)], __file__, scenario, n, tmp, pki,
                                        settle=3)
                grown[name] = (base, peak)
            (b0, b1), (t0, t1) = grown["baseline"], grown["tree"]
            print(f"{scenario:18} {n:5d} {b0 / mib:5.0f} -> {b1 / mib:4.0f} MiB {t0 / mib:5.0f} -> {t1 / mib:4.0f} MiB "
                  f"{(t1 - t0) / max(b1 - b0, 1):12.2f}", flush=True)
        import uvloop

        plain, metered = uvloop.run(_cpu_rows())
        print(f"protocol CPU per small review: aiohttp {plain * 1e6:.1f} us, with the budget {metered * 1e6:.1f} us "
              f"(+{(metered - plain) * 1e6:.1f} us)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
